"""`--model NAME=PATH` and `--model NAME=BUILTIN` serve a model under a name of the user's
choosing (a hub name such as Qwen/Qwen3-8B, which Tinker clients look models up by), beside
`--model PATH`; and the service tells which local directory a served model's tokenizer loads
from."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

from posttrain.cli import parser, serve_config
from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODELS, EngineConfig, ServerConfig
from posttrain.config_sources import builtin_model_specs
from posttrain.errors import ConfigError, InvalidRequest
from posttrain.service import build_services


def config_of(*flags: str) -> ServerConfig:
    return serve_config(parser().parse_args(["serve", *flags]))


def served(config: ServerConfig) -> dict[str, object]:
    return {spec.id: spec.path for spec in config.models}


@pytest.fixture
def model_dir(tmp_path):
    directory = tmp_path / "tiny"
    shutil.copytree(BUILTIN_MODEL_DIR, directory)
    return directory


def test_name_equals_path_serves_the_directory_under_that_name(model_dir):
    config = config_of("--model", f"Qwen/Qwen3-8B={model_dir}", "--model", str(model_dir))
    assert [spec.id for spec in config.models] == [*BUILTIN_MODELS, "Qwen/Qwen3-8B", "tiny"]
    assert served(config)["Qwen/Qwen3-8B"] == served(config)["tiny"] == model_dir.resolve()


def test_name_equals_a_built_in_serves_the_built_in_directory_under_that_name_too():
    config = config_of("--model", "Qwen/Qwen3-8B=posttrain/tiny-qwen3")
    assert served(config) == {
        **{spec.id: spec.path for spec in builtin_model_specs()},
        "Qwen/Qwen3-8B": BUILTIN_MODELS["posttrain/tiny-qwen3"],
    }


def test_a_directory_whose_name_holds_an_equals_sign_is_a_path(tmp_path, model_dir):
    odd = tmp_path / "a=b"
    shutil.copytree(model_dir, odd)
    assert served(config_of("--model", str(odd)))["a=b"] == odd.resolve()


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("={dir}", "NAME in NAME=PATH must be non-empty, without spaces or `:`"),
        ("my model={dir}", "NAME in NAME=PATH must be non-empty, without spaces or `:`"),
        ("Qwen/Qwen3-8B:v1={dir}", "NAME in NAME=PATH must be non-empty, without spaces or `:`"),
        ("Qwen/Qwen3-8B=", "no PATH after `Qwen/Qwen3-8B=`"),
        ("Qwen/Qwen3-8B={dir}/missing", "no config.json in {dir}/missing"),
        ("Qwen/Qwen3-8B=posttrain/no-such-model", "no config.json in posttrain/no-such-model"),
        ("posttrain/tiny-qwen3={dir}", "base_model 'posttrain/tiny-qwen3' is already served"),
    ],
)
def test_a_bad_value_is_refused_naming_the_flag_and_the_value(model_dir, value, says):
    value = value.format(dir=model_dir)
    with pytest.raises(ConfigError) as refused:
        config_of("--model", value)
    assert refused.value.param == "models"
    assert refused.value.message.startswith(f"--model {value}: ")
    assert says.format(dir=model_dir) in refused.value.message


def test_a_name_served_twice_is_refused_naming_the_second_value(model_dir):
    with pytest.raises(ConfigError) as refused:
        config_of("--model", f"m={model_dir}", "--model", "m=posttrain/tiny-qwen3")
    assert refused.value.message == (
        "--model m=posttrain/tiny-qwen3: base_model 'm' is already served; give this one"
        " another name with --model NAME=PATH"
    )
    with pytest.raises(ConfigError, match="base_model 'tiny' is already served"):
        config_of("--model", str(model_dir), "--model", f"tiny={model_dir}")


def test_model_info_names_the_directory_the_tokenizer_loads_from(tmp_path, model_dir):
    config = config_of(
        "--data-dir", str(tmp_path / "data"), "--device", "cpu",
        "--model", "Qwen/Qwen3-8B=posttrain/tiny-qwen3", "--model", f"org/tiny={model_dir}",
    )  # fmt: skip
    assert config.engine == EngineConfig(device="cpu")
    services = build_services(config)
    try:
        infos = dict(services.resources.supported_models())
        assert infos["Qwen/Qwen3-8B"].tokenizer_dir == BUILTIN_MODEL_DIR
        assert infos["posttrain/tiny-qwen3"].tokenizer_dir == BUILTIN_MODEL_DIR
        assert infos["org/tiny"].tokenizer_dir == model_dir.resolve()
        assert infos["Qwen/Qwen3-8B"].vocab_size == infos["org/tiny"].vocab_size == 99
        assert services.resources.model_info("org/tiny") == infos["org/tiny"]
        with pytest.raises(InvalidRequest) as refused:
            services.resources.model_info("Qwen/Qwen3-32B")
        assert refused.value.param == "base_model"
    finally:
        services.close()
    # The directory loads offline; the tokenizer keeps the chat markers whole.
    tokenizer = AutoTokenizer.from_pretrained(infos["Qwen/Qwen3-8B"].tokenizer_dir)
    assert tokenizer.encode("<|im_start|>1+2=<|im_end|>", add_special_tokens=False) == [
        1, *tokenizer.encode("1+2=", add_special_tokens=False), 2,
    ]  # fmt: skip
