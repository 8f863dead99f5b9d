"""The one place a queued operation's status changes: PENDING -> RUNNING -> COMPLETED or FAILED.

The scheduler's operation groups and the publish mailbox's deferred weights-syncs both finish
through `finish`, so every finished operation is counted in the operation metrics. Each call
writes its operations in one store transaction.

Imports: store, types.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from posttrain.errors import operation_error_code, posttrainError
from posttrain.records import OperationRecord
from posttrain.service.durability.durable_sessions import SessionDurability
from posttrain.service.metrics import OperationMetrics
from posttrain.service.operations.kinds import Outcome
from posttrain.statuses import OperationErrorCode, OperationStatus
from posttrain.store.repo import Repo

log = logging.getLogger("posttrain.scheduler")


def error_code(exc: BaseException) -> OperationErrorCode:
    return OperationErrorCode(operation_error_code(exc))


def _message(exc: BaseException) -> str:
    return exc.message if isinstance(exc, posttrainError) else f"{type(exc).__name__}: {exc}"


class OperationRecorder:
    def __init__(
        self, repo: Repo, metrics: OperationMetrics, durability: SessionDurability | None = None
    ) -> None:
        self.repo = repo
        self.metrics = metrics
        # None: nothing is kept live on disk (tests with a fake engine).
        self.durability = durability

    def start(self, ops: list[OperationRecord]) -> list[OperationRecord]:
        """Mark the operations RUNNING (updated_at is when they started: the run-time metric)."""
        now = time.time()
        running = [
            dataclasses.replace(op, status=OperationStatus.RUNNING, updated_at=now) for op in ops
        ]
        if running:
            self.repo.put_operations(running)
        return running

    def finish(
        self,
        outcomes: list[tuple[OperationRecord, Outcome]],
        changed: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        """Record each operation COMPLETED with its output or FAILED with its error's code.

        `changed` names, per operation id, the parts of its session's state it changed: they
        are made durable first (service/durability/durable_sessions.py), so nothing reported
        COMPLETED is lost by a crash: written, or for a full-weight session between snapshots
        journaled (its request stays); an operation whose state cannot be written fails instead."""
        if not outcomes:
            return
        journaled: set[str] = set()  # their requests stay (service/durability/durable_sessions.py)
        if changed and self.durability is not None:
            outcomes = [
                (op, self._persisted(op, outcome, changed, journaled)) for op, outcome in outcomes
            ]
        now = time.time()
        finished = []
        for op, outcome in outcomes:
            if isinstance(outcome, Exception):
                code = error_code(outcome)
                if code == OperationErrorCode.INTERNAL_ERROR:
                    log.error("operation %s (%s) failed", op.id, op.kind, exc_info=outcome)
                finished.append(
                    dataclasses.replace(
                        op,
                        status=OperationStatus.FAILED,
                        updated_at=now,
                        error_code=code,
                        error_message=_message(outcome),
                    )
                )
            else:
                finished.append(
                    dataclasses.replace(
                        op, status=OperationStatus.COMPLETED, updated_at=now, output=outcome
                    )
                )
        self.repo.put_operations(finished, keep_requests=journaled)
        for op, outcome in outcomes:
            self.metrics.operation_finished(op, is_failed=isinstance(outcome, Exception))

    def _persisted(
        self,
        op: OperationRecord,
        outcome: Outcome,
        changed: dict[str, tuple[str, ...]],
        journaled: set[str],
    ) -> Outcome:
        """The outcome once its state is durable; `op` joins `journaled` if its request is
        what keeps it (a full-weight session between snapshots)."""
        parts = changed.get(op.id, ())
        if isinstance(outcome, Exception) or not parts:
            return outcome
        assert self.durability is not None
        try:
            if self.durability.persist(op.session_id, parts, op, outcome):
                journaled.add(op.id)
        except Exception as exc:  # noqa: BLE001 - the operation fails with it, logged below
            return exc
        return outcome

    def fail_unfinished(self, operation_ids: list[str], exc: Exception) -> None:
        """Record `exc` on those of the operations that are still PENDING or RUNNING (a job
        that failed as a whole: some of its operations may have finished already)."""
        unfinished: list[tuple[OperationRecord, Outcome]] = []
        for operation_id in operation_ids:
            op = self.repo.get_operation(operation_id)
            if op is not None and op.status in (OperationStatus.PENDING, OperationStatus.RUNNING):
                unfinished.append((op, exc))
        self.finish(unfinished)
