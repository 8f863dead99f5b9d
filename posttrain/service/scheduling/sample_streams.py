"""A sample pass as a stream: operations join the running generation at decode block
boundaries and finish as soon as their last sequence ended, and on the trainer's lane queued
training runs between blocks.

Where the engine hands out a DecodeStream (engine/interface.py: the in-process engine, and process
workers and trainer groups, as processes or Ray actors, through step-wise commands,
hosts/remote_streams.py; on a generator lane, LanedEngine.lane_stream: a replica process's
stream, hosts/replicas/engine.py, or a vLLM server's, hosts/vllm/stream.py), the
scheduler's sample group runs here instead of one `sample_batch` call: StreamPass.blocks is a
generator that the worker drives (service/scheduling/worker.py `_drive`), yielding at every
decode block boundary. Before every decode block:

1. PIPELINE weights-syncs ready meanwhile publish (the mailbox's in-flight hook, as between the
   tokens of a whole-batch pass); the stream switches the running rows of their sessions.
2. Operations of the group that memory admission split off (plan_passes) join before any queued
   sample, once they fit, or when the stream is idle.
3. The stream yields a Boundary; the worker goes through its queue once
   (ResourceWorker.between_blocks): it runs what may run between blocks (other sessions'
   forward-backwards, optim-steps, weights-syncs of sessions with no row decoding, checkpoints,
   PIPELINE publishes) as groups of their own, each recorded through the usual path, and sends
   back the queued samples that may join (`may_join`): same model, the rows of the stream within
   its row limit (below), and memory admission (admission.py's rule, the join counted: its
   estimated peak plus what it may allocate beyond, which the stream itself judges,
   DecodeStream.fits: nothing within its pool, else a copy of the running cache).
4. Joined operations are marked RUNNING, prefilled and drawn their first token; then one block.
   A stream takes at most STREAM_MAX_OPERATIONS operations, then runs down (fairness: joins
   do not extend one generation without end).
On a generator lane (`lane`) the boundary differs: publishes reach the lane's generator as
staged changes (PIPELINE installs land between blocks there), nothing but samples runs on a lane
(training goes on on the trainer's lane meanwhile), and the samples handed to the lanes join
(ResourceWorker.lane_joins; a free lane takes one first) under one more rule, the fence: a
sample's generator state is the changes staged up to its place in the FIFO, which the lane's
generator applies before it joins, so it joins only where none of the changes between the
stream's fence and its own alters a session decoding or joining there (`_fence_allows`); else
it and every later sample wait for the next generation, as whole batches of one fence did.
When a stream starts (or restarts after running idle), it is given the row limit and what is
free beside the first operations' estimate, and allocates its decode cache as a pool for as
many rows as fit (engine/generate/sample_stream.py pool_rows), so joins within it copy none of
the running rows' KV; the service knows no pool sizes.
After every step, the tokens drawn by the operations someone watches go to their watchers
(service/operations/progress.py: a streamed OpenAI reply; the stream follows those,
DecodeStream.follow, and reports nothing of the others), then each operation whose every
sequence ended is recorded COMPLETED at once (service/operations/recording.py), while the
others decode on. The pass ends when no row runs.

The row limit: a stream starts with at most max_sample_rows sequences (the worker's gather) and
decodes at most `stream_rows` = max_sample_rows + stream_join_rows at once (an eighth more
unless set), the extra rows taken only by joins: an operation that filled max_sample_rows does
not keep a small late one waiting for its whole generation (on a model where no row ends early
it would). It stays bounded and fair: the first sample that cannot join keeps every later one
behind it, so a stream of small operations never overtakes a large one, which joins once rows
end or starts the next stream.

Imports: config, records, engine.interface, types.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol, cast

from posttrain.config import SchedulerConfig
from posttrain.engine.interface import DecodeStream, Engine, LanedEngine
from posttrain.records import OperationRecord
from posttrain.service.durability.durable_sessions import changed_parts
from posttrain.service.durability.routed_experts import RoutedExpertsStore
from posttrain.service.metrics import OperationMetrics
from posttrain.service.operations.kinds import InFlight, Lane, Outcome, Ready
from posttrain.service.operations.progress import SampleProgress
from posttrain.service.operations.recording import OperationRecorder
from posttrain.service.scheduling.worker import Boundary, QueuedOperation, Stream
from posttrain.types import OperationKind, SampleOutput, SampleRequest

log = logging.getLogger("posttrain.scheduler")

# Operations one stream takes at most: past them it admits no more joins and runs down, and
# the queued samples start the next stream. It bounds how long joins extend one generation
# (each stream keeps the bookkeeping of every request it served until it ends) at the cost of
# one run-down per that many operations.
STREAM_MAX_OPERATIONS = 1024

# Decode blocks a generator lane's stream runs in one call to its replica at most: it stops
# sooner where a sequence ended or a sample was handed to the lanes (LanedEngine.wake_lanes),
# so joins and completions wait no longer, and a long generation alone costs a round trip per
# this many blocks instead of one per block (on the CPU a block is one decode step).
LANE_BLOCKS_PER_CALL = 8


def stream_rows(limits: SchedulerConfig) -> int:
    """Most sequences one stream decodes at once: max_sample_rows, plus the rows only joining
    operations may take (stream_join_rows; by default an eighth of max_sample_rows)."""
    joins = limits.stream_join_rows
    return limits.max_sample_rows + (limits.max_sample_rows // 8 if joins is None else joins)


def _rows(request: object) -> int:
    assert isinstance(request, SampleRequest), type(request).__name__
    return len(request.prompts) * request.num_samples


def _items(members: list[Ready]) -> list[tuple[str, SampleRequest]]:
    """(session id, request) per member; a stream's members are sample operations."""
    items = []
    for _, session, request in members:
        assert isinstance(request, SampleRequest), type(request).__name__
        items.append((session.id, request))
    return items


class Scheduler(Protocol):
    """What a stream runs with: the scheduler's parts (service/scheduling/scheduler.py), read
    only (so the scheduler's own PublishMailbox serves as the InFlight it needs)."""

    @property
    def engine(self) -> Engine: ...
    @property
    def limits(self) -> SchedulerConfig: ...
    @property
    def mailbox(self) -> InFlight: ...
    @property
    def metrics(self) -> OperationMetrics: ...
    @property
    def recorder(self) -> OperationRecorder: ...
    @property
    def routed_experts(self) -> RoutedExpertsStore: ...
    @property
    def progress(self) -> SampleProgress: ...

    # The preamble of queued operations: RUNNING, or finished if their session stopped.
    def start(self, group: list[QueuedOperation]) -> list[Ready]: ...


class StreamPass:
    """One sample stream on a resource's worker thread, from its first operations until no
    sequence decodes: `blocks` is the generator the worker drives (worker.Stream)."""

    def __init__(
        self,
        scheduler: Scheduler,
        resource_id: str,
        stream: DecodeStream,
        queued: list[QueuedOperation],
        lane: Lane | None = None,
    ) -> None:
        """`lane`: the generator lane whose generator the stream decodes on (LanedEngine.
        lane_stream), as of the group's fence; None: the trainer's lane."""
        self.scheduler = scheduler
        self.resource_id = resource_id
        self.stream = stream
        self.lane = lane
        # A lane's: the fence its generator serves (the latest an admitted operation brought).
        self.fence = 0 if lane is None else lane.fence
        self._queued = {item.operation_id: item for item in queued}
        self._live: dict[int, Ready] = {}  # stream id -> admitted member
        self._waiting: list[list[Ready]] = []  # passes memory admission split off
        self.operations = 0
        self.block_calls = 0

    def blocks(self, passes: list[list[Ready]]) -> Stream:
        """The group's passes (plan_passes), the first admitted now; yields at each block
        boundary (the worker walks its queue there and sends the samples that join) until no
        row runs. The stream is closed when it ends, also when it fails or is closed (its
        decode cache pool is freed; a stream in a worker process lives there until then)."""
        try:
            yield from self._blocks(passes)
        finally:
            self.stream.close()

    def _blocks(self, passes: list[list[Ready]]) -> Stream:
        started = time.monotonic()
        first, *self._waiting = passes
        self._admit(first)
        while True:
            if not self.stream.running_rows():
                if not self._waiting:
                    break
                self._admit(self._waiting.pop(0))  # each fits alone (plan_passes)
                continue
            if self.lane is None:
                # PIPELINE weights-syncs publish here; on a generator lane their installs
                # land in the generator between blocks as staged changes (replica_worker.py).
                self.scheduler.mailbox.publish_in_flight(self.resource_id)
            if self._waiting and self._fits(self._waiting[0]):
                self._admit(self._waiting.pop(0))
            joined = yield Boundary(self._sessions(), self._may_join())
            if joined:
                self._queued.update((item.operation_id, item) for item in joined)
                self._admit(self.scheduler.start(joined))
            if self.stream.running_rows():
                self._follow()
                # On the trainer's lane one block at a time: queued training runs between.
                self.stream.block(1 if self.lane is None else LANE_BLOCKS_PER_CALL)
                self.block_calls += 1
                self._finish_done()
        if self.operations > 1:
            self.scheduler.metrics.shared_pass(self.operations)
        log.debug(
            "%d sample operations in one stream, %d block calls, %.3fs",
            self.operations,
            self.block_calls,
            time.monotonic() - started,
        )

    def _sessions(self) -> set[str]:
        """Sessions with an operation in the stream (decoding or waiting to)."""
        members = [*self._live.values(), *(m for p in self._waiting for m in p)]
        return {session.id for _, session, _ in members}

    def _may_join(self) -> Callable[[QueuedOperation], bool]:
        """This boundary's rule for a queued sample, which counts each one it lets join: the
        stream's row limit and operation bound, the fence on a generator lane, the model, and
        memory (its estimated peak beside those joining before it, plus what it allocates
        beyond, DecodeStream.fits, within what is free)."""
        rows, peaks = self.stream.running_rows(), 0
        engine, limit = self.scheduler.engine, stream_rows(self.scheduler.limits)
        taken = self.operations
        joining: list[tuple[str, SampleRequest]] = []

        def may_join(op: QueuedOperation) -> bool:
            nonlocal rows, peaks, taken
            if self._waiting or taken >= STREAM_MAX_OPERATIONS:
                return False
            if rows + op.rows > limit:
                return False
            if self.lane is not None and not self._fence_allows(op, joining):
                return False
            if not self.stream.can_join(op.session_id):
                return False
            assert isinstance(op.request, SampleRequest)
            item = (op.session_id, op.request)
            peak = peaks + engine.peak_bytes(self.resource_id, OperationKind.SAMPLE, [item])
            free = engine.headroom(self.resource_id, OperationKind.SAMPLE).free_bytes
            if not self.stream.fits([*joining, item], free - peak):
                return False
            joining.append(item)
            rows, peaks, taken = rows + op.rows, peak, taken + 1
            return True

        return may_join

    def _fence_allows(self, op: QueuedOperation, joining: list[tuple[str, SampleRequest]]) -> bool:
        """On a generator lane: whether the changes staged between the stream's fence and
        `op`'s (which its generator applies before `op` joins) leave every session decoding
        or joining now as it is, so running rows keep their weights (a SYNCHRONOUS or
        BACKGROUND weights-sync of a decoding session staged before `op` keeps it for the
        next generation: the first sample that may not join keeps every later one behind it)."""
        if op.fence <= self.fence:
            return True
        laned = cast(LanedEngine, self.scheduler.engine)
        changed = laned.changed_sessions(self.resource_id, self.fence, op.fence)
        if changed is None:
            return False
        return not changed & (self._sessions() | {session_id for session_id, _ in joining})

    def _spare_bytes(self, items: list[tuple[str, SampleRequest]]) -> int:
        """What is free beside `items`' own estimated peak (negative: they do not fit)."""
        engine = self.scheduler.engine
        free = engine.headroom(self.resource_id, OperationKind.SAMPLE).free_bytes
        return free - engine.peak_bytes(self.resource_id, OperationKind.SAMPLE, list(items))

    def _fits(self, members: list[Ready]) -> bool:
        """Whether operations split off by memory admission fit beside the running rows."""
        items = _items(members)
        rows = self.stream.running_rows() + sum(_rows(request) for _, _, request in members)
        limit = stream_rows(self.scheduler.limits)
        return rows <= limit and self.stream.fits(items, self._spare_bytes(items))

    def _admit(self, members: list[Ready]) -> None:
        if not members:
            return
        items = _items(members)
        limit, spare = 0, 0
        if not self.stream.running_rows():
            # A start: the stream allocates its pool for up to the row limit, as much as the
            # memory spare beside these operations' estimate lets it (sample_stream.pool_rows).
            limit = stream_rows(self.scheduler.limits)
            spare = self._spare_bytes(items)
        if self.lane is not None:  # each operation's fence, the latest of them for all
            self.fence = max(self.fence, *(self._queued[op.id].fence for op, _, _ in members))
        ids = self.stream.admit(items, self.fence, row_limit=limit, spare_bytes=spare)
        self._live.update(zip(ids, members, strict=True))
        self.operations += len(members)
        self._finish_done()  # every sequence may have ended on its first token

    def _follow(self) -> None:
        """The stream reports the tokens of the operations someone watches (a streamed reply:
        service/operations/progress.py), from the next step on."""
        ids = {op.id: stream_id for stream_id, (op, _, _) in self._live.items()}
        watched = self.scheduler.progress.watched(ids)
        self.stream.follow([ids[op_id] for op_id in watched])

    def _finish_done(self) -> None:
        """Hand the tokens drawn meanwhile to their watchers, then record each operation whose
        every sequence ended, now."""
        scheduler = self.scheduler
        for stream_id, drawn in self.stream.take_progress():
            scheduler.progress.publish(self._live[stream_id][0].id, drawn)
        outcomes: list[tuple[OperationRecord, Outcome]] = []
        changed: dict[str, tuple[str, ...]] = {}
        for stream_id, results in self.stream.take_finished():
            op, session, request = self._live.pop(stream_id)
            output = SampleOutput(scheduler.routed_experts.keyed(session.id, results))
            scheduler.metrics.count_tokens(op.kind, request, output)
            outcomes.append((op, output))
            changed[op.id] = changed_parts(op.kind, request)
        scheduler.recorder.finish(outcomes, changed)  # one store transaction
        for op, _ in outcomes:
            self._queued[op.id].done()
