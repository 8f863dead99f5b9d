"""The worker loop: one thread per model resource runs that resource's jobs in arrival order.

Operations of a session therefore execute in submission order, and barriers (optim-step,
weights-sync) hold trivially. Compute never runs on the asyncio loop: handlers enqueue and
return, and polls read the store.

This is the one job boundary: the only place that catches what a job raises. A job comes with
the recorder of its failure (a lifecycle job marks its resource or session ERROR, an operation
group its operations FAILED with a code); the worker hands the exception to it and moves on,
and whoever waits on the job's future sees it finished without catching anything.

A sample group that runs as a stream (service/scheduling/sample_streams.py) comes back from the
group runner as a generator that yields at each decode block boundary; the worker drives it
(`_drive`): at each boundary it walks its queue once, runs what may run between blocks as groups
of their own and sends the stream the samples that join, then resumes it. Nothing re-enters the
worker: a group runs only from the loop or from the driver, never inside another group's run.

Imports: types.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass

from posttrain.service.operations.kinds import KINDS, Sharing
from posttrain.types import OperationKind, OperationRequest, SampleRequest

log = logging.getLogger("posttrain.scheduler")

# How long no sample submission must have been arriving before a waiting sample pass starts.
ARRIVAL_LULL_S = 0.005

OnFailure = Callable[[Exception], None]


@dataclass(frozen=True)
class Job:
    """A lifecycle job (load, session setup, teardown, expiry, a deferred publish)."""

    run: Callable[[], object]  # its result is the job's future's; no caller reads it
    # Records the failure where the caller looks for it; None: the future carries it instead.
    on_failure: OnFailure | None = None
    # Given the sessions whose rows decode in a running sample stream, whether the job may run
    # at a decode block boundary (`between_blocks`); None: never, it is a barrier there too.
    # `session_id`: the session whose order it keeps there.
    between_blocks: Callable[[set[str]], bool] | None = None
    session_id: str | None = None


@dataclass(frozen=True)
class QueuedOperation:
    """A queued operation; forward-backwards and samples may share one engine pass."""

    kind: OperationKind
    session_id: str
    operation_id: str
    request: OperationRequest
    done: Callable[[], None] = lambda: None  # runs once the operation finished
    # A sample handed to a generator lane: what the generators serve as of its FIFO place
    # (Engine.generator_fence); 0 on the trainer's lane.
    fence: int = 0
    lane: int | None = None  # the generator lane that runs it; None: the trainer's lane

    @property
    def rows(self) -> int:
        """Sequences a sample operation generates (prompts x num_samples); 1 for the others."""
        if isinstance(self.request, SampleRequest):
            return len(self.request.prompts) * self.request.num_samples
        return 1


@dataclass(frozen=True)
class Boundary:
    """A running sample stream at a decode block boundary, as the queue walk needs it."""

    decoding: set[str]  # sessions with an operation in the stream; a joining one's is added
    may_join: Callable[[QueuedOperation], bool]  # whether a queued sample fits (and counts it)


# A sample stream (StreamPass.blocks): yields at each decode block boundary, is sent the samples
# that join there, and returns once no row decodes.
Stream = Generator[Boundary, list[QueuedOperation], None]


@dataclass
class _Item:
    future: Future[object]
    job: Job | None = None
    operation: QueuedOperation | None = None


class _Driving(threading.local):
    """Per thread (the trainer's lane and each generator lane), the group of the sample stream
    it drives, which the samples joining at a boundary become members of; None between
    streams (threading.local runs __init__ once per thread)."""

    def __init__(self) -> None:
        self.group: list[_Item] | None = None


class ResourceWorker:
    """A thread that runs one resource's jobs one at a time, first in, first out.

    Every operation runs as a group through `run_group`. When the operation at the head is a
    forward-backward or a sample, the worker also takes the next queued operations of the same
    kind, provided no job or other operation (a barrier: optim-step, weights-sync, checkpoint,
    session setup or teardown) stands in between and nothing of their session that stays queued
    comes before them, so each session's order holds. Forward-backwards share a pass only across
    sessions (at most `max_batch` operations); sample operations of one session share it too,
    since sampling changes no state, up to `max_sample_rows` sequences in all. When a group
    raises, `fail_group` records the error on its unfinished operations."""

    def __init__(
        self,
        name: str,
        run_group: Callable[[list[QueuedOperation]], Stream | None],
        fail_group: Callable[[list[QueuedOperation], Exception], None],
        *,
        max_batch: int = 8,
        max_sample_rows: int = 256,
        arriving: Callable[[], int] = int,
        gather_s: float = 0.0,
        generator_lanes: Callable[[], int] = int,
        fence: Callable[[], int] = int,
        wake_lanes: Callable[[], None] = lambda: None,
    ) -> None:
        self._items: deque[_Item | None] = deque()
        self._ready = threading.Condition()
        self._run_group = run_group
        self._fail_group = fail_group
        self._max_batch = max_batch
        self._max_sample_rows = max_sample_rows
        # Sample POSTs of this resource's sessions still being received
        # (service/operations/arrivals.py), and how long a sample pass waits for them at most.
        self._arriving = arriving
        self._gather_s = gather_s
        self._busy_s = 0.0
        # Where the generators run apart from the trainer (engine/hosts/replicas/engine.py), samples
        # leave this queue at their FIFO place for the generator lanes (one per generator), and the
        # trainer's operations go on meanwhile.
        self._generator_lanes = generator_lanes
        self._fence = fence
        # Tells lane streams running several blocks a call that a sample waits (lane_joins).
        self._wake_lanes = wake_lanes
        self._samples: deque[_Item | None] = deque()
        self._lanes: list[threading.Thread] = []
        self._local = _Driving()
        self._name = name
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Future[object]:
        return self._append(_Item(Future(), job=job))

    def submit_operation(self, operation: QueuedOperation) -> Future[object]:
        return self._append(_Item(Future(), operation=operation))

    def _append(self, item: _Item) -> Future[object]:
        with self._ready:
            self._items.append(item)
            self._ready.notify_all()  # the trainer's lane and the generator lanes wait here
        return item.future

    def depth(self) -> int:
        with self._ready:
            return len(self._items) + len(self._samples)

    def busy_seconds(self) -> float:
        """Seconds this worker spent running jobs (the engine's busy time, for /metrics)."""
        with self._ready:
            return self._busy_s

    def close(self) -> None:
        with self._ready:
            self._items.append(None)
            self._samples.extend(None for _ in self._lanes)
            self._ready.notify_all()

    def _fits(self, head: QueuedOperation, mates: list[_Item], candidate: QueuedOperation) -> bool:
        if candidate.kind != head.kind:
            return False
        if KINDS[head.kind].sharing != Sharing.ANY:
            return len(mates) + 1 < self._max_batch
        rows = head.rows + sum(item.operation.rows for item in mates if item.operation)
        return rows + candidate.rows <= self._max_sample_rows

    def _take_batch_mates(
        self, head: QueuedOperation, held: frozenset[str] = frozenset()
    ) -> list[_Item]:
        """Caller holds the lock. Removes and returns the head's batch mates from the queue;
        none of the sessions `held`."""
        sharing = KINDS[head.kind].sharing
        if sharing == Sharing.ALONE:
            return []
        mates: list[_Item] = []
        # A session is blocked once one of its operations stays queued: nothing of it may
        # overtake that one. Forward-backwards of the head's own session stay behind it.
        blocked = set(held) if sharing == Sharing.ANY else {head.session_id, *held}
        for item in list(self._items):
            if item is None or item.operation is None:
                break
            candidate = item.operation
            if KINDS[candidate.kind].sharing == Sharing.ALONE:
                break  # a barrier
            if candidate.session_id not in blocked and self._fits(head, mates, candidate):
                mates.append(item)
                self._items.remove(item)
                if sharing == Sharing.ANY:
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
                group = [head]
                sample = head.operation is not None and KINDS[head.operation.kind].on_generator
            if sample and self._hand_off(head):
                continue
            with self._ready:
                if head.operation is not None:
                    if sample:
                        self._await_arrivals()
                    group += self._take_batch_mates(head.operation)
            started = time.monotonic()
            try:
                self._execute(group, lane=False)
            finally:
                with self._ready:
                    self._busy_s += time.monotonic() - started

    def _hand_off(self, head: _Item) -> bool:
        """Trainer's lane, a sample at the head: give it, with its fence, to the generator
        lanes if the generators run apart; False: it runs here."""
        lanes = self._generator_lanes()
        if lanes == 0:
            return False
        assert head.operation is not None
        operation = dataclasses.replace(head.operation, fence=self._fence())
        with self._ready:
            while len(self._lanes) < lanes:
                lane = threading.Thread(
                    target=self._sample_lane,
                    args=(len(self._lanes),),
                    name=f"{self._name}-generator{len(self._lanes)}",
                    daemon=True,
                )
                self._lanes.append(lane)
                lane.start()
            self._samples.append(_Item(head.future, operation=operation))
            self._ready.notify_all()
        self._wake_lanes()  # a free lane takes it; else a busy lane's stream may join it
        return True

    def _sample_lane(self, lane: int) -> None:
        """Generator lane `lane`: one generation at a time on its generator, of the samples
        handed off, in their order, sharing a pass with those of the same fence (later ones
        may need other weights)."""
        while True:
            with self._ready:
                while not self._samples:
                    self._ready.wait()
                head = self._samples.popleft()
                if head is None:
                    return
                assert head.operation is not None
                self._await_arrivals()
                group = [head]
                for item in list(self._samples):
                    if item is None or item.operation is None:
                        break
                    if item.operation.fence == head.operation.fence and self._fits(
                        head.operation, group[1:], item.operation
                    ):
                        group.append(item)
                        self._samples.remove(item)
            for item in group:
                assert item.operation is not None
                item.operation = dataclasses.replace(item.operation, lane=lane)
            self._execute(group, lane=True)

    def between_blocks_of_a_stream(self) -> bool:
        """Whether this thread drives a sample stream (what fails now runs between its
        blocks)."""
        return self._local.group is not None

    def between_blocks(
        self, decoding: set[str], may_join: Callable[[QueuedOperation], bool]
    ) -> list[QueuedOperation]:
        """At a decode block boundary of the sample stream this thread runs (its group is the
        innermost running one): go through the queue in FIFO order once, run what may run
        between blocks, and take the samples that join the stream, which become members of the
        stream's group (their futures finish with it). Returns those samples, in order.

        - A sample joins while `may_join` says it fits (same model, rows, memory); the first
          that does not stops every later sample from joining (FIFO among samples: a large
          operation is not overtaken by a stream of small ones; it joins once there is room,
          or starts the next generation).
        - A kind marked `between_blocks` of a session with no row decoding runs now with its
          batch mates, as it would at its queue place (another session's training waits one
          block, not a generation).
        - An operation that may not run now blocks its session (nothing of it is taken after
          it), and one that runs alone (a barrier) or a job that may not run ends the pass:
          nothing overtakes a barrier.
        `decoding`: sessions with rows in the stream; a joining sample's session is added."""
        group = self._local.group
        assert group is not None, "called at a boundary of the stream this thread drives"
        joined: list[QueuedOperation] = []
        blocked: set[str] = set()
        joining = True
        with self._ready:
            queued = list(self._items)
        for item in queued:
            with self._ready:
                if item is None:
                    break
                if not any(i is item for i in self._items):
                    continue  # taken as a batch mate meanwhile
                job, op = item.job, item.operation
                if job is not None:
                    if job.between_blocks is None or job.session_id in blocked:
                        break
                    if not job.between_blocks(decoding):
                        break
                    self._items.remove(item)
                    unit = [item]
                else:
                    assert op is not None
                    rules = KINDS[op.kind]
                    if rules.on_generator:
                        if op.session_id in blocked:
                            continue
                        if joining and may_join(op):
                            self._items.remove(item)
                            group.append(item)
                            joined.append(op)
                            decoding.add(op.session_id)
                        else:
                            joining = False
                            blocked.add(op.session_id)
                        continue
                    if (
                        op.session_id in blocked
                        or op.session_id in decoding
                        or not rules.between_blocks
                    ):
                        if rules.sharing == Sharing.ALONE:
                            break
                        blocked.add(op.session_id)
                        continue
                    self._items.remove(item)
                    unit = [item, *self._take_batch_mates(op, frozenset(decoding | blocked))]
            self._execute(unit, lane=False)
        return joined

    def lane_joins(self, may_join: Callable[[QueuedOperation], bool]) -> list[QueuedOperation]:
        """At a decode block boundary of the sample stream this generator lane runs (its group
        is the innermost running one): take the samples handed to the lanes that join it, in
        FIFO order, while `may_join` says they fit; the first that does not keeps every later
        one waiting (for a free lane, or this lane's next generation). A free lane waiting on
        the queue takes a sample first, so a stream takes one only while every lane is busy.
        Nothing else runs on a lane (training runs on the trainer's). Returns them, in order;
        they become members of the stream's group."""
        group = self._local.group
        assert group is not None, "called at a boundary of the stream this lane drives"
        joined: list[QueuedOperation] = []
        with self._ready:
            handed = list(self._samples)
        for item in handed:
            if item is None or item.operation is None:
                break
            with self._ready:
                if not any(i is item for i in self._samples):
                    continue  # another lane took it meanwhile
            if not may_join(item.operation):  # outside the lock: it may ask the generator
                break
            with self._ready:
                if not any(i is item for i in self._samples):
                    continue  # taken meanwhile: its rows stay counted (it only joins less)
                self._samples.remove(item)
            group.append(item)
            joined.append(item.operation)
        return joined

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

    def _execute(self, group: list[_Item], *, lane: bool) -> None:
        """Run the group; a sample stream it starts, to its end (`lane`: a generator lane's)."""
        stream = self._run(group)
        if stream is not None:
            self._drive(group, stream, lane)

    def _run(self, group: list[_Item]) -> Stream | None:
        """Run the group and finish it; a sample stream it starts comes back unfinished, for
        the caller to drive."""
        job = group[0].job
        result: object = None
        try:
            if job is not None:
                result = job.run()
            else:
                stream = self._run_group(self._operations(group))
                if stream is not None:
                    return stream
        except Exception as exc:  # noqa: BLE001 - the one job boundary (module docstring)
            self._failed(group, job, exc)
        self._finish(group, result)
        return None

    def _drive(self, group: list[_Item], stream: Stream, lane: bool) -> None:
        """The stream to its end: at each block boundary, the queue walk (between_blocks, or a
        generator lane's lane_joins), whose joining samples the stream is sent; then the group,
        with its joins, finishes as one."""
        self._local.group = group
        error: Exception | None = None
        try:
            boundary = next(stream, None)
            while boundary is not None:
                if lane:
                    joined = self.lane_joins(boundary.may_join)
                else:
                    joined = self.between_blocks(boundary.decoding, boundary.may_join)
                try:
                    boundary = stream.send(joined)
                except StopIteration:
                    boundary = None
        except Exception as exc:  # noqa: BLE001 - the one job boundary (module docstring)
            error = exc
        # Before the failure is recorded: it is the stream's own, not one between blocks.
        self._local.group = None
        try:
            stream.close()  # a generator stopped by a failure closes its decode stream here
        except Exception as exc:  # noqa: BLE001 - the one job boundary (module docstring)
            error = error or exc
        if error is not None:
            self._failed(group, None, error)
        self._finish(group, None)

    @staticmethod
    def _operations(group: list[_Item]) -> list[QueuedOperation]:
        return [item.operation for item in group if item.operation is not None]

    def _failed(self, group: list[_Item], job: Job | None, exc: Exception) -> None:
        """Hand a group's failure to its recorder."""
        try:
            self._record_failure(group[0], job, self._operations(group), exc)
        except Exception as lost:  # noqa: BLE001 - recording failed too (the store?):
            # the waiters get that error, and the worker lives on for the next job.
            log.exception("recording the failure of a job on %s failed", self._thread.name)
            for item in group:
                if not item.future.done():
                    item.future.set_exception(lost)

    def _finish(self, group: list[_Item], result: object) -> None:
        # After the outcome is recorded: a deferred weights-sync waiting for one of these
        # operations may complete now (service/scheduling/publishing.py).
        for item in group:
            if item.operation is not None:
                item.operation.done()
        for item in group:  # finished: recorded, or (a job without a recorder) raised
            if not item.future.done():
                item.future.set_result(result)

    def _record_failure(
        self, head: _Item, job: Job | None, operations: list[QueuedOperation], exc: Exception
    ) -> None:
        if job is None:
            self._fail_group(operations, exc)  # logs what is an internal error
            return
        log.error("job on %s failed", self._thread.name, exc_info=exc)
        if job.on_failure is None:
            head.future.set_exception(exc)
        else:
            job.on_failure(exc)
