"""Sample passes as streams on the in-process engine (service/scheduling/sample_streams.py): an
operation queued while a generation runs joins it at a block boundary and completes on its own, with
what it gets alone; another session's training runs between blocks; a session's own order and the
row limit hold. Real services (SQLite in tmp_path, the tiny model on the CPU, prefix cache off so
every prefill is computed the same way). The worker is held by a plain job while the queue is
built, so what joins when is decided by the queue, not by timing; orderings are read from the
operations' records (their completion times), never bounded by the clock."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from inprocess import USER, open_session, ready_resource

from posttrain.config import EngineConfig, SchedulerConfig, ServerConfig
from posttrain.records import OperationRecord
from posttrain.service import Services, build_services
from posttrain.service.scheduling import sample_streams
from posttrain.statuses import OperationStatus
from posttrain.types import (
    ForwardBackwardRequest,
    LossConfig,
    LossType,
    OperationKind,
    OperationRequest,
    OptimStepRequest,
    PolicySegment,
    SampleOutput,
    SampleRequest,
    SamplingParams,
    TrainingSample,
    WeightsSyncRequest,
    WeightSyncType,
)

SAMPLE, FB, STEP, SYNC = (
    OperationKind.SAMPLE,
    OperationKind.FORWARD_BACKWARD,
    OperationKind.OPTIM_STEP,
    OperationKind.WEIGHTS_SYNC,
)
LONG = SampleRequest(
    ((5, 6, 7, 8),),
    3,
    SamplingParams(max_tokens=120, temperature=1.0, seed=7, stop_at_eos=False),
)
SHORT = SampleRequest(
    ((11, 12, 13), (20, 21)),
    2,
    SamplingParams(max_tokens=9, temperature=0.8, top_k=20, seed=3, stop_at_eos=False),
    prompt_logprobs=True,
    topk_prompt_logprobs=2,
)


def make_services(tmp_path: Path, **scheduler: int) -> Services:
    engine = EngineConfig(device="cpu", prefix_cache_mib=0)
    return build_services(
        ServerConfig(data_dir=tmp_path, engine=engine, scheduler=SchedulerConfig(**scheduler))
    )


@pytest.fixture(name="services")
def services_fixture(tmp_path: Path) -> Iterator[Services]:
    built = make_services(tmp_path)
    yield built
    built.close()


def engine_services(tmp_path: Path, **engine: Any) -> Iterator[Services]:
    """Services on the CPU, prefix cache off, with these EngineConfig fields (where the
    engine runs: worker processes, generator replicas, Ray); closed after."""
    config = EngineConfig(device="cpu", prefix_cache_mib=0, **engine)
    built = build_services(
        ServerConfig(data_dir=tmp_path, engine=config, scheduler=SchedulerConfig())
    )
    yield built
    built.close()


class Queue:
    """Sessions on one resource, and operations submitted to it."""

    def __init__(self, services: Services, sessions: int, resource: str | None = None) -> None:
        """`sessions` new sessions on `resource`, or on a new resource (one generator)."""
        self.services = services
        self.resource = resource or ready_resource(services).id
        self.sessions = [open_session(services, self.resource).id for _ in range(sessions)]
        self.drain()
        self.keys = iter(range(1 << 30))

    def submit(self, session: str, kind: OperationKind, request: OperationRequest) -> str:
        key = f"op-{next(self.keys)}"
        op = self.services.operations.submit(
            USER,
            self.services.sessions.get(USER, session),
            kind,
            idempotency_key=key,
            fingerprint=key,
            request=request,
        )
        return op.id

    def hold(self) -> threading.Event:
        release, started = threading.Event(), threading.Event()
        self.services.scheduler.run_job(self.resource, lambda: (started.set(), release.wait(60)))
        assert started.wait(60)
        return release

    def drain(self) -> None:
        self.services.scheduler.run_job(self.resource, lambda: None).result(timeout=300)

    def record(self, op_id: str) -> OperationRecord:
        op = self.services.repo.get_operation(op_id)
        assert op is not None and op.status == OperationStatus.COMPLETED, op
        return op

    def finished_at(self, op_id: str) -> float:
        return self.record(op_id).updated_at

    def output(self, op_id: str) -> SampleOutput:
        output = self.record(op_id).output
        assert isinstance(output, SampleOutput)
        return output

    def alone(self, session: str, request: SampleRequest) -> SampleOutput:
        op_id = self.submit(session, SAMPLE, request)
        self.drain()
        return self.output(op_id)


def fb_request() -> ForwardBackwardRequest:
    tokens = (3, 9, 17, 4, 22, 5)
    sample = TrainingSample(tokens, {"target_tokens": tokens, "weights": (1.0,) * len(tokens)})
    return ForwardBackwardRequest((sample,), LossConfig(LossType.CROSS_ENTROPY))


def assert_same(got: SampleOutput, alone: SampleOutput) -> None:
    """Tokens, stop reasons and policy segments exact; logprobs (and prompt logprobs) 1e-5."""
    assert len(got.results) == len(alone.results)
    for ours, theirs in zip(got.results, alone.results, strict=True):
        assert ours.policy_segments == theirs.policy_segments
        close(ours.prompt_logprobs, theirs.prompt_logprobs)
        assert (ours.topk_prompt_logprobs is None) == (theirs.topk_prompt_logprobs is None)
        pairs = zip(ours.topk_prompt_logprobs or [], theirs.topk_prompt_logprobs or [], strict=True)
        for a, b in pairs:
            assert a.token_ids == b.token_ids
            close(a.logprobs, b.logprobs)
        assert len(ours.sequences) == len(theirs.sequences)
        for x, y in zip(ours.sequences, theirs.sequences, strict=True):
            assert (x.tokens, x.stop_reason) == (y.tokens, y.stop_reason)
            close(x.logprobs, y.logprobs)


def close(ours: object, theirs: object) -> None:
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_a_sample_queued_behind_a_running_generation_joins_it_and_gets_what_it_gets_alone(
    services,
):
    queue = Queue(services, 2)
    s, t = queue.sessions
    release = queue.hold()
    long_id = queue.submit(s, SAMPLE, LONG)
    step = queue.submit(t, STEP, OptimStepRequest())  # a barrier: SHORT is not in LONG's group
    short_id = queue.submit(t, SAMPLE, SHORT)
    release.set()
    queue.drain()
    # SHORT joined the running generation and completed while LONG went on.
    assert queue.finished_at(step) < queue.finished_at(short_id) < queue.finished_at(long_id)
    assert services.scheduler.metrics.shared_passes == 1
    assert services.scheduler.metrics.shared_pass_operations == 2
    got_long, got_short = queue.output(long_id), queue.output(short_id)
    assert all(len(q.tokens) == 9 for r in got_short.results for q in r.sequences)
    assert_same(got_short, queue.alone(t, SHORT))
    assert_same(got_long, queue.alone(s, LONG))


def test_a_sample_arriving_while_a_generation_runs_completes_before_it(services):
    queue = Queue(services, 2)
    s, t = queue.sessions
    long_id = queue.submit(s, SAMPLE, LONG)
    while services.repo.get_operation(long_id).status == OperationStatus.PENDING:  # type: ignore[union-attr]
        time.sleep(0.001)
    short_id = queue.submit(t, SAMPLE, SHORT)
    queue.drain()
    assert queue.finished_at(short_id) < queue.finished_at(long_id)
    assert_same(queue.output(short_id), queue.alone(t, SHORT))


def test_another_sessions_forward_backward_runs_between_blocks_and_the_sessions_own_waits(
    services,
):
    queue = Queue(services, 2)
    s, t = queue.sessions
    release = queue.hold()
    long_id = queue.submit(s, SAMPLE, LONG)
    own = queue.submit(s, FB, fb_request())  # s is decoding: its own training keeps its order
    other = queue.submit(t, FB, fb_request())
    release.set()
    queue.drain()
    assert queue.finished_at(other) < queue.finished_at(long_id) < queue.finished_at(own)
    # The training between blocks changed nothing the generation read.
    assert_same(queue.output(long_id), queue.alone(s, LONG))


def test_a_weights_sync_of_a_session_not_decoding_runs_between_blocks_before_its_sample(
    services,
):
    queue = Queue(services, 2)
    s, t = queue.sessions
    release = queue.hold()
    long_id = queue.submit(s, SAMPLE, LONG)
    queue.submit(t, FB, fb_request())
    queue.submit(t, STEP, OptimStepRequest())
    sync = queue.submit(t, SYNC, WeightsSyncRequest())
    short_id = queue.submit(t, SAMPLE, SHORT)
    release.set()
    queue.drain()
    assert queue.finished_at(sync) < queue.finished_at(short_id) < queue.finished_at(long_id)
    # The sample joined after its session's weights-sync: it decodes the new weights.
    assert {r.policy_segments[0] for r in queue.output(short_id).results} == {PolicySegment(0, 1)}
    assert {r.policy_segments[0] for r in queue.output(long_id).results} == {PolicySegment(0, 0)}
    assert_same(queue.output(short_id), queue.alone(t, SHORT))


def test_a_sample_after_its_decoding_sessions_weights_sync_never_joins_ahead_of_it(services):
    queue = Queue(services, 1)
    (s,) = queue.sessions
    release = queue.hold()
    long_id = queue.submit(s, SAMPLE, LONG)
    queue.submit(s, FB, fb_request())
    queue.submit(s, STEP, OptimStepRequest())
    sync = queue.submit(s, SYNC, WeightsSyncRequest())  # SYNCHRONOUS: after LONG, as today
    short_id = queue.submit(s, SAMPLE, SHORT)
    release.set()
    queue.drain()
    assert queue.finished_at(long_id) < queue.finished_at(sync) < queue.finished_at(short_id)
    assert [r.policy_segments for r in queue.output(long_id).results] == [[PolicySegment(0, 0)]]
    assert {r.policy_segments[0] for r in queue.output(short_id).results} == {PolicySegment(0, 1)}


def test_an_operation_over_the_row_limit_beside_the_running_rows_is_not_overtaken(tmp_path):
    services = make_services(tmp_path, max_sample_rows=6)
    try:
        queue = Queue(services, 4)
        s, u, w, x = queue.sessions
        release = queue.hold()
        params = SamplingParams(max_tokens=5, seed=1, stop_at_eos=False)
        long_id = queue.submit(s, SAMPLE, SampleRequest(((5, 6),), 4, LONG.sampling_params))
        step = queue.submit(u, STEP, OptimStepRequest())
        large = queue.submit(w, SAMPLE, SampleRequest(((7, 8),), 4, params))  # 4 + 4 > 6
        small = queue.submit(x, SAMPLE, SampleRequest(((9,),), 1, params))  # 4 + 1 fits
        release.set()
        queue.drain()
        assert queue.finished_at(step) < queue.finished_at(long_id)
        # Neither joined: the small one waits behind the large one, which waits for room.
        assert queue.finished_at(long_id) < queue.finished_at(large)
        assert queue.finished_at(long_id) < queue.finished_at(small)
    finally:
        services.close()


def test_a_pipeline_weights_sync_switches_the_running_rows_at_a_block_boundary(services):
    queue = Queue(services, 2)
    s, t = queue.sessions
    queue.submit(s, FB, fb_request())
    queue.submit(s, STEP, OptimStepRequest())
    queue.drain()
    release = queue.hold()
    long_id = queue.submit(s, SAMPLE, LONG)
    queue.submit(t, STEP, OptimStepRequest())  # a barrier: SHORT joins at a boundary
    short_id = queue.submit(t, SAMPLE, SHORT)
    sync = queue.submit(s, SYNC, WeightsSyncRequest(WeightSyncType.PIPELINE))
    release.set()
    queue.drain()
    assert queue.finished_at(sync) < queue.finished_at(long_id)
    for result in queue.output(long_id).results:
        first, switched = result.policy_segments
        assert (first.start_token, first.version) == (0, 0)
        assert 0 < switched.start_token < 120 and switched.version == 1
    # The other session's rows kept their weights.
    assert_same(queue.output(short_id), queue.alone(t, SHORT))


def test_a_stream_takes_a_bounded_number_of_operations_then_runs_down(services, monkeypatch):
    monkeypatch.setattr(sample_streams, "STREAM_MAX_OPERATIONS", 2)
    queue = Queue(services, 3)
    s, t, u = queue.sessions
    release = queue.hold()
    long_id = queue.submit(s, SAMPLE, LONG)
    queue.submit(u, STEP, OptimStepRequest())
    joined = queue.submit(t, SAMPLE, SHORT)
    later = queue.submit(u, SAMPLE, SHORT)  # the stream holds two operations: waits for its end
    release.set()
    queue.drain()
    assert queue.finished_at(joined) < queue.finished_at(long_id) < queue.finished_at(later)
    assert_same(queue.output(later), queue.output(joined))  # same request and seed, alone


def test_a_late_one_row_operation_joins_beside_one_that_filled_the_row_limit(tmp_path):
    # stream_join_rows defaults to an eighth of max_sample_rows: 2 rows beside the 16.
    services = make_services(tmp_path, max_sample_rows=16)
    try:
        queue = Queue(services, 4)
        s, u, w, x = queue.sessions
        full = SampleRequest(((5, 6, 7, 8),), 16, LONG.sampling_params)
        late = SampleRequest(((9, 10),), 1, SHORT.sampling_params)
        release = queue.hold()
        full_id = queue.submit(s, SAMPLE, full)
        queue.submit(u, STEP, OptimStepRequest())  # a barrier: `late` is not in full's group
        late_id = queue.submit(w, SAMPLE, late)
        release.set()
        queue.drain()
        assert queue.finished_at(late_id) < queue.finished_at(full_id)
        assert services.scheduler.metrics.shared_pass_operations == 2
        assert all(len(q.tokens) == 9 for r in queue.output(late_id).results for q in r.sequences)
        assert_same(queue.output(late_id), queue.alone(x, late))
        assert_same(queue.output(full_id), queue.alone(s, full))
    finally:
        services.close()


def test_joins_beyond_the_row_limit_stay_within_the_join_rows_and_keep_their_order(tmp_path):
    services = make_services(tmp_path, max_sample_rows=4, stream_join_rows=2)
    try:
        queue = Queue(services, 5)
        s, u, w, x, y = queue.sessions
        params = SamplingParams(max_tokens=5, seed=1, stop_at_eos=False)
        release = queue.hold()
        long_id = queue.submit(s, SAMPLE, SampleRequest(((5, 6),), 4, LONG.sampling_params))
        queue.submit(u, STEP, OptimStepRequest())
        two = queue.submit(w, SAMPLE, SampleRequest(((7, 8),), 2, params))  # 4 + 2 <= 4 + 2
        three = queue.submit(x, SAMPLE, SampleRequest(((7, 9),), 3, params))  # 6 + 3 > 6
        one = queue.submit(y, SAMPLE, SampleRequest(((9,),), 1, params))  # behind `three`
        release.set()
        queue.drain()
        assert queue.finished_at(two) < queue.finished_at(long_id)
        # `three` waits for room (rows end only with the long operation's), and the one-row
        # operation after it does not overtake it although it would fit once `two` ended.
        assert queue.finished_at(long_id) < queue.finished_at(three)
        assert queue.finished_at(long_id) < queue.finished_at(one)
    finally:
        services.close()
