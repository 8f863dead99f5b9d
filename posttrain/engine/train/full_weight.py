"""The weights of a full-weight session (api.md 1.2, `lora_enabled: false`).

A full-weight resource hosts one session, which trains the resource's own model in place: every
base parameter becomes trainable. Sampling must keep serving the last published weights while
training moves on, so the session also owns a second, frozen copy of the model (the
generator's), which weights-sync overwrites. When the session ends, the trained model gets the
base weights back from disk, so the next session on the resource starts from the base model.

Parameters carry their Hugging Face names (`model.layers.0.self_attn.q_proj.weight`), not the
names inside the LoRA wrappers of model/lora.py, so optimizer classification
(optim/optimizer.py, optim/muon.py) and checkpoints see the model's own names.

Does not own the optimizer (optim/optimizer.py) or the forward passes
(train/trainer.py).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from posttrain.model.loader import LoadedModel, load_model
from posttrain.model.lora import LoraModel

# model/lora.py wraps each target nn.Linear as `<layer>.base` (its layer key `<layer>`), and
# each MoE experts module as `<experts>.base` (layer keys `<experts>.<fused 3-D parameter>`).
WRAPPED_BASE = ".base"


def hf_parameter_name(lora: LoraModel, name: str) -> str:
    """`<layer>.base.weight` -> `<layer>.weight` and `<experts>.base.gate_up_proj` ->
    `<experts>.gate_up_proj` for modules wrapped by `lora`; other names unchanged."""
    module, _, leaf = name.rpartition(".")
    if not module.endswith(WRAPPED_BASE):
        return name
    unwrapped = module.removesuffix(WRAPPED_BASE)
    if unwrapped in lora.layers or f"{unwrapped}.{leaf}" in lora.layers:
        return f"{unwrapped}.{leaf}"
    return name


def trainable_parameters(lora: LoraModel) -> list[tuple[str, nn.Parameter]]:
    """Every parameter of the model `lora` wraps, by Hugging Face name, now requiring grad.

    Tied weights appear once (named_parameters deduplicates shared tensors)."""
    named = [(hf_parameter_name(lora, n), p) for n, p in lora.model.named_parameters()]
    assert len({n for n, _ in named}) == len(named), "two parameters map to one name"
    for _, parameter in named:
        parameter.requires_grad_(True)
    return named


def generator_copy(model: nn.Module) -> nn.Module:
    """An independent, frozen copy of `model` for sampling (same device and dtype)."""
    generator = copy.deepcopy(model)
    generator.eval()
    for parameter in generator.parameters():
        parameter.requires_grad_(False)
        parameter.grad = None
    return generator


@torch.no_grad()
def publish(trainer: nn.Module, generator: nn.Module) -> None:
    """weights-sync: the generator's parameters become exact copies of the trainer's."""
    pairs = zip(trainer.named_parameters(), generator.named_parameters(), strict=True)
    for (name, source), (copy_name, target) in pairs:
        assert name == copy_name, f"generator copy has {copy_name} where the trainer has {name}"
        target.copy_(source)


def reload(model_path: Path, loaded: LoadedModel) -> LoadedModel:
    """The base model loaded afresh from `model_path`, as `loaded` was (same device and
    dtype), frozen: what a resource serves after a session sharded with FSDP2, whose
    parameters cannot become plain ones again (parallel/fsdp.py)."""
    return load_model(model_path, loaded.device, loaded.model.dtype)


@torch.no_grad()
def restore_base(lora: LoraModel, model_path: Path, device: torch.device) -> None:
    """Put the base weights from `model_path` back into the model and freeze it again."""
    dtype = next(lora.model.parameters()).dtype
    fresh = dict(load_model(model_path, device, dtype).model.named_parameters())
    for name, parameter in lora.model.named_parameters():
        parameter.copy_(fresh[hf_parameter_name(lora, name)])
        parameter.requires_grad_(False)
        parameter.grad = None
