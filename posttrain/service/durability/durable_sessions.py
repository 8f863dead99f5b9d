"""Durable sessions: an operation is recorded COMPLETED only after the state it changed is
on disk, and after a crash every live session comes back RUNNING with the state of its last
completed operation.

What each kind changes is the kind table's `changes` (service/operations/kinds.py): a
forward-backward that trains, or a custom forward-backward, the accumulated gradients; an optim-step
the adapter, the optimizer moments and the gradients (now none); a weights-sync the generator's
adapter; sampling, scoring and checkpoints nothing. The engine writes those parts and a
record (the operation, its output, the session's step and policy versions) atomically
(engine/checkpoint/durable.py); a new session writes everything once, when it is set up.

After a restart, before anything runs (`reconcile`): an operation whose state reached the disk
but whose COMPLETED record did not is completed from the record; the session's step and policy
versions are taken from the record too, since the store may be ahead of the weights by the
operation that was running. Then each live LoRA session is rebuilt on its resource's worker
(`restore`) ahead of any new operation.

Full-weight sessions (their state is the whole model) are snapshotted every `persist_every`
optimizer steps, and the operations between snapshots are journaled and replayed after a
restart: service/durability/full_weight.py. They too come back RUNNING with the state of their
last completed operation.

Imports: engine (interface, files), store, types.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any, TypedDict, cast

from posttrain.engine import files
from posttrain.engine.interface import Engine
from posttrain.records import OperationRecord, PolicyState, SessionRecord
from posttrain.service.durability import full_weight
from posttrain.service.operations.kinds import KINDS
from posttrain.statuses import OperationStatus
from posttrain.store.codec import output_from_dict
from posttrain.store.repo import Repo
from posttrain.types import OperationKind, OperationOutput, OperationRequest

log = logging.getLogger("posttrain.durability")

EVERYTHING = files.SESSION_PARTS


class StateRecord(TypedDict):
    """The record written with a session's state (Engine.persist_session keeps it as JSON):
    the operation whose changes the state holds, None for the state a new session set up."""

    operation: str | None
    kind: str | None  # the operation's OperationKind value
    output: dict[str, Any] | None  # its output, as the store's codec reads it back
    step: int
    policy_state: dict[str, Any]  # dataclasses.asdict of the session's PolicyState


def changed_parts(kind: OperationKind, request: OperationRequest | None) -> tuple[str, ...]:
    """The parts of a session's state an operation of `kind` changes (the module docstring)."""
    return KINDS[kind].changes(request)


class SessionDurability:
    def __init__(
        self,
        data_dir: Path,
        repo: Repo,
        engine: Engine,
        *,
        persist_every: int,  # ServerConfig.persist_every
    ) -> None:
        self.root = data_dir / "sessions"
        self.repo = repo
        self.engine = engine
        self.persist_every = persist_every
        # Per full-weight session, the parts changed since its last snapshot. Locked: a
        # deferred weights-sync completes on the thread that submitted it.
        self._unsaved: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def directory(self, session_id: str) -> Path:
        return self.root / session_id

    def persist(
        self,
        session_id: str,
        parts: tuple[str, ...],
        op: OperationRecord | None = None,
        output: OperationOutput | None = None,
    ) -> bool:
        """Make `parts` of a session's state durable (after the engine changed them) with the
        record of `op`. Returns whether `op` is journaled instead (a full-weight session
        between snapshots): its request must stay until a snapshot covers it."""
        session = self.repo.get_session(session_id)
        if not parts or session is None:
            return False
        if session.lora_config is not None:
            self._write(session, parts, op, output)
            return False
        with self._lock:
            unsaved = self._unsaved.setdefault(session_id, set())
            unsaved.update(parts)
            if op is not None and not full_weight.is_snapshot_due(
                op.kind, session.step, self.persist_every
            ):
                return True
            self._write(session, tuple(p for p in EVERYTHING if p in unsaved), op, output)
            del self._unsaved[session_id]
        self.repo.clear_requests(session_id, through=op.id if op is not None else None)
        return False

    def _write(
        self,
        session: SessionRecord,
        parts: tuple[str, ...],
        op: OperationRecord | None,
        output: OperationOutput | None,
    ) -> None:
        record: StateRecord = {
            "operation": op.id if op is not None else None,
            "kind": op.kind.value if op is not None else None,
            "output": None if output is None else dataclasses.asdict(output),
            "step": session.step,
            "policy_state": dataclasses.asdict(session.policy_state),
        }
        # dict(): the engine takes any JSON object, and a TypedDict is not a dict[str, Any].
        self.engine.persist_session(
            session.resource_id, session.id, self.directory(session.id), parts, dict(record)
        )

    def forget(self, session_id: str) -> None:
        files.remove_session_state(self.directory(session_id))
        self.repo.clear_requests(session_id, through=None)
        with self._lock:
            self._unsaved.pop(session_id, None)

    def record(self, session_id: str) -> StateRecord | None:
        # What _write gave persist_session: the engine reads it back as plain JSON.
        return cast(StateRecord | None, files.session_record(self.directory(session_id)))

    def reconcile(self, session: SessionRecord) -> bool:
        """Before anything runs after a restart: whether `session` can be restored, and if so
        its store record and its last operation agree with the state on disk (a full-weight
        session's: the snapshot advanced by its journal)."""
        record = self.record(session.id)
        if record is None:
            return False
        _, replanned = self._replan(session, record)
        self.repo.update_session(
            session.id,
            lambda s: dataclasses.replace(
                s, step=replanned.step, policy_state=replanned.policy_state
            ),
        )
        op_id = record.get("operation")
        op = self.repo.get_operation(op_id) if op_id else None
        if op is not None and op.status in (OperationStatus.PENDING, OperationStatus.RUNNING):
            kept = record["output"]
            assert kept is not None, f"operation {op.id}'s state was written without its output"
            output = output_from_dict(op.kind, kept)
            self.repo.put_operation(
                dataclasses.replace(
                    op, status=OperationStatus.COMPLETED, updated_at=time.time(), output=output
                )
            )
            log.debug("operation %s completed before the restart: recorded from its state", op.id)
        if session.lora_config is None and op_id is not None:
            # A crash between a snapshot and its clearing. The setup snapshot (no operation)
            # covers nothing: the journal after it is the whole journal, and must stay.
            self.repo.clear_requests(session.id, through=op_id)
        return True

    def _replan(
        self, session: SessionRecord, record: StateRecord
    ) -> tuple[list[full_weight.Replay], SessionRecord]:
        """The journal's replays (none for LoRA) and the session's step and policy after them,
        from the state on disk: the store may be ahead of it by the operation that was
        running."""
        policy = PolicyState(**record["policy_state"])
        policy = dataclasses.replace(
            policy, target_weights_version=policy.applied_weights_version, pending_publish=False
        )
        at_record = dataclasses.replace(session, step=record["step"], policy_state=policy)
        if session.lora_config is not None:
            return [], at_record
        journal = self.repo.journal(session.id, after=record.get("operation"))
        return full_weight.replan(at_record, journal, time.time())

    def restore(
        self, session: SessionRecord, prepare: full_weight.Prepare = full_weight.as_kept
    ) -> None:
        """Worker thread, the session freshly created on its loaded resource: its state, and
        for a full-weight session its journal run again (each request through `prepare`)."""
        record = self.record(session.id)
        assert record is not None, f"session {session.id} has no state to restore"
        version = int(record["policy_state"]["applied_weights_version"])
        self.engine.restore_session(
            session.resource_id, session.id, self.directory(session.id), version=version
        )
        replays, _ = self._replan(session, record)
        if replays:
            full_weight.replay(self.engine, session, replays, prepare)
            log.info("session %s: %d journaled operations replayed", session.id, len(replays))
        if session.lora_config is None:
            with self._lock:  # what the replay changed is not in the snapshot
                self._unsaved[session.id] = set(EVERYTHING)
