"""The worker loop: one thread per model resource runs that resource's jobs in arrival order.

Operations of a session therefore execute in submission order, and barriers (optim-step,
weights-sync) hold trivially. Compute never runs on the asyncio loop: handlers enqueue and
return, and polls read the store. This is the one place with a broad `except`: an operation
that fails is recorded FAILED with a code and the worker moves on.

Imports: store, engine.interface.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from posttrain.engine.interface import Engine
from posttrain.errors import SessionNotActive, operation_error_code, posttrainError
from posttrain.service.arrivals import Arrivals, end_current_arrival
from posttrain.service.checkpoints import CheckpointService
from posttrain.service.metrics import OperationMetrics
from posttrain.service.publishing import PublishMailbox, is_deferred
from posttrain.store.repo import Repo
from posttrain.types import (
    CheckpointType,
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    OperationErrorCode,
    OperationKind,
    OperationRecord,
    OperationStatus,
    OptimStepRequest,
    PolicyState,
    SampleRequest,
    SessionRecord,
    SessionStatus,
    WeightsSyncRequest,
)

log = logging.getLogger("posttrain.scheduler")

Job = Callable[[], Any]

# How long no sample submission must have been arriving before a waiting sample pass starts.
ARRIVAL_LULL_S = 0.005


@dataclass(frozen=True)
class Batchable:
    """A queued operation that may share one engine pass with other queued operations."""

    kind: OperationKind
    session_id: str
    operation_id: str
    request: Any
    done: Callable[[], None]  # runs after the operation finished, batched or not
    rows: int = 1  # sequences a sample operation generates (prompts x num_samples)


@dataclass
class _Item:
    job: Job
    future: Future
    batchable: Batchable | None = None


class ResourceWorker:
    """A thread that runs one resource's jobs one at a time, first in, first out.

    When the job at the head is a batchable operation, the worker also takes the next queued
    operations of the same kind, provided no plain job (a barrier: optim-step, weights-sync,
    checkpoint, session setup or teardown) stands in between and nothing of their session that
    stays queued comes before them, so each session's order holds, and runs them together with
    `run_batch`. Forward-backwards share a pass only across sessions (at most `max_batch`
    operations); sample operations of one session share it too, since sampling changes no
    state, up to `max_sample_rows` sequences in all."""

    def __init__(
        self,
        name: str,
        run_batch: Callable[[list[Batchable]], None] | None = None,
        *,
        max_batch: int = 8,
        max_sample_rows: int = 256,
        arriving: Callable[[], int] = int,
        gather_s: float = 0.0,
    ) -> None:
        self._items: deque[_Item | None] = deque()
        self._ready = threading.Condition()
        self._run_batch = run_batch
        self._max_batch = max_batch
        self._max_sample_rows = max_sample_rows
        # Sample POSTs of this resource's sessions still being received (service/arrivals.py),
        # and how long a sample pass waits for them at most.
        self._arriving = arriving
        self._gather_s = gather_s
        self._busy_s = 0.0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job, batchable: Batchable | None = None) -> Future:
        future: Future = Future()
        with self._ready:
            self._items.append(_Item(job, future, batchable))
            self._ready.notify()
        return future

    def depth(self) -> int:
        with self._ready:
            return len(self._items)

    def busy_seconds(self) -> float:
        """Seconds this worker spent running jobs (the engine's busy time, for /metrics)."""
        with self._ready:
            return self._busy_s

    def close(self) -> None:
        with self._ready:
            self._items.append(None)
            self._ready.notify()

    def _fits(self, head: Batchable, mates: list[_Item], candidate: Batchable) -> bool:
        if candidate.kind != head.kind:
            return False
        if head.kind != OperationKind.SAMPLE:
            return len(mates) + 1 < self._max_batch
        rows = head.rows + sum(item.batchable.rows for item in mates)  # type: ignore[union-attr]
        return rows + candidate.rows <= self._max_sample_rows

    def _take_batch_mates(self, head: Batchable) -> list[_Item]:
        """Caller holds the lock. Removes and returns the head's batch mates from the queue."""
        mates: list[_Item] = []
        # A session is blocked once one of its operations stays queued: nothing of it may
        # overtake that one. Forward-backwards of the head's own session stay behind it.
        blocked = set() if head.kind == OperationKind.SAMPLE else {head.session_id}
        for item in list(self._items):
            if item is None or item.batchable is None:
                break
            candidate = item.batchable
            if candidate.session_id not in blocked and self._fits(head, mates, candidate):
                mates.append(item)
                self._items.remove(item)
                if head.kind == OperationKind.SAMPLE:
                    continue
            blocked.add(candidate.session_id)
        return mates

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._items:
                    self._ready.wait()
                head = self._items.popleft()
                if head is None:
                    return
                mates = []
                if head.batchable is not None and self._run_batch is not None:
                    if head.batchable.kind == OperationKind.SAMPLE:
                        self._await_arrivals()
                    mates = self._take_batch_mates(head.batchable)
            started = time.monotonic()
            try:
                self._run(head, mates)
            finally:
                with self._ready:
                    self._busy_s += time.monotonic() - started

    def _await_arrivals(self) -> None:
        """Caller holds the lock. While sample submissions are arriving, wait (up to gather_s)
        until none has been for ARRIVAL_LULL_S: a burst's POSTs reach the server over several
        connections, and the count can touch zero between two of them. The short re-check
        interval also catches a submission that ended without queueing (a 400). A loop that
        submits one operation at a time finds nothing arriving and never waits."""
        if self._arriving() == 0:
            return
        now = time.monotonic()
        deadline, quiet_since = now + self._gather_s, None
        while (now := time.monotonic()) < deadline:
            if self._arriving() > 0:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= ARRIVAL_LULL_S:
                return
            self._ready.wait(min(deadline - now, 0.001))

    def _run(self, head: _Item, mates: list[_Item]) -> None:
        if not mates:
            try:
                head.future.set_result(head.job())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                head.future.set_exception(exc)
            return
        group = [head, *mates]
        assert self._run_batch is not None
        try:
            self._run_batch([item.batchable for item in group])  # type: ignore[misc]
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            for item in group:
                item.future.set_exception(exc)
        else:
            for item in group:
                item.future.set_result(None)


def _error_code(exc: BaseException) -> OperationErrorCode:
    return OperationErrorCode(operation_error_code(exc))


class Scheduler:
    def __init__(
        self,
        repo: Repo,
        engine: Engine,
        *,
        checkpoints: CheckpointService | None = None,
        arrivals: Arrivals | None = None,
        sample_gather_s: float = 0.5,
    ) -> None:
        self.repo = repo
        self.engine = engine
        self.arrivals = arrivals or Arrivals()
        self.sample_gather_s = sample_gather_s
        self._resource_of_session: dict[str, str] = {}
        # None only where no checkpoint operation is ever submitted (tests with a fake engine).
        self.checkpoints = checkpoints
        self._workers: dict[str, ResourceWorker] = {}
        self._lock = threading.Lock()
        self.metrics = OperationMetrics()  # what /metrics reports (service/metrics.py)
        # Deferred weights-syncs (service/publishing.py); the enqueue lock keeps the mailbox's
        # ticket order equal to the FIFO order.
        self.mailbox = PublishMailbox(repo, engine)
        self._enqueue_lock = threading.Lock()
        self._runners: dict[OperationKind, Callable[[SessionRecord, Any], dict]] = {
            OperationKind.FORWARD_BACKWARD: self._forward_backward,
            OperationKind.CUSTOM_FORWARD_BACKWARD: self._custom_forward_backward,
            OperationKind.OPTIM_STEP: self._optim_step,
            OperationKind.WEIGHTS_SYNC: self._weights_sync,
            OperationKind.SAMPLE: self._sample,
            OperationKind.TRAINING_CHECKPOINT: self._training_checkpoint,
            OperationKind.INFERENCE_CHECKPOINT: self._inference_checkpoint,
        }

    def worker(self, resource_id: str) -> ResourceWorker:
        with self._lock:
            if resource_id not in self._workers:
                self._workers[resource_id] = ResourceWorker(
                    f"worker-{resource_id}",
                    lambda group, rid=resource_id: self._execute_batch(rid, group),
                    arriving=lambda rid=resource_id: self._arriving(rid),
                    gather_s=self.sample_gather_s,
                )
            return self._workers[resource_id]

    def _arriving(self, resource_id: str) -> int:
        """Sample submissions being received for sessions of this resource; a session never
        queued before counts for every resource (its resource is not known here yet)."""
        resource_of = self._resource_of_session
        return self.arrivals.count(lambda sid: resource_of.get(sid, resource_id) == resource_id)

    def run_job(self, resource_id: str, job: Job) -> Future:
        """Run a non-operation job (load, session setup, teardown) in the resource's order."""
        return self.worker(resource_id).submit(job)

    def queue_depth(self) -> int:
        with self._lock:
            return sum(worker.depth() for worker in self._workers.values())

    def busy_seconds(self) -> dict[str, float]:
        """Per resource, seconds its worker spent running jobs since the server started."""
        with self._lock:
            return {rid: worker.busy_seconds() for rid, worker in self._workers.items()}

    def enqueue(self, resource_id: str, operation_id: str, request: Any) -> None:
        op = self.repo.get_operation(operation_id)
        assert op is not None, f"operation {operation_id} was not recorded before enqueue"
        worker = self.worker(resource_id)
        self._resource_of_session[op.session_id] = resource_id
        with self._enqueue_lock:
            if is_deferred(op.kind, request):
                self.mailbox.post(resource_id, op, request.weight_sync_type)
                worker.submit(lambda: self._deferred_weights_sync(resource_id, operation_id))
                return
            ticket = self.mailbox.admit(op)

            def done() -> None:
                if ticket is not None:
                    self.mailbox.release(resource_id, ticket)

            def job() -> None:
                try:
                    self._execute(operation_id, request)
                finally:
                    done()

            batchable = None
            if op.kind == OperationKind.FORWARD_BACKWARD:
                batchable = Batchable(op.kind, op.session_id, operation_id, request, done)
            elif op.kind == OperationKind.SAMPLE:
                rows = len(request.prompts) * request.num_samples
                batchable = Batchable(op.kind, op.session_id, operation_id, request, done, rows)
            worker.submit(job, batchable)
        end_current_arrival()

    def close(self) -> None:
        with self._lock:
            for worker in self._workers.values():
                worker.close()

    # ------------------------------------------------------------ the operation boundary

    def _execute(self, operation_id: str, request: Any) -> None:
        op = self.repo.get_operation(operation_id)
        assert op is not None, f"queued operation {operation_id} vanished from the store"
        if op.status != OperationStatus.PENDING:
            return
        session = self.repo.get_session(op.session_id)
        assert session is not None, f"operation {operation_id} has no session"
        if session.status != SessionStatus.RUNNING:
            self._finish(op, error=SessionNotActive(f"session {session.id} is {session.status}"))
            return
        op = self._set(op, status=OperationStatus.RUNNING)
        started = time.monotonic()
        try:
            output = self._runners[op.kind](session, request)
        except Exception as exc:  # noqa: BLE001 - the one operation boundary (STYLE.md 6)
            if _error_code(exc) == OperationErrorCode.INTERNAL_ERROR:
                log.exception("operation %s (%s) failed", op.id, op.kind)
            self._finish(op, error=exc)
            return
        log.info("operation %s (%s) done in %.3fs", op.id, op.kind, time.monotonic() - started)
        self.metrics.count_tokens(op.kind, request, output)
        self._finish(op, output=output)

    def _execute_batch(self, resource_id: str, group: list[Batchable]) -> None:
        """Operations of one kind in one shared engine pass (forward-backwards of several
        sessions, or sample operations of any sessions); each completes or fails on its own."""
        try:
            ready: list[tuple[OperationRecord, Batchable]] = []
            stopped: list[tuple[OperationRecord, BaseException]] = []
            sessions: dict[str, SessionRecord | None] = {}
            for item in group:
                op = self.repo.get_operation(item.operation_id)
                assert op is not None, f"queued operation {item.operation_id} vanished"
                if op.status != OperationStatus.PENDING:
                    continue
                if op.session_id not in sessions:
                    sessions[op.session_id] = self.repo.get_session(op.session_id)
                session = sessions[op.session_id]
                assert session is not None, f"operation {op.id} has no session"
                if session.status != SessionStatus.RUNNING:
                    error = SessionNotActive(f"session {session.id} is {session.status}")
                    stopped.append((op, error))
                    continue
                ready.append((op, item))
            self._finish_all(stopped)
            if not ready:
                return
            # One store transaction marks the group RUNNING, and one records its outcomes.
            now = time.time()
            ready = [
                (dataclasses.replace(op, status=OperationStatus.RUNNING, updated_at=now), item)
                for op, item in ready
            ]
            self.repo.put_operations([op for op, _ in ready])
            started = time.monotonic()
            kind = group[0].kind
            try:
                outcomes = self._shared_pass(resource_id, kind, [item for _, item in ready])
            except Exception as exc:  # noqa: BLE001 - the operation boundary, for the group
                log.exception("shared %s pass failed", kind)
                self._finish_all([(op, exc) for op, _ in ready])
                return
            if len(ready) > 1:
                self.metrics.shared_pass(len(ready))
            log.info(
                "%d %s operations in one pass, %.3fs", len(ready), kind, time.monotonic() - started
            )
            for (op, item), outcome in zip(ready, outcomes, strict=True):
                if not isinstance(outcome, Exception):
                    self.metrics.count_tokens(op.kind, item.request, outcome)
            self._finish_all(
                [(op, outcome) for (op, _), outcome in zip(ready, outcomes, strict=True)]
            )
        finally:
            for item in group:
                item.done()

    def _shared_pass(
        self, resource_id: str, kind: OperationKind, items: list[Batchable]
    ) -> list[dict | Exception]:
        """One engine pass over several sessions' operations; per item an output or an error."""
        pairs = [(item.session_id, item.request) for item in items]
        if kind == OperationKind.FORWARD_BACKWARD:
            return [
                outcome if isinstance(outcome, Exception) else dataclasses.asdict(outcome)
                for outcome in self.engine.forward_backward_batch(resource_id, pairs)
            ]
        assert kind == OperationKind.SAMPLE, f"{kind} operations are not batched"
        results = self.engine.sample_batch(
            resource_id,
            pairs,
            between_tokens=lambda: self.mailbox.publish_in_flight(resource_id),
        )
        return [{"results": [dataclasses.asdict(r) for r in per_op]} for per_op in results]

    def _set(self, op: OperationRecord, **changes: Any) -> OperationRecord:
        updated = dataclasses.replace(op, updated_at=time.time(), **changes)
        self.repo.put_operation(updated)
        return updated

    def _finish(
        self, op: OperationRecord, *, output: dict | None = None, error: BaseException | None = None
    ) -> None:
        self._finish_all([(op, output if error is None else error)])

    def _finish_all(
        self, outcomes: list[tuple[OperationRecord, dict | None | BaseException]]
    ) -> None:
        """Record each operation COMPLETED with its output or FAILED with its error's code, in
        one store transaction."""
        if not outcomes:
            return
        now = time.time()
        finished = []
        for op, outcome in outcomes:
            if isinstance(outcome, BaseException):
                message = (
                    outcome.message
                    if isinstance(outcome, posttrainError)
                    else f"{type(outcome).__name__}: {outcome}"
                )
                finished.append(
                    dataclasses.replace(
                        op,
                        status=OperationStatus.FAILED,
                        updated_at=now,
                        error_code=_error_code(outcome),
                        error_message=message,
                    )
                )
            else:
                finished.append(
                    dataclasses.replace(
                        op, status=OperationStatus.COMPLETED, updated_at=now, output=outcome
                    )
                )
        self.repo.put_operations(finished)
        for op, outcome in outcomes:
            self.metrics.operation_finished(op, is_failed=isinstance(outcome, BaseException))

    # ------------------------------------------------------------ one runner per kind

    def _forward_backward(self, session: SessionRecord, request: ForwardBackwardRequest) -> dict:
        items = [(session.id, request)]
        (outcome,) = self.engine.forward_backward_batch(session.resource_id, items)
        if isinstance(outcome, Exception):
            raise outcome
        return dataclasses.asdict(outcome)

    def _custom_forward_backward(
        self, session: SessionRecord, request: CustomForwardBackwardRequest
    ) -> dict:
        self.engine.custom_forward_backward(session.resource_id, session.id, request)
        return {}

    def _optim_step(self, session: SessionRecord, request: OptimStepRequest) -> dict:
        self.engine.optim_step(session.resource_id, session.id, request)

        def advance(s: SessionRecord) -> SessionRecord:
            policy = dataclasses.replace(
                s.policy_state, trainer_step=s.policy_state.trainer_step + 1
            )
            return dataclasses.replace(
                s, step=s.step + 1, policy_state=policy, updated_at=time.time()
            )

        updated = self.repo.update_session(session.id, advance)
        return {"step": updated.step}

    def _weights_sync(self, session: SessionRecord, request: WeightsSyncRequest) -> dict:
        # SYNCHRONOUS: publish at this operation's place in the FIFO, and complete once the
        # generator serves it. The deferred modes never get here (_deferred_weights_sync).
        self.engine.publish(
            session.resource_id, session.id, version=session.policy_state.trainer_step
        )

        def publish(s: SessionRecord) -> SessionRecord:
            version = s.policy_state.trainer_step
            policy = PolicyState(
                trainer_step=version,
                target_weights_version=version,
                applied_weights_version=version,
                pending_publish=False,
            )
            return dataclasses.replace(s, policy_state=policy, updated_at=time.time())

        updated = self.repo.update_session(session.id, publish)
        return {"weights_version": updated.policy_state.applied_weights_version}

    def _training_checkpoint(self, session: SessionRecord, request: None) -> dict:
        assert self.checkpoints is not None, "scheduler built without a CheckpointService"
        return self.checkpoints.save(session, CheckpointType.TRAINING)

    def _inference_checkpoint(self, session: SessionRecord, request: None) -> dict:
        assert self.checkpoints is not None, "scheduler built without a CheckpointService"
        return self.checkpoints.save(session, CheckpointType.INFERENCE)

    def _sample(self, session: SessionRecord, request: SampleRequest) -> dict:
        # Between tokens, PIPELINE weights-syncs submitted meanwhile publish in flight.
        resource_id = session.resource_id
        (results,) = self.engine.sample_batch(
            resource_id,
            [(session.id, request)],
            between_tokens=lambda: self.mailbox.publish_in_flight(resource_id),
        )
        return {"results": [dataclasses.asdict(r) for r in results]}

    def _deferred_weights_sync(self, resource_id: str, operation_id: str) -> None:
        """A BACKGROUND_PUBLISH or PIPELINE weights-sync at its FIFO place: publish now unless a
        decode loop already did (service/publishing.py)."""
        op = self.repo.get_operation(operation_id)
        assert op is not None, f"queued operation {operation_id} vanished from the store"
        session = self.repo.get_session(op.session_id)
        assert session is not None, f"operation {operation_id} has no session"
        if session.status != SessionStatus.RUNNING:
            self.mailbox.discard(resource_id, operation_id)
            if op.status == OperationStatus.PENDING:
                stopped = SessionNotActive(f"session {session.id} is {session.status}")
                self._finish(op, error=stopped)
            return
        try:
            self.mailbox.publish_in_order(resource_id, operation_id)
        except Exception as exc:  # noqa: BLE001 - the operation boundary (STYLE.md 6)
            log.exception("weights-sync %s failed to publish", operation_id)
            self.mailbox.discard(resource_id, operation_id)
            op = self.repo.get_operation(operation_id)
            if op is not None and op.status == OperationStatus.PENDING:
                self._finish(op, error=exc)
