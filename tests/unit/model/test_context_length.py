"""A model's context (model/context_length.py) from its config.json, and the training-sample
limit the engine reports from it: the model's context by default, lowered by
--max-seq-length (engine/hosts/in_process.py's model_info)."""

from __future__ import annotations

import json
import shutil

import pytest

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODELS, EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.model.context_length import context_length

QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({}, 2048),  # transformers' old default
        ({"max_position_embeddings": 512}, 512),
        ({"max_position_embeddings": 131072, "rope_parameters": {"rope_type": "default"}}, 131072),
        # Qwen3's documented YaRN: the rope dict names the pretrained length.
        ({"max_position_embeddings": 40960, "rope_scaling": QWEN3_YARN}, 131072),
        ({"max_position_embeddings": 40960, "rope_parameters": QWEN3_YARN}, 131072),
        # DeepSeek-V3: max_position_embeddings is already the extended length.
        (
            {
                "max_position_embeddings": 163840,
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 40,
                    "original_max_position_embeddings": 4096,
                },
            },
            163840,
        ),
        # yarn without the pretrained length: max_position_embeddings is it (transformers'
        # standardize_rope_params).
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": 2}}, 8192),
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "dynamic", "factor": 2}}, 8192),
        # Types whose config states the extended length as max_position_embeddings.
        (
            {
                "max_position_embeddings": 131072,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "original_max_position_embeddings": 8192,
                },
            },
            131072,
        ),
        (
            {
                "max_position_embeddings": 131072,
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 8.0},
                    "sliding_attention": {"rope_type": "default"},
                },
            },
            131072,
        ),
        # Per layer type, one of them yarn.
        (
            {
                "max_position_embeddings": 32768,
                "rope_parameters": {
                    "full_attention": {**QWEN3_YARN, "factor": 2.0},
                    "sliding_attention": {"rope_type": "default"},
                },
            },
            65536,
        ),
        # A factor below 1 shortens nothing.
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": 0.5}}, 4096),
    ],
)
def test_the_context_follows_max_position_embeddings_and_rope_scaling(config, expected):
    assert context_length(config) == expected


def long_model(tmp_path, positions: int = 131072):
    """The built-in model's files with a longer context (model_info reads no weights)."""
    directory = tmp_path / "long"
    shutil.copytree(BUILTIN_MODEL_DIR, directory)
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_model_with_131072_positions_reports_and_takes_131072_by_default(tmp_path):
    info = LocalEngine(EngineConfig(device="cpu"), {"long": long_model(tmp_path)}).model_info(
        "long"
    )
    assert (info.context_length, info.max_seq_length) == (131072, 131072)


def test_max_seq_length_lowers_the_limit_and_is_capped_by_the_model(tmp_path, caplog):
    paths = {"long": long_model(tmp_path), "short": long_model(tmp_path / "s", 1024)}
    engine = LocalEngine(EngineConfig(device="cpu", max_seq_length=4096), paths)
    assert engine.model_info("long").max_seq_length == 4096
    assert engine.model_info("long").context_length == 131072
    assert engine.model_info("short").max_seq_length == 1024
    assert "--max-seq-length 4096 is past short's context of 1024 tokens" in caplog.text


def test_the_built_in_models_keep_their_512_token_limit():
    engine = LocalEngine(EngineConfig(device="cpu"), dict(BUILTIN_MODELS))
    for model_id in BUILTIN_MODELS:
        info = engine.model_info(model_id)
        assert (info.context_length, info.max_seq_length) == (512, 512), model_id
