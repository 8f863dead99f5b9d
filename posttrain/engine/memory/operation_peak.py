"""The estimated peak bytes of one operation pass on a resource, from what it holds now: the
engine's answer to memory admission (service/scheduling/admission.py). The formulas per pass are
estimate.py's; this module picks the pass and its inputs: the sessions' trainable bytes, on a
trainer group's rank the largest share of rows (parallel/data_parallel.py), what sharded
parameters gather (parallel/fsdp.py), and whether a training pass checkpoints its decoder
layers (--activation-checkpointing; auto: when the pass does not fit without, headroom.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import cache
from typing import TypeVar

from posttrain.config import EngineConfig
from posttrain.engine.memory import estimate
from posttrain.engine.memory.footprint import nbytes
from posttrain.engine.memory.headroom import headroom
from posttrain.engine.parallel.data_parallel import DataParallel
from posttrain.engine.state import ResourceState, SessionState
from posttrain.errors import NotFound
from posttrain.types import (
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    OperationKind,
    OperationRequest,
    SampleRequest,
)

# The requests of a training pass (forward-backward or custom forward-backward).
TrainingRequest = ForwardBackwardRequest | CustomForwardBackwardRequest
R = TypeVar("R")


def _all_of(requests: Sequence[OperationRequest], request_type: type[R]) -> list[R]:
    """The requests of one pass as the type their kind takes (each one is)."""
    narrowed: list[R] = [request for request in requests if isinstance(request, request_type)]
    assert len(narrowed) == len(requests), f"every request of the pass is a {request_type}"
    return narrowed


TRAINING_KINDS = (OperationKind.FORWARD_BACKWARD, OperationKind.CUSTOM_FORWARD_BACKWARD)


def operation_peak_bytes(
    config: EngineConfig,
    resource: ResourceState,
    kind: OperationKind,
    sessions: list[SessionState | NotFound],
    requests: list[OperationRequest],
    *,
    itemsize: int,
) -> int:
    """Estimated peak bytes that running `requests` of `kind` as one pass adds to what the
    resource holds now; `sessions`: each request's session (NotFound: no state here, no
    trainable tensors; unused for a sample); `itemsize`: bytes per element of the weights.
    A training pass counts its decoder layers checkpointed where it will run so
    (layer_checkpointing)."""
    peak = _peak_estimate(config, resource, kind, sessions, requests, itemsize=itemsize)
    return peak(_is_checkpointed(config, resource, kind, requests, peak))


def layer_checkpointing(
    config: EngineConfig,
    resource: ResourceState,
    kind: OperationKind,
    sessions: list[SessionState | NotFound],
    requests: list[OperationRequest],
    *,
    itemsize: int,
) -> bool:
    """Whether a training pass over `requests` checkpoints its decoder layers
    (train/layer_checkpoint.py): as --activation-checkpointing says; auto: when its estimated
    peak without does not fit what the device has free now and the checkpointed one is lower
    (a model of one or two layers keeps about as much either way). A pass without a backward
    (a forward, a sample, ...) has nothing to checkpoint."""
    peak = _peak_estimate(config, resource, kind, sessions, requests, itemsize=itemsize)
    return _is_checkpointed(config, resource, kind, requests, peak)


def _peak_estimate(
    config: EngineConfig,
    resource: ResourceState,
    kind: OperationKind,
    sessions: list[SessionState | NotFound],
    requests: list[OperationRequest],
    *,
    itemsize: int,
) -> Callable[[bool], int]:
    """The pass's estimated peak, checkpointed or not, each made at most once."""

    @cache
    def peak(checkpointed: bool) -> int:
        return _peak_bytes(
            config, resource, kind, sessions, requests, itemsize=itemsize, checkpointed=checkpointed
        )

    return peak


def _is_checkpointed(
    config: EngineConfig,
    resource: ResourceState,
    kind: OperationKind,
    requests: list[OperationRequest],
    peak: Callable[[bool], int],
) -> bool:
    """layer_checkpointing's rule; auto estimates the checkpointed peak only where the plain
    one does not fit (a training pass asks on every run, and the common one fits)."""
    mode = config.activation_checkpointing
    if mode == "off" or kind not in TRAINING_KINDS:
        return False
    if all(isinstance(r, ForwardBackwardRequest) and r.forward_only for r in requests):
        return False
    if mode == "on":
        return True
    if peak(False) <= headroom(resource.loaded.device, config.memory_limit).free_bytes:
        return False
    return peak(True) < peak(False)


def _peak_bytes(
    config: EngineConfig,
    resource: ResourceState,
    kind: OperationKind,
    sessions: list[SessionState | NotFound],
    requests: list[OperationRequest],
    *,
    itemsize: int,
    checkpointed: bool,
) -> int:
    loaded = resource.loaded
    shape = estimate.model_shape(loaded.model.config, loaded.kv, itemsize, device=loaded.device)
    if loaded.vision is not None:
        shape = dataclasses.replace(
            shape, vision_token_bytes=loaded.vision.token_activation_bytes
        )
    chunk = config.logprob_chunk_tokens
    if kind == OperationKind.SAMPLE:  # the sampler's activations: no session tensor counts
        return estimate.sample_bytes(
            shape, _all_of(requests, SampleRequest), chunk_tokens=chunk
        )
    # Once per session: the scheduler asks about every prefix of a queue (admission.py),
    # often one session's operations, and walking a model's tensors is not free.
    own_bytes: dict[int, int] = {}
    for s in sessions:
        if isinstance(s, SessionState) and id(s) not in own_bytes:
            own_bytes[id(s)] = nbytes(p for _, p in s.optimizer.named_params)
    trainable = [own_bytes.get(id(s), 0) for s in sessions]
    # Sharded parameters (parallel/fsdp.py): `trainable` counts this rank's slices alone; a
    # pass also gathers others' for a while.
    shards = 0 if resource.param_shards is None else resource.param_shards.operation_bytes()
    if kind in TRAINING_KINDS:
        training: list[TrainingRequest] = [
            r
            for r in requests
            if isinstance(r, ForwardBackwardRequest | CustomForwardBackwardRequest)
        ]
        assert len(training) == len(requests), "every request of the pass is a training one"

        def pass_bytes(share: list[TrainingRequest]) -> int:
            if kind == OperationKind.FORWARD_BACKWARD:
                return estimate.forward_backward_bytes(
                    shape,
                    _all_of(share, ForwardBackwardRequest),
                    chunk_tokens=chunk,
                    trainable_bytes=trainable,
                    checkpointed=checkpointed,
                )
            (request,) = _all_of(share, CustomForwardBackwardRequest)
            return estimate.custom_forward_backward_bytes(
                shape,
                request,
                chunk_tokens=chunk,
                trainable_bytes=trainable[0],
                checkpointed=checkpointed,
            )

        if resource.group is None:
            return pass_bytes(training)
        # A rank forwards only its share of the rows (parallel/data_parallel.py), but packs and
        # scores the whole batch: the largest share's pass, and the whole batch's packing.
        samples = [s for request in training for s in request.samples]
        packed = len(samples) * max(len(s.tokens) for s in samples)
        shares = _rank_shares(resource.group, training)
        return (
            shards
            + max(pass_bytes(share) for share in shares)
            + packed * estimate.PACKED_BYTES_PER_TOKEN
        )
    (session,) = sessions
    if kind == OperationKind.OPTIM_STEP:
        if not isinstance(session, SessionState):
            return 0
        params = [p for _, p in session.optimizer.named_params]
        largest = max((nbytes([p]) for p in params), default=0)
        has_moments = session.optimizer.has_state()
        return estimate.optim_step_bytes(trainable[0], largest, has_moments=has_moments)
    if resource.param_shards is not None and isinstance(session, SessionState):
        # Gathered in full on rank 0 (a checkpoint) or into the generator, one at a time.
        return sum(p.numel() * p.element_size() for _, p in session.optimizer.named_params)
    return trainable[0]  # weights-sync and checkpoints: one copy of the trainable tensors


def _rank_shares(
    group: DataParallel, requests: list[TrainingRequest]
) -> list[list[TrainingRequest]]:
    """Each rank's share of a training pass's `requests` (their samples, and a custom
    request's gradients, cut to the rank's rows), and the batch's shortest row besides: a
    padding forward (trainer.aligned_forwards) or a rank without rows forwards it."""
    samples = [s for request in requests for s in request.samples]
    lengths = [len(s.tokens) for s in samples]
    shortest = min(range(len(samples)), key=lambda r: lengths[r])
    shares = []
    for rows in group.shares(lengths):
        keep = {*rows, shortest}
        share: list[TrainingRequest] = []
        first = 0
        for request in requests:
            kept = [i for i in range(len(request.samples)) if first + i in keep]
            first += len(request.samples)
            rows_kept = tuple(request.samples[i] for i in kept)
            # Kept without rows too: its session's gradients still appear on every rank.
            if isinstance(request, CustomForwardBackwardRequest):
                gradients = tuple(request.gradients[i] for i in kept)
                share.append(dataclasses.replace(request, samples=rows_kept, gradients=gradients))
            else:
                share.append(dataclasses.replace(request, samples=rows_kept))
        shares.append(share)
    return shares
