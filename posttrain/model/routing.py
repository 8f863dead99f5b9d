"""Mixture-of-experts routing: record which experts each token used, and replay them.

RL on a mixture-of-experts model scores a sampled sequence with the trainer's forward, whose
router may pick other experts than the sampler's did (the weights moved, or numerics differ):
then the trainer's logprobs are of another function than the one that produced the tokens.
Routing replay removes that: the sampler records the top-k experts of every token in every MoE
layer, and the trainer's forward of that sequence uses exactly those experts, with their gate
weights taken from the current router over the chosen experts (so the router still learns).

Both happen inside the router module, which this wraps (`install`): outside a `capture` or
`replay` block the wrapped router is the original, op for op; inside either, every token goes
through replay's ops, a token routed freely keeping the router's own experts and weights (so
a recompute that replays what a forward captured records the same tensors for the backward,
train/layer_checkpoint.py). A router qualifies when it is one of the softmax top-k routers
listed in SOFTMAX_TOP_K_ROUTERS (transformers' Qwen2/Qwen3-MoE, Mixtral, OLMoE): their gate
weights are the softmax of the router logits at the chosen experts, renormalised when the
router's `norm_topk_prob` is set (Mixtral always renormalises); or one of the sigmoid
group-limited routers in SIGMOID_TOP_K_ROUTERS (DeepSeek-V3): the experts are chosen by sigmoid
scores plus a correction bias within the best groups, and the gate weights are the sigmoid
scores (without the bias) at the chosen experts, renormalised when `norm_topk_prob` is set,
times `routed_scaling_factor`; replay forces the experts and keeps that weight rule. Other
routers would need their own replay rule: such models are served without routing replay.

A pass sees tokens flattened to [N, H] (batch rows times positions); routes are given and
returned in that order, per MoE layer in model order. Legend: N = tokens of a pass,
L = MoE layers, K = experts per token.

Imports: torch, types.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from posttrain.types import MoeShape

SOFTMAX_TOP_K_ROUTERS = frozenset(
    {
        "Qwen3MoeTopKRouter",
        "Qwen2MoeTopKRouter",
        "MixtralTopKRouter",
        "OlmoeTopKRouter",
        "Qwen3NextTopKRouter",
        "Qwen3_5MoeTopKRouter",
    }
)
SIGMOID_TOP_K_ROUTERS = frozenset({"DeepseekV3TopkRouter"})
# Routes travel as uint16 on the wire (api.md 5.2): no model served has more experts.
MAX_EXPERTS = 1 << 16


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's replayable routers, one per MoE layer, in model order."""
    replayable = SOFTMAX_TOP_K_ROUTERS | SIGMOID_TOP_K_ROUTERS
    return [m for m in model.modules() if type(m).__name__ in replayable]


def router_layers(module: nn.Module) -> list[int]:
    """The MoE layer numbers (`install`'s, as `replay` indexes them) of the installed routers
    inside `module` (a decoder layer), in model order."""
    return [_int_attribute(r, "_posttrain_layer") for r in routers(module) if _is_installed(r)]


def _is_installed(router: nn.Module) -> bool:
    return getattr(router, "_posttrain_layer", None) is not None


def moe_shape(model: nn.Module) -> MoeShape | None:
    """The route shape of `model`; None for a dense model (or one whose routers replay cannot
    serve, see the module docstring)."""
    found = routers(model)
    if not found:
        return None
    top_k = {_int_attribute(r, "top_k") for r in found}
    experts = {_int_attribute(r, "num_experts") for r in found}
    if len(top_k) != 1 or len(experts) != 1 or max(experts) > MAX_EXPERTS:
        return None
    return MoeShape(len(found), top_k.pop(), experts.pop())


# Per MoE layer (install's number), the [N, K] experts to use; rows of -1 route freely. A
# mapping names only some layers (a recompute of one decoder layer, train/layer_checkpoint.py).
Forced = Sequence[Tensor] | Mapping[int, Tensor]


@dataclass
class _Pass:
    captured: list[Tensor] | None  # filled per layer: the [N, K] experts each token used
    forced: Forced | None


_current: ContextVar[_Pass | None] = ContextVar("posttrain_routing_pass", default=None)


@contextmanager
def capture() -> Iterator[list[Tensor]]:
    """Inside, every router call appends the experts its tokens used ([N, K] int64, after any
    replay) to the yielded list: one entry per MoE layer and model forward, in call order.
    Nests with `replay` either way round."""
    captured: list[Tensor] = []
    outer = _current.get()
    token = _current.set(_Pass(captured, outer.forced if outer else None))
    try:
        yield captured
    finally:
        _current.reset(token)


@contextmanager
def replay(forced_LNK: Forced) -> Iterator[None]:
    """Inside, MoE layer l routes token n to forced_LNK[l][n] (int64 expert ids); a token whose
    first id is -1 routes freely. Every forward inside must have the N of these tensors, and
    only layers `forced_LNK` names may run."""
    outer = _current.get()
    token = _current.set(_Pass(outer.captured if outer else None, forced_LNK))
    try:
        yield
    finally:
        _current.reset(token)


def install(model: nn.Module) -> None:
    """Hook the routers of `model` so capture and replay reach them; idempotent. A forward
    hook (not a replaced forward) so a deep copy of the model (a full-weight generator) hooks
    its own routers."""
    for layer, router in enumerate(routers(model)):
        if _is_installed(router):
            continue
        # nn.Module's __setattr__ stub admits a Tensor or a Module only; at runtime a plain
        # value is stored as an ordinary attribute (and copied with the router).
        router._posttrain_layer = layer  # type: ignore[assignment]
        router.register_forward_hook(_routed)


def _routed(
    router: nn.Module, _args: tuple[object, ...], output: tuple[Tensor, Tensor, Tensor]
) -> tuple[Tensor, Tensor, Tensor] | None:
    state = _current.get()
    if state is None:
        return None  # the router's own output, untouched
    logits_NE, scores_NK, experts_NK = output
    # Inside a capture without replay every token routes freely, through the same ops as a
    # replay: a checkpointed layer's recompute (train/layer_checkpoint.py) replays what its
    # forward captured, and must record the same tensors for the backward as that forward.
    forced_NK = torch.full_like(experts_NK, -1)
    if state.forced is not None:
        forced_NK = state.forced[_int_attribute(router, "_posttrain_layer")].to(experts_NK.device)
    if forced_NK.shape != experts_NK.shape:
        raise ValueError(
            f"replayed routes have shape {tuple(forced_NK.shape)}, the pass routes"
            f" {tuple(experts_NK.shape)}"
        )
    replayed_N = forced_NK[:, 0] >= 0
    chosen_NK = _gate_weights(router, logits_NE, forced_NK.clamp(min=0))
    scores_NK = torch.where(replayed_N[:, None], chosen_NK.to(scores_NK.dtype), scores_NK)
    experts_NK = torch.where(replayed_N[:, None], forced_NK, experts_NK)
    if state.captured is not None:
        state.captured.append(experts_NK.detach())
    return logits_NE, scores_NK, experts_NK


def _int_attribute(module: nn.Module, name: str) -> int:
    """`module.<name>`, an int its __init__ or `install` set (top_k, num_experts, the layer):
    nn.Module's stubs read an attribute they do not declare as a Tensor or a Module."""
    value = getattr(module, name)
    assert isinstance(value, int), f"{type(module).__name__}.{name} is {value!r}, not an int"
    return value


def _gate_weights(router: nn.Module, logits_NE: Tensor, experts_NK: Tensor) -> Tensor:
    """The gate weights `router` gives the experts experts_NK, by its own rule."""
    if type(router).__name__ in SIGMOID_TOP_K_ROUTERS:
        # As DeepseekV3TopkRouter computes them: the correction bias picks, it does not weigh.
        sigmoid_router = cast(Any, router)  # its attributes (transformers is untyped)
        chosen_NK = logits_NE.sigmoid().gather(1, experts_NK)
        if sigmoid_router.norm_topk_prob:
            chosen_NK = chosen_NK / (chosen_NK.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen_NK * float(sigmoid_router.routed_scaling_factor)
    # The softmax over every expert, as the router's own top-k reads it, at the chosen ones.
    probs_NE = F.softmax(logits_NE, dim=-1, dtype=torch.float)
    chosen_NK = probs_NE.gather(-1, experts_NK)
    if getattr(router, "norm_topk_prob", True):
        chosen_NK = chosen_NK / chosen_NK.sum(dim=-1, keepdim=True)
    return chosen_NK
