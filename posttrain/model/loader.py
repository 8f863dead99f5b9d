"""Load a Hugging Face causal LM and its tokenizer from a local directory, offline (every
model is a local directory: nothing is looked up on a hub).

Owns device and dtype choice, and what makes a directory servable (`servable_problem`, the
start-up check of `posttrain serve --model DIR`). Does not own adapters (lora.py) or anything
about sessions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from posttrain.errors import EngineFailure
from posttrain.model import attention, families, routing
from posttrain.model.attention_kinds import latent_attention, linear_attention
from posttrain.model.context_length import context_length
from posttrain.model.kv_shape import KVShape, kv_shape
from posttrain.model.vision import (
    VisionInputs,
    is_vision_language,
    keep_tower_attention,
    tower_activation_bytes,
)
from posttrain.types import MoeShape


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    vocab_size: int
    context_length: int
    eos_token_ids: frozenset[int]
    kv: KVShape  # what its attention layers write to a KV cache, probed from its modules
    moe: MoeShape | None = None  # the shape of its expert routes; None: dense
    # A vision-language model's image processor and placeholder token; None: text only.
    vision: VisionInputs | None = None


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; asking for CUDA without it is an error, not a fallback."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: float32 on CPU (bit-reproducible tests), bfloat16 on CUDA (memory, tensor cores).

    float32 on CUDA trades both for sampler logprobs that equal the trainer's to float32
    rounding; bfloat16 kernels round differently in the KV-cache decode and the full forward."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def load_model(path: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """The base weights in `dtype` on `device`, frozen. Loss and logprob math is float32
    whatever the weights' dtype (engine/train/logprobs.py), and so are LoRA adapters
    (model/lora.py)."""
    try:
        # use_kernels=False: transformers (5.2x) otherwise swaps layers for Hugging Face Hub
        # kernels on CUDA at the first train()/eval(), code fetched at run time whose numerics
        # the sampler / trainer agreement was never checked against (and, offline, a failure).
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        model = _auto_class(config).from_pretrained(
            path, dtype=dtype, local_files_only=True, use_kernels=False
        )
    # The start-up check (servable_problem) reads no weights, so a missing, truncated or
    # mismatched weight file surfaces here, at resource create: name the directory and the
    # reason (transformers and safetensors raise OSError, SafetensorError, RuntimeError, ...).
    except Exception as exc:  # noqa: BLE001
        raise EngineFailure(
            f"model {path}: its weights cannot be loaded ({type(exc).__name__}: {exc})"
        ) from exc
    # transformers wraps PreTrainedModel.to in functools.wraps(nn.Module.to), which the stubs
    # type as the unbound function (`device` read as `self`); it moves the model in place.
    model.to(device)  # type: ignore[arg-type]
    model.eval()  # type: ignore[no-untyped-call]  # transformers leaves eval unannotated
    towers = model.config._attn_implementation
    attention.install(model)  # sdpa, plus the sampler's shared-prefix attention
    if is_vision_language(model.config):
        keep_tower_attention(model, towers)
    routing.install(model)  # routing capture and replay of MoE routers
    latent_attention.install(model)  # MLA: its compressed latents in posttrain's caches
    linear_attention.install(model)  # hybrids: KV for the attention layers only
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    # A vision-language model keeps its vocabulary and stop tokens in its text config.
    config = model.config.get_text_config()
    eos = config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    vision = VisionInputs(path) if is_vision_language(model.config) else None
    if vision is not None:
        vision.token_activation_bytes = tower_activation_bytes(model, vision.merge_size)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=device,
        vocab_size=int(config.vocab_size),
        context_length=context_length(config.to_dict()),
        eos_token_ids=frozenset(eos_ids),
        kv=kv_shape(model),
        moe=routing.moe_shape(model),
        vision=vision,
    )


def route_shape(path: Path) -> MoeShape | None:
    """The expert-route shape of the model in `path` (None: dense), from a meta-device build:
    no weights are read or allocated."""
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    return routing.moe_shape(_meta_model(config))


def path_kv_shape(path: Path) -> KVShape:
    """The KV shape of the model in `path`, from a meta-device build: no weights are read or
    allocated."""
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    model = _meta_model(config)
    latent_attention.install(model)  # what load_model caches, not the family's latents
    linear_attention.install(model)
    return kv_shape(model)


def servable_problem(path: Path) -> str | None:
    """Why the directory cannot be served, or None: it must hold a config transformers builds
    into a decoder-only causal LM of a family the family table does not refuse
    (families.py), with attention posttrain runs (sdpa or eager), and a tokenizer. Reads
    configs and tokenizer files only; the model is built on the meta device, so no weights are
    read or allocated."""
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure here is the directory's problem
        return f"transformers cannot read its config ({type(exc).__name__}: {exc})"
    is_vision = is_vision_language(config)
    if getattr(config, "is_encoder_decoder", False) or (
        type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not is_vision
    ):
        return f"model_type {config.model_type!r} is not a decoder-only causal LM"
    if is_vision and not (path / "preprocessor_config.json").is_file():
        return (
            f"model_type {config.model_type!r} takes images, and the directory has no"
            " preprocessor_config.json naming its image processor"
        )
    refused = families.refusal(config.model_type)  # the family table's verdict
    if refused is not None:
        return refused
    try:
        model = _meta_model(config)
    except Exception as exc:  # noqa: BLE001
        return f"transformers cannot build a model from its config ({type(exc).__name__}: {exc})"
    implementation = model.config._attn_implementation
    if implementation not in attention.SERVED:
        return f"attention {implementation!r} cannot be served (sdpa or eager)"
    try:
        AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        return f"no usable tokenizer ({type(exc).__name__}: {exc})"
    return None


def _meta_model(config: PreTrainedConfig) -> PreTrainedModel:
    """The causal LM `config` describes, built on the meta device: no weights are read or
    allocated."""
    # transformers leaves from_config unannotated; it returns the mapped model class's instance.
    from_config: Callable[[PreTrainedConfig], PreTrainedModel] = _auto_class(config).from_config
    with torch.device("meta"):
        return from_config(config)


def _auto_class(
    config: PreTrainedConfig,
) -> type[AutoModelForCausalLM] | type[AutoModelForImageTextToText]:
    """The auto class that builds `config`: image-text-to-text for a vision-language model
    (its vision tower and the language model in one forward), else causal LM."""
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
