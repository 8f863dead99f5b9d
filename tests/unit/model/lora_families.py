"""Random-init decoder LMs of each family transformers ships, saved as model directories with
the built-in tokenizer (two layers, hidden 64; nothing downloaded), for the LoRA tests.

Imports: transformers (AutoConfig, AutoModelForCausalLM), posttrain.config."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from posttrain.config import BUILTIN_MODEL_DIR

VOCAB = 99  # the built-in tokenizer's
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 0,
}

FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16},
    "phi3": {"num_key_value_heads": 4},
    "olmo2": {},
    "gpt_neox": {"num_key_value_heads": None, "rotary_pct": 0.25},
    "granite": {"logits_scaling": 2.0, "embedding_multiplier": 3.0},
    "qwen3_moe": {
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}


def family_config(family: str):
    kwargs = {**COMMON, **FAMILIES[family]}
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k == "sliding_window"}
    return AutoConfig.for_model(family, **kwargs)


def build_family_model(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float32)
    return model.eval()


def save_family_model(family: str, directory: Path, seed: int = 0) -> Path:
    """A servable model directory: random-init weights plus the built-in tokenizer."""
    build_family_model(family, seed).save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copyfile(BUILTIN_MODEL_DIR / name, directory / name)
    return directory
