"""Exact tensor bytes the engine holds: per model resource and per session (read-only).

Counts are numel * element size of the engine's own tensors, not process RSS, so a benchmark
(bench/session_memory.py) can say what a session costs beside the base model. Gradients exist
only between a forward-backward and the next optim-step, so they are reported apart.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor

from posttrain.engine.parallel.fsdp import local
from posttrain.engine.state import ResourceState, SessionState


@dataclass(frozen=True)
class SessionFootprint:
    weights_bytes: int  # the trainer's trainable tensors (adapter, or every weight)
    generator_bytes: int  # the generator's adapter, or its copy of the model
    optimizer_bytes: int  # optimizer state (AdamW: two moments per tensor after a step)
    gradient_bytes: int  # accumulated gradients, until the next optim-step

    @property
    def resident_bytes(self) -> int:
        """What the session holds between steps (gradients are transient)."""
        return self.weights_bytes + self.generator_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class ResourceFootprint:
    base_parameters: int  # parameters of the loaded base model
    base_bytes: int
    total_bytes: int  # every tensor of the resource, each storage counted once


def nbytes(tensors: Iterable[Tensor]) -> int:
    """Bytes the tensors hold: of a DTensor (parallel/fsdp.py) this rank's slice; none for a
    tensor whose storage is freed (an FSDP2 layer's gathered weights between forwards)."""
    held = (local(t) for t in tensors)  # a DTensor: this rank's slice (parallel/fsdp.py)
    return sum(t.numel() * t.element_size() for t in held if t.untyped_storage().nbytes())


def state_tensors(state: object) -> list[Tensor]:
    """Every tensor inside a (nested) optimizer state_dict."""
    if isinstance(state, Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in state_tensors(value)]
    return []


def session_footprint(resource: ResourceState, session: SessionState) -> SessionFootprint:
    params = [p for _, p in session.optimizer.named_params]
    if session.generator_model is not None:
        generator = nbytes(session.generator_model.parameters())
    elif session.has_no_generator:
        generator = 0
    else:
        generator = nbytes(p for _, p in resource.lora.adapter_parameters(session.generator_key))
    return SessionFootprint(
        weights_bytes=nbytes(params),
        generator_bytes=generator,
        optimizer_bytes=nbytes(state_tensors(session.optimizer.state_dict())),
        gradient_bytes=nbytes(p.grad for p in params if p.grad is not None),
    )


def resource_footprint(resource: ResourceState) -> ResourceFootprint:
    """Base parameters and buffers, every adapter (trainer and generator), a full-weight
    generator's model copy, optimizer state and gradients; a tensor sharing another's storage
    (a tied head) is counted once."""
    model = resource.loaded.model
    base = list(model.parameters())
    tensors = [*base, *model.buffers()]
    for key in resource.lora.adapter_keys():
        tensors += [p for _, p in resource.lora.adapter_parameters(key)]
    for session in resource.sessions.values():
        tensors += state_tensors(session.optimizer.state_dict())
        tensors += [p.grad for _, p in session.optimizer.named_params if p.grad is not None]
        if session.generator_model is not None:
            tensors += list(session.generator_model.parameters())
    held = [local(t) for t in tensors]  # a DTensor: this rank's slice (parallel/fsdp.py)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    return ResourceFootprint(
        base_parameters=sum(p.numel() for p in base),
        base_bytes=nbytes(base),
        total_bytes=sum(storages.values()),
    )
