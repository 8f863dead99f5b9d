"""The start-up check of `posttrain serve --model DIR` (model/loader.servable_problem, cli.py):
a directory that cannot be served stops the server with a message naming it and the problem."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).parent))
import families  # noqa: E402

from posttrain import cli  # noqa: E402
from posttrain.model.loader import servable_problem  # noqa: E402


def test_every_family_of_the_builder_is_servable(tmp_path):
    for family in families.FAMILIES:
        directory = tmp_path / family
        families.config(family).save_pretrained(directory)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (directory / name).write_bytes((families.BUILTIN_MODEL_DIR / name).read_bytes())
        assert servable_problem(directory) is None, family


def test_a_directory_without_a_tokenizer_is_refused(tmp_path):
    families.config("llama").save_pretrained(tmp_path)
    assert servable_problem(tmp_path).startswith("no usable tokenizer")


def test_a_model_that_is_not_a_decoder_only_causal_lm_is_refused(tmp_path):
    for model_type in ("vit", "t5"):
        AutoConfig.for_model(model_type).save_pretrained(tmp_path / model_type)
        problem = servable_problem(tmp_path / model_type)
        assert problem == f"model_type {model_type!r} is not a decoder-only causal LM"


def test_a_config_transformers_cannot_read_or_build_is_refused(tmp_path):
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text(json.dumps({"model_type": "no-such"}))
    assert servable_problem(tmp_path / "unknown").startswith("transformers cannot read its config")
    config = families.config("llama").to_dict()
    config["vocab_size"] = -1
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text(json.dumps(config))
    problem = servable_problem(tmp_path / "broken")
    assert problem.startswith("transformers cannot build a model from its config")


def test_serve_stops_at_start_up_naming_the_directory_and_the_problem(tmp_path, capsys):
    families.config("llama").save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--model", str(tmp_path)])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert str(tmp_path.resolve()) in message
    assert "no usable tokenizer" in message


def test_a_loaded_model_keeps_its_own_layers_through_train_and_eval():
    """transformers 5.2x defaults to use_kernels=True: the model's first train()/eval() swaps
    layers for kernels fetched from the Hugging Face Hub at run time (offline, an error on CUDA;
    online, code whose numerics the sampler / trainer agreement was never checked against).
    load_model turns that off, so train() and eval() change no layer."""
    import torch

    from posttrain.config import BUILTIN_MODEL_DIR
    from posttrain.model.loader import load_model

    model = load_model(BUILTIN_MODEL_DIR, torch.device("cpu"), torch.float32).model
    assert model.use_kernels is False
    layers = [type(module) for module in model.modules()]
    model.train()
    model.eval()
    assert model.kernels_mode is None  # no kernelize ran
    assert [type(module) for module in model.modules()] == layers
