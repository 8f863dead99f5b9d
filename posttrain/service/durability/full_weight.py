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
  custom forward-backward, an optim-step, a weights-sync: the kinds with a `replay` in
  service/operations/kinds.py) keeps its typed request in the operations table when it is recorded
  COMPLETED (Repo.put_operations' keep_requests), so nothing reported COMPLETED is lost; a
  snapshot drops the requests it covers.
- Restart. `replan` folds the journal over the snapshot's step and policy versions with the
  same transitions the scheduler applies (service/lifecycle/policy.py): that is the store's session
  after reconcile. `replay` then runs the journal's requests, read back from the store,
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

from posttrain.engine.interface import Engine
from posttrain.errors import EngineFailure
from posttrain.records import OperationRecord, SessionRecord
from posttrain.service.operations.kinds import KINDS
from posttrain.types import OperationKind, OperationRequest

# What a kept request goes through before it runs again (routed-experts keys resolved).
Prepare = Callable[[OperationRecord, OperationRequest], OperationRequest]


def as_kept(_: OperationRecord, request: OperationRequest) -> OperationRequest:
    return request


def is_snapshot_due(kind: OperationKind, step: int, persist_every: int) -> bool:
    """Whether an operation of `kind` that leaves the session at `step` is snapshotted."""
    return KINDS[kind].snapshots and step % persist_every == 0


@dataclasses.dataclass(frozen=True)
class Replay:
    op: OperationRecord
    # None: an older server kept only its HTTP body, and the api layer could not parse it.
    request: OperationRequest | None
    version: int  # the trainer's policy version when it ran (what a weights-sync publishes)


def replan(
    at_snapshot: SessionRecord,
    journal: list[tuple[OperationRecord, OperationRequest | None]],
    now: float,
) -> tuple[list[Replay], SessionRecord]:
    """The journal's replays, and the session once they have run (step and policy versions).

    Every replayed weights-sync publishes at its own place (a deferred one's weights were the
    trainer's as of that place, service/scheduling/publishing.py), so the generator serves them
    all."""
    session = at_snapshot
    replays = []
    for op, request in journal:
        replays.append(Replay(op, request, session.policy_state.trainer_step))
        if (transition := KINDS[op.kind].transition) is not None:
            session = transition(session, now)
    return replays, session


def replay(engine: Engine, session: SessionRecord, replays: list[Replay], prepare: Prepare) -> None:
    """Worker thread, the snapshot restored: run the journal again, in order."""
    for item in replays:
        run = KINDS[item.op.kind].replay
        assert run is not None, f"{item.op.kind} operation {item.op.id} was journaled"
        if item.request is None:
            raise EngineFailure(
                f"session {session.id}: journaled operation {item.op.id} has no readable request"
            )
        run(engine, session, prepare(item.op, item.request), item.version)
