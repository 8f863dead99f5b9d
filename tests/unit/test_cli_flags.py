"""`posttrain serve` flags, generated from the config fields, become the ServerConfig."""

from __future__ import annotations

import pytest
import torch

from posttrain.cli import check_exposure, parser, serve_config
from posttrain.config import BUILTIN_MODELS, EngineConfig, LimitsConfig, RoutedExpertsConfig
from posttrain.config_sources import build_config, settings
from posttrain.errors import ConfigError
from posttrain.model.loader import resolve_dtype


def config_of(*flags: str):
    return serve_config(parser().parse_args(["serve", *flags]))


def test_no_flags_is_the_default_config(monkeypatch):
    for setting in settings():
        if setting.env:
            monkeypatch.delenv(setting.env, raising=False)
    config = config_of()
    assert config.engine == EngineConfig()
    assert [spec.id for spec in config.models] == list(BUILTIN_MODELS)
    assert (config.host, config.port, config.log_level, config.access_log) == (
        "127.0.0.1",
        8000,
        "info",
        False,
    )


def test_device_and_dtype_flags_become_the_engine_config():
    assert config_of("--device", "cpu", "--dtype", "float32").engine == EngineConfig(
        device="cpu", dtype="float32"
    )
    assert config_of("--dtype", "bfloat16").engine.device == "auto"


def test_every_existing_flag_name_still_reaches_its_field(tmp_path):
    config = config_of(
        "--host", "0.0.0.0", "--port", "0", "--data-dir", str(tmp_path),
        "--workers", "process", "--generators", "process", "--weights-transport", "pipe",
        "--ray", "local", "--ray-strategy", "SPREAD", "--trainer-ranks", "2",
        "--max-generator-replicas", "3", "--loss-fn-outputs", "always",
        "--routed-experts-ttl-s", "60", "--routed-experts-mib", "16",
        "--signing-key", "k", "--max-body-mib", "2", "--max-payload-mib", "8",
        "--min-inactive-timeout-s", "2", "--expiry-check-interval-s", "0.5",
        "--log-level", "warning", "--access-log", "--insecure-no-auth",
    )  # fmt: skip
    assert (config.host, config.port, config.data_dir) == ("0.0.0.0", 0, tmp_path)
    assert config.engine == EngineConfig(
        workers="process",
        generators="process",
        weights_transport="pipe",
        ray="local",
        ray_strategy="SPREAD",
        trainer_ranks=2,
        max_generator_replicas=3,
        loss_fn_outputs="always",
    )
    assert config.routed_experts == RoutedExpertsConfig(ttl_s=60.0, memory_mib=16)
    assert config.limits == LimitsConfig(max_body_mib=2, max_payload_mib=8)
    assert (config.signing_key, config.min_inactive_timeout_s) == ("k", 2)
    assert config.expiry_check_interval_s == 0.5
    assert (config.log_level, config.access_log) == ("warning", True)
    assert config.insecure_no_auth


def test_model_is_repeatable_and_serves_the_directories_beside_the_built_ins(tmp_path):
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    config = config_of("--model", str(tmp_path / "one"), "--model", str(tmp_path / "two"))
    assert [spec.id for spec in config.models] == [*BUILTIN_MODELS, "one", "two"]
    assert config.models[-1].path == tmp_path / "two"


def test_an_unknown_dtype_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as refused:
        parser().parse_args(["serve", "--dtype", "float16"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "--dtype" in err and "'bfloat16'" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("name", "device", "expected"),
    [
        ("auto", "cpu", torch.float32),
        ("auto", "cuda", torch.bfloat16),
        ("float32", "cuda", torch.float32),
        ("bfloat16", "cpu", torch.bfloat16),
    ],
)
def test_auto_dtype_is_float32_on_cpu_and_bfloat16_on_cuda(name, device, expected):
    assert resolve_dtype(name, torch.device(device)) == expected


def test_poll_hold_seconds_defaults_to_ten_and_refuses_what_the_sdk_would_time_out_on():
    assert build_config().poll_hold_seconds == 10.0
    assert config_of("--poll-hold-seconds", "0").poll_hold_seconds == 0.0
    for bad in ("-1", "60"):  # the SDK's shortest read timeout is 60 s
        with pytest.raises(ConfigError) as refused:
            config_of("--poll-hold-seconds", bad)
        assert refused.value.param == "poll_hold_seconds"
        assert refused.value.message.startswith(f"--poll-hold-seconds {bad}: ")


def test_persist_every_comes_from_the_flag_or_env_and_refuses_zero(monkeypatch):
    monkeypatch.delenv("POSTTRAIN_PERSIST_EVERY", raising=False)
    assert build_config().persist_every == 10
    assert config_of("--persist-every", "1").persist_every == 1
    monkeypatch.setenv("POSTTRAIN_PERSIST_EVERY", "4")
    assert config_of().persist_every == 4
    assert config_of("--persist-every", "2").persist_every == 2  # the flag wins
    with pytest.raises(ConfigError) as refused:
        build_config(persist_every=0)
    assert refused.value.param == "persist_every"
    monkeypatch.setenv("POSTTRAIN_PERSIST_EVERY", "0")
    with pytest.raises(ConfigError, match="^POSTTRAIN_PERSIST_EVERY=0: "):
        config_of()


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("8GiB", 8 << 30),
        ("8G", 8 << 30),
        ("8g", 8 << 30),
        ("512MiB", 512 << 20),
        ("512M", 512 << 20),
        ("1.5GB", 1_500_000_000),
        ("4096B", 4096),
    ],
)
def test_memory_limit_flag_takes_bytes_with_a_unit(flag, expected):
    assert config_of("--memory-limit", flag).engine == EngineConfig(memory_limit=expected)


@pytest.mark.parametrize(
    ("flag", "fragment"),
    [
        ("8", "'8' has no unit: give one, e.g. 8GiB"),
        ("8 parsecs", "is not a number of bytes with a unit"),
        ("8Q", "is not a number of bytes with a unit"),
        ("8PB", "is not a number of bytes with a unit"),
    ],
)
def test_a_memory_limit_without_a_known_unit_is_refused_naming_the_flag(flag, fragment):
    with pytest.raises(ConfigError) as refused:
        config_of("--memory-limit", flag)
    assert refused.value.message.startswith(f"--memory-limit {flag}: ")
    assert fragment in refused.value.message
    assert refused.value.param == "engine.memory_limit"


def test_memory_limit_config_key_takes_the_same_units():
    assert EngineConfig(memory_limit="2GiB").memory_limit == 2 << 30
    assert EngineConfig(memory_limit="2G").memory_limit == 2 << 30
    assert EngineConfig().memory_limit is None


def test_cuda_graphs_flag_becomes_the_engine_setting_and_is_on_by_default():
    assert EngineConfig().cuda_graphs is True
    assert config_of("--cuda-graphs", "on").engine == EngineConfig(cuda_graphs=True)
    assert config_of("--cuda-graphs", "off").engine == EngineConfig(cuda_graphs=False)


def test_shard_parameters_is_on_by_default_and_the_flag_turns_it_off():
    assert EngineConfig().shard_parameters is True
    off = config_of("--trainer-ranks", "2", "--shard-parameters", "off").engine
    assert off == EngineConfig(trainer_ranks=2, shard_parameters=False)
    assert config_of("--trainer-ranks", "2", "--shard-parameters", "on").engine.shard_parameters
    assert config_of("--trainer-ranks", "2").engine.shard_parameters


def test_each_flag_is_declared_once_on_its_field():
    flags = [setting.flag for setting in settings()]
    assert len(flags) == len(set(flags))
    by_path = {setting.path: setting.flag for setting in settings()}
    assert by_path[("routed_experts", "memory_mib")] == "--routed-experts-mib"
    assert by_path[("engine", "trainer_ranks")] == "--trainer-ranks"
    assert by_path[("models",)] == "--model"
    for setting in settings():
        assert setting.info.description, setting.path


def test_vllm_generators_take_their_python_from_the_flag_or_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("POSTTRAIN_VLLM_PYTHON", raising=False)
    with pytest.raises(ConfigError) as refused:
        config_of("--generators", "vllm")
    assert refused.value.param == "engine.vllm_python" and "--vllm-python" in str(refused.value)
    python = tmp_path / "bin" / "python"
    flagged = config_of(
        "--generators", "vllm", "--vllm-python", str(python), "--vllm-mismatch-rate", "0.5"
    )
    assert (flagged.engine.vllm_python, flagged.engine.vllm_mismatch_rate) == (python, 0.5)
    monkeypatch.setenv("POSTTRAIN_VLLM_PYTHON", str(python))
    assert config_of("--generators", "vllm").engine.vllm_python == python


def test_the_sample_row_limits_come_from_flags_and_refuse_what_cannot_be_a_row_count():
    default = build_config().scheduler
    assert (default.max_sample_rows, default.stream_join_rows) == (256, None)
    config = config_of("--max-sample-rows", "64", "--stream-join-rows", "0").scheduler
    assert (config.max_sample_rows, config.stream_join_rows) == (64, 0)
    for flags in (("--max-sample-rows", "0"), ("--stream-join-rows", "-1")):
        with pytest.raises(ConfigError) as refused:
            config_of(*flags)
        assert refused.value.message.startswith(f"{flags[0]} {flags[1]}: ")
    with pytest.raises(ConfigError, match="^--stream-join-rows some: "):
        config_of("--stream-join-rows", "some")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.3.4", "::1", "localhost"])
def test_a_loopback_host_needs_no_api_key(host, monkeypatch):
    monkeypatch.delenv("POSTTRAIN_API_KEY", raising=False)
    monkeypatch.delenv("POSTTRAIN_KEYS_FILE", raising=False)
    check_exposure(config_of("--host", host))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.7", "example.com"])
def test_a_host_beyond_loopback_needs_a_key_or_the_insecure_opt_out(host, monkeypatch, tmp_path):
    monkeypatch.delenv("POSTTRAIN_API_KEY", raising=False)
    monkeypatch.delenv("POSTTRAIN_KEYS_FILE", raising=False)
    monkeypatch.delenv("POSTTRAIN_INSECURE_NO_AUTH", raising=False)
    with pytest.raises(ConfigError, match="--api-key KEY or --keys-file PATH") as refused:
        check_exposure(config_of("--host", host))
    assert refused.value.param == "host"
    assert "--insecure-no-auth" in refused.value.message
    check_exposure(config_of("--host", host, "--api-key", "secret"))
    (tmp_path / "keys.txt").write_text("sk-a alice\n")
    check_exposure(config_of("--host", host, "--keys-file", str(tmp_path / "keys.txt")))
    check_exposure(config_of("--host", host, "--insecure-no-auth"))
    monkeypatch.setenv("POSTTRAIN_INSECURE_NO_AUTH", "1")
    check_exposure(config_of("--host", host))


def test_max_seq_length_comes_from_its_flag_or_its_environment_variable(monkeypatch):
    monkeypatch.delenv("POSTTRAIN_MAX_SEQ_LENGTH", raising=False)
    assert config_of().engine.max_seq_length is None  # the model's context
    assert config_of("--max-seq-length", "4096").engine.max_seq_length == 4096
    monkeypatch.setenv("POSTTRAIN_MAX_SEQ_LENGTH", "8192")
    assert config_of().engine.max_seq_length == 8192
    assert config_of("--max-seq-length", "64").engine.max_seq_length == 64


def test_activation_checkpointing_takes_auto_on_or_off():
    assert config_of().engine.activation_checkpointing == "auto"
    for mode in ("on", "off"):
        assert config_of("--activation-checkpointing", mode).engine.activation_checkpointing == mode
