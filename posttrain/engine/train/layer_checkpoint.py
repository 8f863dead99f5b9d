"""Activation checkpointing of decoder layers: inside `checkpointed_layers`, a forward that
builds a graph keeps each decoder layer's input for the backward instead of the activations
the layer's backward reads, and the backward runs that layer's forward again to get them
(torch.utils.checkpoint, non-reentrant), one layer at a time. The numbers are the same; the
memory kept per token falls from every layer's activations to one hidden vector per layer
(memory/estimate.py counts both), at the cost of a second forward of every layer.

The backward runs after the forward's blocks have exited (train/trainer.py back-propagates
all buckets at once), so a recompute re-enters what the forward ran under:

- the rows' LoRA routing (model/lora.py): the caller's `recompute_context`, the same
  `LoraModel.route` its forward ran inside;
- MoE routes (model/routing.py): the forward captures the experts each router of the layer
  chose (replayed from a routed_experts_key or chosen freely), and the recompute replays
  exactly those, so it never routes again (a near-tie flipped by another kernel order would
  change the recomputed graph);
- dropout (LoRA dropout draws from torch's global generator): torch.utils.checkpoint restores
  the CPU and device RNG states of the forward before recomputing (preserve_rng_state).

Decoder layers are the outermost transformers GradientCheckpointingLayer modules (every family
posttrain serves has them). Their `forward` is replaced on the instance while the block runs:
module hooks (FSDP2's gathers, parallel/fsdp.py) stay outside the checkpoint, as in
transformers' own gradient checkpointing, and do not run again in the recompute; by then
FSDP2's pre-backward hook has gathered the layer's parameters.

Imports: torch, transformers, model.routing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from posttrain.model import routing

# Keyword arguments by which the families hand a layer a KV cache: a recompute would write it
# a second time, so a checkpointed layer must get none (the trainer passes use_cache=False).
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers, in model order: the outermost GradientCheckpointingLayers."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, GradientCheckpointingLayer):
            continue
        if not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    return [module for _, module in found]


@contextmanager
def checkpointed_layers(
    model: nn.Module, recompute_context: Callable[[], AbstractContextManager[object]]
) -> Iterator[None]:
    """Inside, every decoder layer of `model` called with gradients enabled is checkpointed;
    its recompute runs inside `recompute_context()` (the forward's LoRA routing)."""
    layers = decoder_layers(model)
    assert layers, f"{type(model).__name__} has no decoder layers to checkpoint"
    replaced = [(layer, layer.__dict__.get("forward")) for layer in layers]
    for layer in layers:
        layer.forward = partial(
            _checkpointed, layer.forward, recompute_context, routing.router_layers(layer)
        )
    try:
        yield
    finally:
        for layer, own in replaced:
            del layer.forward
            if own is not None:
                layer.forward = own


def _checkpointed(
    forward: Callable[..., Any],
    recompute_context: Callable[[], AbstractContextManager[object]],
    router_layers: list[int],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """The layer's `forward(*args, **kwargs)`, checkpointed when it builds a graph."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    caches = [name for name in CACHE_ARGUMENTS if kwargs.get(name) is not None]
    assert not caches, f"a checkpointed layer got a KV cache ({caches})"
    routes: list[Tensor] = []

    def contexts() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        return _forward(router_layers, routes), _recompute(recompute_context, router_layers, routes)

    return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


@contextmanager
def _forward(router_layers: list[int], routes: list[Tensor]) -> Iterator[None]:
    """The layer's first forward: its routers' choices recorded into `routes`."""
    if not router_layers:
        yield
        return
    with routing.capture() as captured:
        yield
    routes.extend(captured)


@contextmanager
def _recompute(
    recompute_context: Callable[[], AbstractContextManager[object]],
    router_layers: list[int],
    routes: list[Tensor],
) -> Iterator[None]:
    """The layer's forward again in the backward: the forward's routing of rows and experts."""
    forced = dict(zip(router_layers, routes, strict=True))
    with recompute_context(), routing.replay(forced) if forced else nullcontext():
        yield
