"""Durable LoRA sessions: an operation is recorded COMPLETED only after the state it changed is
on disk, and after a crash every live LoRA session comes back RUNNING with the state of its
last completed operation.

What each kind changes (`changed_parts`): a forward-backward that trains, or a custom
forward-backward, the accumulated gradients; an optim-step the adapter, the optimizer moments
and the gradients (now none); a weights-sync the generator's adapter; sampling, scoring and
checkpoints nothing. The engine writes those parts and a record (the operation, its output,
the session's step and policy versions) atomically (engine/durable.py); a new session writes
everything once, when it is set up.

After a restart, before anything runs (`reconcile`): an operation whose state reached the disk
but whose COMPLETED record did not is completed from the record; the session's step and policy
versions are taken from the record too, since the store may be ahead of the weights by the
operation that was running. Then each live LoRA session is rebuilt on its resource's worker
(`restore`) ahead of any new operation. Full-weight sessions are not kept live (their state is
the whole model): they end in ERROR after a crash, as before, and resume from checkpoints.

Imports: engine (interface, durable), store, types.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from posttrain.engine import durable
from posttrain.engine.interface import Engine
from posttrain.store.repo import OUTPUT_TYPES, Repo, from_dict
from posttrain.types import (
    ForwardBackwardRequest,
    OperationKind,
    OperationOutput,
    OperationRecord,
    OperationRequest,
    OperationStatus,
    PolicyState,
    SessionRecord,
)

log = logging.getLogger("posttrain.durability")

EVERYTHING = durable.PARTS


def changed_parts(kind: OperationKind, request: OperationRequest | None) -> tuple[str, ...]:
    """The parts of a session's state an operation of `kind` changes (the module docstring)."""
    if kind == OperationKind.FORWARD_BACKWARD:
        scoring = isinstance(request, ForwardBackwardRequest) and request.forward_only
        return () if scoring else ("gradients",)
    if kind == OperationKind.CUSTOM_FORWARD_BACKWARD:
        return ("gradients",)
    if kind == OperationKind.OPTIM_STEP:
        return ("trainer", "optimizer", "gradients")
    if kind == OperationKind.WEIGHTS_SYNC:
        return ("generator",)
    return ()


class SessionDurability:
    def __init__(self, data_dir: Path, repo: Repo, engine: Engine) -> None:
        self.root = data_dir / "sessions"
        self.repo = repo
        self.engine = engine

    def directory(self, session_id: str) -> Path:
        return self.root / session_id

    def persist(
        self,
        session_id: str,
        parts: tuple[str, ...],
        op: OperationRecord | None = None,
        output: OperationOutput | None = None,
    ) -> None:
        """Write `parts` of a LoRA session's state (worker thread, after the engine changed
        them) with the record of `op`; a full-weight session is not kept live."""
        session = self.repo.get_session(session_id)
        if not parts or session is None or session.lora_config is None:
            return
        record = {
            "operation": op.id if op is not None else None,
            "kind": op.kind.value if op is not None else None,
            "output": None if output is None else dataclasses.asdict(output),
            "step": session.step,
            "policy_state": dataclasses.asdict(session.policy_state),
        }
        self.engine.persist_session(
            session.resource_id, session_id, self.directory(session_id), parts, record
        )

    def forget(self, session_id: str) -> None:
        durable.remove(self.directory(session_id))

    def record(self, session_id: str) -> dict[str, Any] | None:
        manifest = durable.read_manifest(self.directory(session_id))
        return manifest.get("record") if manifest else None

    def reconcile(self, session: SessionRecord) -> bool:
        """Before anything runs after a restart: whether `session` can be restored, and if so
        its store record and its last operation agree with the state on disk."""
        record = self.record(session.id) if session.lora_config is not None else None
        if record is None:
            return False
        # The weights follow the record, not the store: it may be an operation ahead.
        policy = PolicyState(**record["policy_state"])
        policy = dataclasses.replace(
            policy, target_weights_version=policy.applied_weights_version, pending_publish=False
        )
        self.repo.update_session(
            session.id,
            lambda s: dataclasses.replace(s, step=record["step"], policy_state=policy),
        )
        op_id = record.get("operation")
        op = self.repo.get_operation(op_id) if op_id else None
        if op is not None and op.status in (OperationStatus.PENDING, OperationStatus.RUNNING):
            output = from_dict(OUTPUT_TYPES[op.kind], record["output"])
            self.repo.put_operation(
                dataclasses.replace(
                    op, status=OperationStatus.COMPLETED, updated_at=time.time(), output=output
                )
            )
            log.info("operation %s completed before the restart: recorded from its state", op.id)
        return True

    def restore(self, session: SessionRecord) -> None:
        """Worker thread, the session freshly created on its loaded resource: its state."""
        record = self.record(session.id)
        assert record is not None, f"session {session.id} has no state to restore"
        version = int(record["policy_state"]["applied_weights_version"])
        self.engine.restore_session(
            session.resource_id, session.id, self.directory(session.id), version=version
        )
