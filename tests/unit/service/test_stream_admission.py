"""Memory admission of joins (service/scheduling/sample_streams.py): a sample joins a running stream
only when its estimated peak plus what growing the running cache may copy fits in what is free;
otherwise it waits for a boundary with room (here: the stream's end) and runs then, not refused.

The scheduler, worker and store are real; the engine is the fake one of fake_engine.py (a
sample's peak is its sequence count, free_bytes what is free) with a decode stream of its own:
an operation's rows run max_tokens blocks, and `reserve` is what a join allocates beyond its
estimate (DecodeStream.fits); its pool is sized by the engine's rule (sample_stream.pool_rows).
A watched sample's tokens reach its watcher after every block (service/operations/progress.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from dataclasses import dataclass, field

from fake_engine import FakeEngine, wire

from posttrain.config import SchedulerConfig
from posttrain.engine.generate.sample_stream import pool_rows
from posttrain.statuses import OperationStatus
from posttrain.types import (
    OperationKind,
    OptimStepRequest,
    PolicySegment,
    SampledSequence,
    SampleRequest,
    SampleResult,
    SamplingParams,
    StopReason,
)


@dataclass
class CountingStream:
    """Rows that end after their max_tokens blocks; results say nothing but their count."""

    reserve: int
    row_bytes: int = 0
    pool: int | None = None  # rows reserved for the last start
    left: dict[int, int] = field(default_factory=dict)  # stream id -> blocks to go
    rows: dict[int, int] = field(default_factory=dict)
    requests: dict[int, SampleRequest] = field(default_factory=dict)
    done: list[int] = field(default_factory=list)
    closed: bool = False
    fail: bool = False  # block raises
    followed: set[int] = field(default_factory=set)  # DecodeStream.follow's
    reported: dict[int, int] = field(default_factory=dict)  # stream id -> tokens reported

    def can_join(self, session_id: str) -> bool:
        return True

    def admit(
        self,
        items: list[tuple[str, SampleRequest]],
        fence: int = 0,
        *,
        row_limit: int = 0,
        spare_bytes: int = 0,
    ) -> list[int]:
        assert fence == 0, "the trainer's lane has nothing staged"
        if not self.running_rows() and row_limit:  # a start: the pool, as the engine sizes it
            rows = sum(len(request.prompts) * request.num_samples for _, request in items)
            self.pool = pool_rows(row_limit, rows, spare_bytes, self.row_bytes)
        ids = []
        for _, request in items:
            stream_id = len(self.requests)
            self.requests[stream_id] = request
            self.left[stream_id] = request.sampling_params.max_tokens or 1
            self.rows[stream_id] = len(request.prompts) * request.num_samples
            ids.append(stream_id)
        return ids

    def block(self, most: int = 1) -> None:
        assert most == 1, "the trainer's lane runs one block a call (training runs between)"
        if self.fail:
            raise RuntimeError("the decode block failed")
        for stream_id in list(self.left):
            self.left[stream_id] -= 1
            if self.left[stream_id] == 0:
                del self.left[stream_id]
                self.done.append(stream_id)

    def take_finished(self) -> list[tuple[int, list[SampleResult]]]:
        finished, self.done = self.done, []
        out = []
        for stream_id in finished:
            request = self.requests[stream_id]
            sequence = SampledSequence([1], [-0.5], StopReason.LENGTH)
            result = SampleResult([sequence] * request.num_samples, [PolicySegment(0, 0)])
            out.append((stream_id, [result for _ in request.prompts]))
        return out

    def follow(self, ids: Collection[int]) -> None:
        self.followed = set(ids)

    def take_progress(self) -> list[tuple[int, list[list[int]]]]:
        """One token (1) per sequence and block of each followed operation still running."""
        progress = []
        for stream_id in sorted(self.followed & set(self.left)):
            blocks = self.requests[stream_id].sampling_params.max_tokens or 1
            drawn = blocks - self.left[stream_id] - self.reported.get(stream_id, 0)
            if drawn:
                self.reported[stream_id] = self.reported.get(stream_id, 0) + drawn
                progress.append((stream_id, [[1] * drawn] * self.rows[stream_id]))
        return progress

    def running_rows(self) -> int:
        return sum(self.rows[i] for i in self.left)

    def fits(self, items: list[tuple[str, SampleRequest]], spare_bytes: int) -> bool:
        return self.reserve <= spare_bytes

    def close(self) -> None:
        self.closed = True


@dataclass
class StreamingEngine(FakeEngine):
    reserve: int = 0
    row_bytes: int = 0
    streams: list[CountingStream] = field(default_factory=list)
    fail: bool = False

    def sample_stream(self, resource_id: str, session_id: str) -> CountingStream:  # type: ignore[override]
        self.streams.append(CountingStream(self.reserve, self.row_bytes, fail=self.fail))
        return self.streams[-1]


def request(rows: int, blocks: int) -> SampleRequest:
    return SampleRequest(((1, 2),), rows, SamplingParams(max_tokens=blocks))


def run(tmp_path, reserve: int) -> tuple[float, float, float]:
    """A 4-row operation of 20 blocks, then (behind a barrier) a 4-row one of 2 blocks, with 10
    bytes free; returns when the long one, the barrier and the short one finished."""
    wired = wire(tmp_path, StreamingEngine(free_bytes=10, reserve=reserve))
    try:
        rid = wired.resource()
        s, u, t = wired.session(rid), wired.session(rid), wired.session(rid)
        release = wired.hold(rid)
        long_id = wired.submit(s, OperationKind.SAMPLE, request(4, 20), "long")
        step = wired.submit(u, OperationKind.OPTIM_STEP, OptimStepRequest(), "step")
        short_id = wired.submit(t, OperationKind.SAMPLE, request(4, 2), "short")
        release.set()
        wired.drain(rid)
        records = [wired.op(i) for i in (long_id, step, short_id)]
        assert all(r.status == OperationStatus.COMPLETED for r in records), records
        return tuple(r.updated_at for r in records)  # type: ignore[return-value]
    finally:
        wired.scheduler.close()


def test_a_join_that_fits_beside_the_running_rows_joins(tmp_path):
    long_done, step_done, short_done = run(tmp_path, reserve=6)  # 6 + 4 <= 10
    assert step_done < short_done < long_done


def test_a_join_that_does_not_fit_waits_for_room_and_is_not_refused(tmp_path):
    long_done, step_done, short_done = run(tmp_path, reserve=7)  # 7 + 4 > 10: waits
    assert step_done < long_done < short_done


def test_a_streams_pool_takes_the_rows_that_fit_in_a_share_of_what_is_free():
    assert pool_rows(limit=288, rows=4, free_bytes=6, row_bytes=1) == 7  # half of 6 bytes
    assert pool_rows(limit=288, rows=4, free_bytes=10_000, row_bytes=1) == 288  # the row limit
    assert pool_rows(limit=288, rows=4, free_bytes=-5, row_bytes=1) == 4  # never under its rows
    assert pool_rows(limit=288, rows=300, free_bytes=10_000, row_bytes=1) == 300


def test_a_stream_starts_with_a_pool_sized_by_memory_admission(tmp_path):
    limits = SchedulerConfig(max_sample_rows=16, stream_join_rows=4)
    for row_bytes, pool in ((1, 4 + 3), (0, 20)):  # (10 - 4) // 2 rows of 1 byte; the limit
        engine = StreamingEngine(free_bytes=10, row_bytes=row_bytes)
        wired = wire(tmp_path / str(row_bytes), engine, limits)
        try:
            rid = wired.resource()
            op = wired.submit(wired.session(rid), OperationKind.SAMPLE, request(4, 3), "one")
            wired.drain(rid)
            assert wired.op(op).status == OperationStatus.COMPLETED
            assert [stream.pool for stream in engine.streams] == [pool]
        finally:
            wired.scheduler.close()


def test_a_stream_is_closed_when_its_pass_ends_and_when_it_fails(tmp_path):
    engine = StreamingEngine(free_bytes=10)
    wired = wire(tmp_path, engine)
    try:
        rid = wired.resource()
        s = wired.session(rid)
        done = wired.submit(s, OperationKind.SAMPLE, request(2, 3), "done")
        wired.drain(rid)
        engine.fail = True
        failed = wired.submit(s, OperationKind.SAMPLE, request(2, 3), "failed")
        wired.drain(rid)
        assert wired.op(done).status == OperationStatus.COMPLETED
        assert wired.op(failed).status == OperationStatus.FAILED
        assert [stream.closed for stream in engine.streams] == [True, True]
    finally:
        wired.scheduler.close()


def test_a_watched_sample_gets_its_tokens_block_by_block_and_a_closed_channel_at_its_end(
    tmp_path,
):
    engine = StreamingEngine(free_bytes=10)
    wired = wire(tmp_path, engine)
    progress = wired.scheduler.progress
    wired.repo.add_operation_listener(progress.operation_written)

    async def watch_one() -> tuple[list[dict[int, list[int]]], str, OperationStatus]:
        rid = wired.resource()
        s = wired.session(rid)
        release = wired.hold(rid)
        watched = wired.submit_op(s, OperationKind.SAMPLE, request(2, 5), "watched")
        wired.submit(s, OperationKind.SAMPLE, request(1, 5), "unwatched")
        channel = progress.watch(watched.id)
        release.set()
        takes = []
        while not channel.closed:
            takes.append(await channel.take())
        assert channel.record is not None
        return takes, watched.id, channel.record.status

    try:
        takes, op_id, status = asyncio.run(watch_one())
        assert status == OperationStatus.COMPLETED
        drawn: dict[int, list[int]] = {0: [], 1: []}
        for take in takes:
            for sequence, tokens in take.items():
                drawn[sequence] += tokens
        # The fake draws a token per block; the last block's come with the result alone.
        assert drawn == {0: [1] * 4, 1: [1] * 4}
        (stream,) = engine.streams
        assert stream.reported == {0: 4}  # the unwatched operation (1) was never reported
        assert progress.watched([op_id]) == set()  # the channel closed with the operation
    finally:
        wired.scheduler.close()
