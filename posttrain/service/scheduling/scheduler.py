"""Operations on the resource workers: one path from enqueue to finish for every kind.

An operation is queued on its resource's worker (service/scheduling/worker.py), which runs it as a
group of one or more: the kind's `sharing` (service/operations/kinds.py) says which operations may
share one engine pass. A group runs through `_run_group`: the pending/running preamble, memory
admission (service/scheduling/admission.py: what does not fit fails RESOURCE_EXHAUSTED before it
runs), the engine pass or passes (each the kind's `run`, service/operations/kinds.py; a sample group
on the trainer's lane of an engine that offers a decode stream runs as a stream instead,
service/scheduling/sample_streams.py, which queued samples join and queued training interleaves),
the finish (service/operations/recording.py). What a group raises as a whole is caught by the
worker's one job boundary, which fails its unfinished operations through the same finish path.
Deferred weights-syncs complete through the publish mailbox (service/scheduling/publishing.py),
which finishes them through that path too.

Imports: store, engine.interface.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import cast

from posttrain.config import SchedulerConfig
from posttrain.engine.interface import Engine, LanedEngine
from posttrain.errors import SessionNotActive, WorkerDied
from posttrain.records import OperationRecord, SessionRecord
from posttrain.service.durability.checkpoints import CheckpointService
from posttrain.service.durability.durable_sessions import SessionDurability, changed_parts
from posttrain.service.durability.routed_experts import RoutedExpertsStore
from posttrain.service.metrics import OperationMetrics
from posttrain.service.operations.arrivals import Arrivals, end_current_arrival
from posttrain.service.operations.kinds import KINDS, Lane, Outcome, Ready
from posttrain.service.operations.progress import SampleProgress
from posttrain.service.operations.recording import OperationRecorder
from posttrain.service.scheduling.admission import plan_passes
from posttrain.service.scheduling.publishing import PublishMailbox, is_deferred
from posttrain.service.scheduling.sample_streams import StreamPass
from posttrain.service.scheduling.worker import (
    Job,
    OnFailure,
    QueuedOperation,
    ResourceWorker,
    Stream,
)
from posttrain.statuses import OperationStatus, SessionStatus
from posttrain.store.repo import Repo
from posttrain.types import OperationKind, OperationRequest, WeightsSyncRequest, WeightSyncType

log = logging.getLogger("posttrain.scheduler")


class Scheduler:
    def __init__(
        self,
        repo: Repo,
        engine: Engine,
        *,
        checkpoints: CheckpointService | None = None,
        arrivals: Arrivals | None = None,
        limits: SchedulerConfig | None = None,
        routed_experts: RoutedExpertsStore | None = None,
        durability: SessionDurability | None = None,
        progress: SampleProgress | None = None,
    ) -> None:
        self.repo = repo
        self.engine = engine
        # The tokens of running sample operations, for their watchers (sample_streams.py).
        self.progress = progress or SampleProgress()
        # Routes of sampled sequences behind their routed_experts_key
        # (service/durability/routed_experts.py).
        if routed_experts is None:  # not `or`: an empty store is falsy (it has a len)
            routed_experts = RoutedExpertsStore(ttl_s=3600, budget_bytes=0)
        self.routed_experts = routed_experts
        self.arrivals = arrivals or Arrivals()
        self.limits = limits or SchedulerConfig()
        self._resource_of_session: dict[str, str] = {}
        # None only where no checkpoint operation is ever submitted (tests with a fake engine).
        self.checkpoints = checkpoints
        self._workers: dict[str, ResourceWorker] = {}
        self._lock = threading.Lock()
        self.metrics = OperationMetrics()  # what /metrics reports (service/metrics.py)
        # Live LoRA session state on disk (service/durability/durable_sessions.py); None with a fake
        # engine.
        self.durability = durability
        # Set by build_services: reloads a resource whose worker process died and restores
        # its sessions (SessionService.recover_worker).
        self.on_worker_lost: Callable[[str], None] | None = None
        self.recorder = OperationRecorder(repo, self.metrics, durability)
        # Deferred weights-syncs (service/scheduling/publishing.py); the enqueue lock keeps the
        # mailbox's ticket order equal to the FIFO order.
        self.mailbox = PublishMailbox(repo, engine, self.recorder)
        self._enqueue_lock = threading.Lock()

    def worker(self, resource_id: str) -> ResourceWorker:
        with self._lock:
            if resource_id not in self._workers:
                self._workers[resource_id] = ResourceWorker(
                    f"worker-{resource_id}",
                    lambda group: self._run_group(resource_id, group),
                    lambda group, exc: self._fail_group(resource_id, group, exc),
                    max_batch=self.limits.max_batch,
                    max_sample_rows=self.limits.max_sample_rows,
                    arriving=lambda: self._arriving(resource_id),
                    gather_s=self.limits.sample_gather_s,
                    generator_lanes=lambda: self.engine.generator_lanes(resource_id),
                    fence=lambda: self.engine.generator_fence(resource_id),
                    wake_lanes=lambda: cast(LanedEngine, self.engine).wake_lanes(resource_id),
                )
            return self._workers[resource_id]

    def _arriving(self, resource_id: str) -> int:
        """Sample submissions being received for sessions of this resource; a session never
        queued before counts for every resource (its resource is not known here yet)."""
        resource_of = self._resource_of_session
        return self.arrivals.count(lambda sid: resource_of.get(sid, resource_id) == resource_id)

    def run_job(
        self, resource_id: str, job: Callable[[], object], on_failure: OnFailure | None = None
    ) -> Future[object]:
        """Run a non-operation job (load, session setup, teardown) in the resource's order.
        With `on_failure`, a failure is recorded by it and the future just finishes; without,
        the future carries the exception."""
        return self.worker(resource_id).submit(Job(job, on_failure))

    def queue_depth(self) -> int:
        with self._lock:
            return sum(worker.depth() for worker in self._workers.values())

    def busy_seconds(self) -> dict[str, float]:
        """Per resource, seconds its worker spent running jobs since the server started."""
        with self._lock:
            return {rid: worker.busy_seconds() for rid, worker in self._workers.items()}

    def enqueue(self, resource_id: str, operation_id: str, request: OperationRequest) -> None:
        op = self.repo.get_operation(operation_id)
        assert op is not None, f"operation {operation_id} was not recorded before enqueue"
        worker = self.worker(resource_id)
        self._resource_of_session[op.session_id] = resource_id
        with self._enqueue_lock:
            if is_deferred(op.kind, request):
                assert isinstance(request, WeightsSyncRequest)
                self.mailbox.post(resource_id, op, request.weight_sync_type)
                # Between the decode blocks of a sample stream, a PIPELINE publish may switch
                # running rows; a BACKGROUND one waits until no row of its session decodes.
                pipeline = request.weight_sync_type == WeightSyncType.PIPELINE
                session_id = op.session_id
                worker.submit(
                    Job(
                        lambda: self.mailbox.publish_at_place(resource_id, operation_id),
                        lambda exc: self.mailbox.fail(resource_id, operation_id, exc),
                        lambda decoding: pipeline or session_id not in decoding,
                        session_id,
                    )
                )
                return
            ticket = self.mailbox.admit(op)

            def done() -> None:
                if ticket is not None:
                    self.mailbox.release(resource_id, ticket)

            worker.submit_operation(
                QueuedOperation(op.kind, op.session_id, operation_id, request, done)
            )
        end_current_arrival()

    def close(self) -> None:
        with self._lock:
            for worker in self._workers.values():
                worker.close()

    # ------------------------------------------------------------ the one operation path

    def _run_group(self, resource_id: str, group: list[QueuedOperation]) -> Stream | None:
        """Operations of one kind in one engine pass (a group of one for most kinds), or in
        consecutive passes where memory admission splits it; each completes or fails on its
        own, and each pass is recorded before the next runs. A sample group that runs as a
        stream comes back as the stream, which the worker drives to its end."""
        ready = self.start(group)
        if not ready:
            return None
        kind = group[0].kind
        passes, refused = plan_passes(
            kind,
            ready,
            lambda members: self.engine.peak_bytes(
                resource_id, kind, [(session.id, request) for _, session, request in members]
            ),
            self.engine.headroom(resource_id, kind),
        )
        self.recorder.finish([(ready[i][0], error) for i, error in refused.items()])
        # A generator lane's group: one fence, one lane (service/scheduling/worker.py).
        index = group[0].lane
        lane = None if index is None else Lane(index, max(item.fence for item in group))
        if kind == OperationKind.SAMPLE and passes:
            # A stream where the engine offers one (service/scheduling/sample_streams.py): on the
            # trainer's lane, or on a generator lane's generator as of the group's fence.
            session_id = passes[0][0][1].id
            if lane is None:
                stream = self.engine.sample_stream(resource_id, session_id)
            else:
                laned = cast(LanedEngine, self.engine)
                stream = laned.lane_stream(
                    resource_id, session_id, fence=lane.fence, lane=lane.index
                )
            if stream is not None:
                return StreamPass(self, resource_id, stream, group, lane).blocks(passes)
        for members in passes:
            self._run_pass(resource_id, kind, members, lane)
        return None

    def _run_pass(
        self, resource_id: str, kind: OperationKind, ready: list[Ready], lane: Lane | None
    ) -> None:
        """One engine pass over the members (the kind's `run`, service/operations/kinds.py); per
        member an output or an error, each recorded."""
        started = time.monotonic()
        outcomes = KINDS[kind].run(self, resource_id, ready, lane)
        if len(ready) > 1:
            self.metrics.shared_pass(len(ready))
        log.debug(
            "%d %s operations in one pass, %.3fs", len(ready), kind, time.monotonic() - started
        )
        for (op, _, request), outcome in zip(ready, outcomes, strict=True):
            if not isinstance(outcome, Exception):
                self.metrics.count_tokens(op.kind, request, outcome)
        self.recorder.finish(
            [(op, outcome) for (op, _, _), outcome in zip(ready, outcomes, strict=True)],
            {op.id: changed_parts(op.kind, request) for op, _, request in ready},
        )

    def start(self, group: list[QueuedOperation]) -> list[Ready]:
        """The preamble: skip what is no longer PENDING, fail what belongs to a session that
        is not RUNNING, and mark the rest RUNNING in one store transaction."""
        ready: list[Ready] = []
        stopped: list[tuple[OperationRecord, Outcome]] = []
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
                stopped.append((op, SessionNotActive(f"session {session.id} is {session.status}")))
                continue
            ready.append((op, session, item.request))
        self.recorder.finish(stopped)
        running = self.recorder.start([op for op, _, _ in ready])
        return [(op, s, r) for op, (_, s, r) in zip(running, ready, strict=True)]

    def _fail_group(self, resource_id: str, group: list[QueuedOperation], exc: Exception) -> None:
        self.recorder.fail_unfinished([item.operation_id for item in group], exc)
        if isinstance(exc, WorkerDied) and self.on_worker_lost is not None:
            # On this worker thread, before the next queued operation: it finds its session
            # restored, not a dead process (engine/hosts/process/worker.py). Between a stream's
            # blocks not yet: the stream's next call fails on the same dead host, and its
            # group's failure restores every session once (now would restore the sessions
            # it decodes under it, and again after it).
            if not self.worker(resource_id).between_blocks_of_a_stream():
                self.on_worker_lost(resource_id)
