"""The operation-kind table: per kind, how the service schedules it, what durable state it
changes and what a restart does with it.

Its typed request and output come from types.OPERATION_TYPES (the store reads those too); the
api layer's half, api/kinds.py, adds the wire body and reply. Whoever needs to know something
about a kind reads it here instead of branching on the kind:

- `sharing`: how the resource worker groups queued operations of this kind into one engine
  pass (service/worker.py). A kind that runs alone is a barrier: nothing is grouped across it.
- `on_generator`: it runs on the generator and leaves the trainer alone, so it may move to a
  generator lane (service/worker.py) and a deferred weights-sync never waits for it
  (service/publishing.py).
- `changes`: the parts of a session's durable state it changes (service/durability.py).
- `transition`: what it does to the session's step and policy versions, applied again when a
  full-weight session's journal is folded after a restart (service/full_weight_durability.py).
- `replay`: the engine call that runs it again from its kept request on a restored full-weight
  snapshot; None: it is not journaled (it changes nothing the snapshot holds).
- `snapshots`: a full-weight snapshot may follow it (each persist_every-th optimizer step).

Imports: engine.interface, types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from posttrain.engine.interface import Engine
from posttrain.records import SessionRecord
from posttrain.service import policy
from posttrain.types import (
    OPERATION_TYPES,
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    OperationKind,
    OperationRequest,
    OperationTypes,
    OptimStepRequest,
)


class Sharing(Enum):
    ALONE = "alone"  # one operation per engine pass
    # Operations of other sessions (at most SchedulerConfig.max_batch): each session's
    # gradients accumulate in order, so two of one session never share a pass.
    ACROSS_SESSIONS = "across sessions"
    # Operations of any sessions, its own included (at most max_sample_rows sequences): it
    # changes no state.
    ANY = "any"


Transition = Callable[[SessionRecord, float], SessionRecord]
# (engine, session, request, trainer policy version when it first ran) -> None
Replay = Callable[[Engine, SessionRecord, Any, int], None]


@dataclass(frozen=True)
class KindRules:
    types: OperationTypes
    sharing: Sharing = Sharing.ALONE
    on_generator: bool = False
    # None: a request the caller does not hold (a deferred weights-sync's completion).
    changes: Callable[[OperationRequest | None], tuple[str, ...]] = lambda _: ()
    transition: Transition | None = None
    replay: Replay | None = None
    snapshots: bool = False


def _trains(request: OperationRequest | None) -> tuple[str, ...]:
    """A forward-backward changes the gradients unless it only scores (forward_only)."""
    scoring = isinstance(request, ForwardBackwardRequest) and request.forward_only
    return () if scoring else ("gradients",)


def _replay_forward_backward(engine: Engine, session: SessionRecord, request: Any, _: int) -> None:
    assert isinstance(request, ForwardBackwardRequest), type(request).__name__
    (outcome,) = engine.forward_backward_batch(session.resource_id, [(session.id, request)])
    if isinstance(outcome, Exception):
        raise outcome


def _replay_custom_forward_backward(
    engine: Engine, session: SessionRecord, request: Any, _: int
) -> None:
    assert isinstance(request, CustomForwardBackwardRequest), type(request).__name__
    engine.custom_forward_backward(session.resource_id, session.id, request)


def _replay_optim_step(engine: Engine, session: SessionRecord, request: Any, _: int) -> None:
    assert isinstance(request, OptimStepRequest), type(request).__name__
    engine.optim_step(session.resource_id, session.id, request)


def _replay_weights_sync(engine: Engine, session: SessionRecord, _: Any, version: int) -> None:
    engine.publish(session.resource_id, session.id, version=version)


_TYPES = OPERATION_TYPES
KINDS: dict[OperationKind, KindRules] = {
    OperationKind.FORWARD_BACKWARD: KindRules(
        _TYPES[OperationKind.FORWARD_BACKWARD],
        sharing=Sharing.ACROSS_SESSIONS,
        changes=_trains,
        replay=_replay_forward_backward,
    ),
    OperationKind.CUSTOM_FORWARD_BACKWARD: KindRules(
        _TYPES[OperationKind.CUSTOM_FORWARD_BACKWARD],
        changes=lambda _: ("gradients",),
        replay=_replay_custom_forward_backward,
    ),
    OperationKind.OPTIM_STEP: KindRules(
        _TYPES[OperationKind.OPTIM_STEP],
        changes=lambda _: ("trainer", "optimizer", "gradients"),
        transition=policy.stepped,
        replay=_replay_optim_step,
        snapshots=True,
    ),
    OperationKind.WEIGHTS_SYNC: KindRules(
        _TYPES[OperationKind.WEIGHTS_SYNC],
        changes=lambda _: ("generator",),
        transition=policy.synced,
        replay=_replay_weights_sync,
    ),
    OperationKind.SAMPLE: KindRules(
        _TYPES[OperationKind.SAMPLE], sharing=Sharing.ANY, on_generator=True
    ),
    OperationKind.TRAINING_CHECKPOINT: KindRules(_TYPES[OperationKind.TRAINING_CHECKPOINT]),
    OperationKind.INFERENCE_CHECKPOINT: KindRules(_TYPES[OperationKind.INFERENCE_CHECKPOINT]),
}
