"""Durable full-weight sessions: a snapshot every `persist_every` optimizer steps, and a journal
of the operations that changed the state since, replayed after a restart.

A full-weight session's state is the whole model twice (trainer and generator) plus its
optimizer moments; writing it after every operation, as LoRA sessions do, costs a multiple of
the step (docs/benchmarks.md). So instead:

- Snapshot. Once at setup, and after each optim-step that brings the session's step to a
  multiple of `persist_every`, the parts changed since the last snapshot are written with
  engine/checkpoint/durable.py's atomic manifest and a record (the operation, its output, the step
  and policy versions), before that optim-step is recorded COMPLETED.
- Journal. Every other operation that changes the state (a forward-backward that trains, a
  custom forward-backward, an optim-step, a weights-sync) keeps the request body it arrived
  with in the operations table when it is recorded COMPLETED (Repo.put_operations'
  keep_bodies), so nothing reported COMPLETED is lost; a snapshot drops the bodies it covers.
  A body's payload_id stays readable: the payload store deletes no payload (service/payloads.py).
- Restart. `replan` folds the journal over the snapshot's step and policy versions with the
  same transitions the scheduler applies (service/policy.py): that is the store's session
  after reconcile. `replay` then runs the journal's requests, parsed again from their bodies,
  on the engine in submission order on the restored snapshot, before any new operation runs
  on the resource; their outputs are not recorded again (they are COMPLETED already).

Why the replay is exact: a full-weight resource hosts one session, so every journaled
operation ran alone in its engine pass, and its replay runs the same kernels on the same inputs
(the snapshot's weights, moments, gradients and RNG state, then the same requests in the same
order; sampling, which is not replayed, draws from its own torch.Generator, never the global
RNG that dropout uses). CPU kernels are deterministic for equal inputs, shapes and thread
counts, so the state after the replay equals the state before the crash bit for bit. CUDA
kernels that accumulate with atomics may differ in the last bits.

Imports: engine.interface, store (through the caller), types.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from posttrain.engine.interface import Engine
from posttrain.service import policy
from posttrain.types import (
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    OperationKind,
    OperationRecord,
    OperationRequest,
    OptimStepRequest,
    SessionRecord,
)

Parse = Callable[[OperationRecord, bytes], OperationRequest]


def is_snapshot_due(kind: OperationKind, step: int, persist_every: int) -> bool:
    """Whether an operation of `kind` that leaves the session at `step` is snapshotted."""
    return kind == OperationKind.OPTIM_STEP and step % persist_every == 0


@dataclasses.dataclass(frozen=True)
class Replay:
    op: OperationRecord
    body: bytes
    version: int  # the trainer's policy version when it ran (what a weights-sync publishes)


def replan(
    at_snapshot: SessionRecord, journal: list[tuple[OperationRecord, bytes]], now: float
) -> tuple[list[Replay], SessionRecord]:
    """The journal's replays, and the session once they have run (step and policy versions).

    Every replayed weights-sync publishes at its own place (a deferred one's weights were the
    trainer's as of that place, service/publishing.py), so the generator serves them all."""
    session = at_snapshot
    replays = []
    for op, body in journal:
        replays.append(Replay(op, body, session.policy_state.trainer_step))
        if op.kind == OperationKind.OPTIM_STEP:
            session = policy.stepped(session, now)
        elif op.kind == OperationKind.WEIGHTS_SYNC:
            session = policy.synced(session, now)
    return replays, session


def _forward_backward(engine: Engine, session: SessionRecord, request: Any, _: int) -> None:
    assert isinstance(request, ForwardBackwardRequest), type(request).__name__
    (outcome,) = engine.forward_backward_batch(session.resource_id, [(session.id, request)])
    if isinstance(outcome, Exception):
        raise outcome


def _custom_forward_backward(engine: Engine, session: SessionRecord, request: Any, _: int) -> None:
    assert isinstance(request, CustomForwardBackwardRequest), type(request).__name__
    engine.custom_forward_backward(session.resource_id, session.id, request)


def _optim_step(engine: Engine, session: SessionRecord, request: Any, _: int) -> None:
    assert isinstance(request, OptimStepRequest), type(request).__name__
    engine.optim_step(session.resource_id, session.id, request)


def _weights_sync(engine: Engine, session: SessionRecord, _: Any, version: int) -> None:
    engine.publish(session.resource_id, session.id, version=version)


# The engine call each journaled kind replays (its output is already recorded).
REPLAY: dict[OperationKind, Callable[[Engine, SessionRecord, Any, int], None]] = {
    OperationKind.FORWARD_BACKWARD: _forward_backward,
    OperationKind.CUSTOM_FORWARD_BACKWARD: _custom_forward_backward,
    OperationKind.OPTIM_STEP: _optim_step,
    OperationKind.WEIGHTS_SYNC: _weights_sync,
}


def replay(engine: Engine, session: SessionRecord, replays: list[Replay], parse: Parse) -> None:
    """Worker thread, the snapshot restored: run the journal again, in order."""
    for item in replays:
        REPLAY[item.op.kind](engine, session, parse(item.op, item.body), item.version)
