"""Random-init models of the decoder families posttrain serves, built by the tests (nothing is
downloaded): two layers, hidden 64, the built-in tokenizer's vocabulary, sliding windows small
enough to matter, and each family's logit post-processing switched on (Granite's logit scaling,
Gemma 2's final and attention soft-capping, Gemma's scaled embeddings and tied heads).

`build(family, directory)` writes a model with save_pretrained plus the built-in tokenizer
files; `load(family, directory)` loads it through posttrain's own loader. `size=Size(...)`
builds every family at another common size (bench/models.py); the default is the tests'."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from posttrain.config import BUILTIN_MODEL_DIR
from posttrain.model.loader import LoadedModel, load_model

VOCAB = 99  # the built-in tokenizer's
WINDOW = 4  # sliding windows shorter than the test sequences
NUM_HEADS = 4


@dataclass(frozen=True)
class Size:
    """The dimensions every family shares: MLPs are 2x hidden wide (MoE experts 1/2x), heads
    hidden / NUM_HEADS wide."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    max_position_embeddings: int = 256

    def settings(self) -> dict[str, object]:
        return dict(
            hidden_size=self.hidden_size,
            intermediate_size=2 * self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            max_position_embeddings=self.max_position_embeddings,
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // NUM_HEADS


TESTS = Size()  # two layers, hidden 64
_COMMON = dict(
    vocab_size=VOCAB,
    num_attention_heads=NUM_HEADS,
    num_key_value_heads=2,
    bos_token_id=1,
    eos_token_id=0,
    pad_token_id=0,
)
HEAD_DIM = object()  # a family setting that takes the size's head width
MOE_WIDTH = object()  # a family setting that takes the size's expert width
HYBRID_LAYERS = object()  # layer_types alternating linear and full attention, the size's depth
NONE = object()  # a setting set to None (a None override leaves the family's default)

# model_type -> config overrides beyond _COMMON.
FAMILIES: dict[str, dict[str, object]] = {
    "llama": {"tie_word_embeddings": False},
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "qwen3": {"head_dim": HEAD_DIM},
    "gemma": {"head_dim": HEAD_DIM},
    "gemma2": {
        "head_dim": HEAD_DIM,
        "sliding_window": WINDOW,
        "final_logit_softcapping": 2.0,
        "attn_logit_softcapping": 3.0,
    },
    "gemma3_text": {
        "head_dim": HEAD_DIM,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
        "final_logit_softcapping": 5.0,
    },
    "phi3": {"sliding_window": WINDOW, "pad_token_id": 0},
    "olmo2": {},
    "gpt_neox": {"num_key_value_heads": None, "rotary_pct": 0.5},
    "granite": {"logits_scaling": 4.0, "embedding_multiplier": 3.0, "residual_multiplier": 0.5},
    "qwen3_moe": {
        "head_dim": HEAD_DIM,
        "moe_intermediate_size": MOE_WIDTH,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    # Multi-head latent attention: query and key/value through low-rank latents, keys
    # (nope + rope parts) wider than values; layer 0 dense, layer 1 a sigmoid group-limited
    # top-k MoE (correction bias, scaled weights) with a shared expert.
    "deepseek_v3": {
        "num_key_value_heads": NUM_HEADS,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "moe_intermediate_size": MOE_WIDTH,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
    },
}

# Fields some checkpoints carry that their family ignores, for `extra=`: GPT-NeoX attention has
# one KV head per query head, hidden / heads wide, whatever these say.
IGNORED_FIELDS: dict[str, dict[str, object]] = {
    "gpt_neox": {"num_key_value_heads": 2, "head_dim": 8},
}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# Hybrids of Gated DeltaNet linear attention and gated full attention (Qwen3-Next, Qwen3.5 text,
# dense and MoE): layers alternate linear and full, layer 0 linear; grouped linear heads (2
# query/key heads, 4 value heads) and a short causal convolution.
_LINEAR: dict[str, object] = {
    "head_dim": HEAD_DIM,
    "layer_types": HYBRID_LAYERS,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}
_LINEAR_MOE: dict[str, object] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": MOE_WIDTH,
    "shared_expert_intermediate_size": MOE_WIDTH,
}
LINEAR_ATTENTION_FAMILIES: dict[str, dict[str, object]] = {
    "qwen3_next": {**_LINEAR, **_LINEAR_MOE, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen3_5_text": dict(_LINEAR),
    "qwen3_5_moe_text": {**_LINEAR, **_LINEAR_MOE},
}

FAMILIES.update(LINEAR_ATTENTION_FAMILIES)


def _sized(value: object, size: Size) -> object:
    if value is HEAD_DIM:
        return size.head_dim
    if value is MOE_WIDTH:
        return size.hidden_size // 2
    if value is NONE:
        return None
    if value is HYBRID_LAYERS:
        return ["linear_attention", "full_attention"] * (size.num_hidden_layers // 2)
    return value


# Mixture-of-experts families only the routing-replay tests build (FAMILIES is what every
# family test runs): their config overrides.
REPLAY_FAMILIES: dict[str, dict[str, object]] = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
}


# The other families whose attention is DeepSeek-V3's multi-head latent attention, which only
# the latent-attention tests build: latent widths unlike DeepSeek-V3's test build (an odd
# latent, no query latent, values wider than keys), few experts.
_MLA: dict[str, object] = {
    "num_key_value_heads": NUM_HEADS,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "moe_intermediate_size": MOE_WIDTH,
}
_FEW_EXPERTS: dict[str, object] = {"n_routed_experts": 8, "num_experts_per_tok": 2}
LATENT_ATTENTION_FAMILIES: dict[str, dict[str, object]] = {
    # Complex-frequency rope; queries straight from q_proj.
    "deepseek_v2": {**_MLA, **_FEW_EXPERTS, "q_lora_rank": NONE},
    "glm4_moe_lite": {**_MLA, **_FEW_EXPERTS, "kv_lora_rank": 15},
    "minicpm3": {**_MLA, "qk_rope_head_dim": 4, "v_head_dim": 24},
    "youtu": dict(_MLA),
    "axk1": {**_MLA, **_FEW_EXPERTS, "n_group": 4, "topk_group": 2},
    # Latents scaled by sqrt(hidden / rank), two attention modules per decoder layer; its rotary
    # width is `head_dim`.
    "longcat_flash": {**_MLA, **_FEW_EXPERTS, "zero_expert_num": 4, "head_dim": 8},
}


def config(family: str, size: Size = TESTS, extra: dict[str, object] | None = None):
    """The family's config; `extra` fields are set last (IGNORED_FIELDS)."""
    overrides = {
        **FAMILIES,
        **REPLAY_FAMILIES,
        **LINEAR_ATTENTION_FAMILIES,
        **LATENT_ATTENTION_FAMILIES,
    }[family]
    settings = {**_COMMON, **size.settings(), **overrides, **(extra or {})}
    settings = {k: _sized(v, size) for k, v in settings.items() if v is not None}
    return AutoConfig.for_model(family, **settings)


def model(
    family: str, *, seed: int = 0, size: Size = TESTS, extra: dict[str, object] | None = None
) -> torch.nn.Module:
    """A random-init `family` model (float32, eval mode)."""
    torch.manual_seed(seed)
    built = AutoModelForCausalLM.from_config(config(family, size, extra), dtype=torch.float32)
    # Random-init norms are ones and biases zeros; perturb every parameter so that no family
    # feature (a norm's offset, a bias) is invisible to the comparisons.
    with torch.no_grad():
        for parameter in built.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
        # DeepSeek-V3's routers add a correction bias (a buffer) to the scores they choose by.
        for name, buffer in built.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.add_(torch.randn_like(buffer) * 0.05)
    return built.eval()


def build(
    family: str,
    directory: Path,
    *,
    seed: int = 0,
    size: Size = TESTS,
    extra: dict[str, object] | None = None,
) -> Path:
    """A random-init `family` model with the built-in tokenizer, saved in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    model(family, seed=seed, size=size, extra=extra).save_pretrained(directory)
    for name in _TOKENIZER_FILES:
        shutil.copy(BUILTIN_MODEL_DIR / name, directory / name)
    return directory


def load(family: str, directory: Path) -> LoadedModel:
    """The family's model through posttrain's loader (float32 on the CPU)."""
    if not (directory / "config.json").exists():
        build(family, directory)
    return load_model(directory, torch.device("cpu"), torch.float32)
