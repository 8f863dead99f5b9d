"""Muon math (losses.md 12.3): which parameters Muon owns, Newton-Schulz orthogonalisation, the
learning-rate scale of each scaling strategy, and the in-place update of one parameter.

Stateless functions only: the momentum buffers, clipping and the nested AdamW group live in
optim.SessionOptimizer. Nothing here reads request types other than MuonScaling.

Shape legend: B = matrices in a batch (the leading dims of a 3-D or larger tensor, flattened;
1 for a plain matrix), R = rows (out_features of a Linear weight), C = columns (in_features).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posttrain.types import MuonScaling

# Quintic coefficients and eps "from Keller Jordan's Muon post", as in torch.optim.Muon.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7

# Substrings of a parameter name that send a >= 2-D tensor to AdamW instead (losses.md 12.3,
# after XORL's classifier). "gate.weight" is the MoE router (`mlp.gate.weight`, also
# `shared_expert_gate.weight`); the dense `mlp.gate_proj.weight` does not contain it.
# "embed_in" and "embed_out" are GPT-NeoX's embedding and output head (`gpt_neox.embed_in`,
# `embed_out`), its model-specific names for what the others call embed_tokens and lm_head.
ADAM_NAME_PATTERNS = (
    "embed_tokens",
    "embeddings",
    "lm_head",
    "norm",
    "gate.weight",
    "mixer.conv1d",
    "embed_in",
    "embed_out",
)

_LORA_FACTORS = frozenset({"lora_A", "lora_B"})
# A fused [gate | up] projection (Phi-3's `mlp.gate_up_proj.weight`, the MoE experts'
# `experts.gate_up_proj`) stacks two matrices on its rows, gate first (the forward chunks its
# output in two): Muon orthogonalises and scales each half with its own shape (12.3, XORL).
_FUSED_GATE_UP = "gate_up_proj"


def _base_weight_name(name: str) -> str:
    """The name of the weight a parameter trains: a LoRA factor `<module>.lora_A.<adapter>`
    maps to `<module>.weight`, so it follows its base module (losses.md 12.3, LoRA under Muon),
    and an adapter's own name can never match a pattern."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _LORA_FACTORS:
            return ".".join([*parts[:i], "weight"])
    return name


def is_muon_param(name: str, ndim: int) -> bool:
    """True if Muon updates this trainable tensor, False if the nested AdamW does (12.3)."""
    if ndim < 2:
        return False
    base_name = _base_weight_name(name)
    return not any(pattern in base_name for pattern in ADAM_NAME_PATTERNS)


def num_row_blocks(name: str) -> int:
    """How many matrices a Muon parameter stacks on its rows: 2 for a fused [gate | up]
    projection, else 1. A LoRA factor on one is a single matrix of its own (12.3)."""
    parts = name.split(".")
    if _LORA_FACTORS.intersection(parts):
        return 1
    return 2 if _FUSED_GATE_UP in parts else 1


def lr_scale(num_rows: int, num_cols: int, scaling: MuonScaling) -> float:
    """s(R, C) of losses.md 12.3: ORIGINAL sqrt(max(1, R/C)), MATCH_ADAM 0.2 sqrt(max(R, C))."""
    if scaling is MuonScaling.ORIGINAL:
        return math.sqrt(max(1.0, num_rows / num_cols))
    return 0.2 * math.sqrt(max(num_rows, num_cols))


def newton_schulz(update_BRC: Tensor, num_steps: int) -> Tensor:
    """NS_k of losses.md 12.3, applied to each matrix of the batch; returns float32.

    Runs in float32 rather than the references' bfloat16 so results do not depend on the
    parameters' dtype and tests can compare against a plain reference. A zero matrix stays zero
    (the norm is clamped to NS_EPS).
    """
    a, b, c = NS_COEFFICIENTS
    x_BRC = update_BRC.float()
    # Iterate on the wide orientation: X X^T is then the smaller (min(R, C))^2 Gram matrix.
    is_tall = x_BRC.shape[-2] > x_BRC.shape[-1]
    if is_tall:
        x_BRC = x_BRC.mT
    norm_B11: Tensor = torch.linalg.vector_norm(x_BRC, dim=(-2, -1), keepdim=True)
    x_BRC = x_BRC / norm_B11.clamp(min=NS_EPS)
    for _ in range(num_steps):
        gram_BRR = x_BRC @ x_BRC.mT
        x_BRC = a * x_BRC + (b * gram_BRR + c * gram_BRR @ gram_BRR) @ x_BRC
    return x_BRC.mT if is_tall else x_BRC


@torch.no_grad()
def muon_update_(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    *,
    learning_rate: float,
    momentum: float,
    weight_decay: float,
    num_ns_steps: int,
    scaling: MuonScaling,
    num_blocks: int = 1,
) -> None:
    """One Muon step of one tensor, in place on `param` and `momentum_buffer` (losses.md 12.3).

    EMA momentum with nesterov (TORCH-MUON's lerp form), NS of each trailing R x C matrix,
    decoupled decay W (1 - lr lambda) with the unscaled lr, then W - lr s(R, C) O. A tensor with
    more than two dims is a batch of R x C matrices (stacked MoE experts), each with its own scale;
    `num_blocks` (num_row_blocks) splits each matrix's rows into that many matrices first.
    """
    update = nesterov_(grad, momentum_buffer, momentum)
    ortho = orthogonalised(update, num_blocks, num_ns_steps)
    apply_update_(
        param,
        ortho,
        learning_rate=learning_rate,
        weight_decay=weight_decay,
        scaling=scaling,
        num_blocks=num_blocks,
    )


def nesterov_(grad: Tensor, momentum_buffer: Tensor, momentum: float) -> Tensor:
    """The EMA momentum step, in place on `momentum_buffer`, and the nesterov update. Entry by
    entry, so a shard of each (parallel/fsdp.py) gives the shard of the whole's result."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(momentum_buffer, momentum)


def orthogonalised(update: Tensor, num_blocks: int, num_ns_steps: int) -> Tensor:
    """NS of each trailing R x C matrix of a whole `update` (rows split into `num_blocks`
    matrices first), float32, in `update`'s shape."""
    num_rows, num_cols = update.shape[-2:]
    assert num_rows % num_blocks == 0, f"{num_rows} rows do not split into {num_blocks} blocks"
    ortho_BRC = newton_schulz(update.reshape(-1, num_rows // num_blocks, num_cols), num_ns_steps)
    return ortho_BRC.reshape(update.shape)


@torch.no_grad()
def apply_update_(
    param: Tensor,
    ortho: Tensor,
    *,
    learning_rate: float,
    weight_decay: float,
    scaling: MuonScaling,
    num_blocks: int,
    shape: tuple[int, ...] | None = None,
) -> None:
    """Decay, then W - lr s(R, C) O, in place; `shape`: the whole parameter's when `param` and
    `ortho` are one rank's shards of it (parallel/fsdp.py), else `param`'s own."""
    num_rows, num_cols = (shape or tuple(param.shape))[-2:]
    param.mul_(1 - learning_rate * weight_decay)
    step_size = learning_rate * lr_scale(num_rows // num_blocks, num_cols, scaling)
    param.add_(ortho.to(param.dtype), alpha=-step_size)
