"""Sample passes as streams on generator lanes (`--generators process`,
engine/hosts/replicas/engine.py lane_stream): the stream lives in the lane's replica, and a sample
handed to the lanes while every lane is busy joins a running generation at a block boundary, after
the replica applied the changes staged up to the sample's fence, provided none of them changes a
session decoding there (service/scheduling/sample_streams.py, _fence_allows); a replica killed
mid-stream fails the stream's operations with INTERNAL_ERROR naming it, and the next sample runs on
a new replica.

Real services, a real replica process (the tiny model on the CPU, prefix cache off). Samples
leave the trainer's queue for the lane at once, so what joins when is set by a hook at the
stream's first block boundary: it submits the operations and waits until the sample is handed
to the lanes, then lets the boundary take it. Orderings are read from the operations' records,
never bounded by the clock."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from inprocess import USER
from test_sample_streams import (
    FB,
    LONG,
    SAMPLE,
    SHORT,
    STEP,
    SYNC,
    Queue,
    assert_same,
    engine_services,
    fb_request,
)

from posttrain.config import BUILTIN_MODEL_ID
from posttrain.engine.hosts.replicas.engine import ReplicatedEngine
from posttrain.errors import INTERNAL_ERROR
from posttrain.service import Services
from posttrain.service.scheduling import sample_streams
from posttrain.service.scheduling.worker import ResourceWorker
from posttrain.statuses import OPERATION_TERMINAL, OperationStatus
from posttrain.types import (
    OptimStepRequest,
    PolicySegment,
    WeightsSyncRequest,
    WeightSyncType,
)

SETTLE_S = 300  # a hang's bound, not a timing assertion


def replica_services(tmp_path: Path, ray: str | None = None) -> Iterator[Services]:
    """Services whose samples run on generator replica processes (placed by Ray where `ray`
    says)."""
    yield from engine_services(tmp_path, generators="process", ray=ray)


@pytest.fixture(name="services")
def services_fixture(tmp_path: Path) -> Iterator[Services]:
    yield from replica_services(tmp_path)


class LaneQueue(Queue):
    """A Queue whose samples run on the resource's one generator lane: `drain` also waits
    for every operation submitted to settle (the trainer's queue hands samples off at once)."""

    def __init__(self, services: Services, sessions: int, lanes: int = 1) -> None:
        self.submitted: list[str] = []
        resource = None
        if lanes > 1:
            resource = services.resources.create(
                USER,
                base_model=BUILTIN_MODEL_ID,
                lora_enabled=True,
                num_generator_replicas=lanes,
                inactive_timeout=300,
                muon_scaling=None,
            ).id
        super().__init__(services, sessions, resource)
        engine = services.scheduler.engine
        assert isinstance(engine, ReplicatedEngine)
        assert engine.generator_lanes(self.resource) == lanes
        self.engine = engine
        self.worker = services.scheduler.worker(self.resource)

    def submit(self, session, kind, request) -> str:
        op_id = super().submit(session, kind, request)
        self.submitted.append(op_id)
        return op_id

    def drain(self) -> None:
        super().drain()
        deadline = time.monotonic() + SETTLE_S
        for op_id in self.submitted:
            while (op := self.services.repo.get_operation(op_id)) is None or (
                op.status not in OPERATION_TERMINAL
            ):
                assert time.monotonic() < deadline, f"{op_id} did not settle"
                time.sleep(0.005)

    def at_first_boundary(
        self, monkeypatch, submit: Callable[[], str], *, handed: bool = True
    ) -> list[str]:
        """At the lane stream's first block boundary: `submit` (it returns a sample's id), and
        once that sample waits for the lanes (`handed`; else as soon as `submit` returns), the
        boundary goes on. Returns [its id], filled then."""
        submitted: list[str] = []
        lane_joins = self.worker.lane_joins

        def hooked(may_join):
            if not submitted:
                submitted.append(submit())
                if handed:
                    handed_off(self.worker)
            return lane_joins(may_join)

        monkeypatch.setattr(self.worker, "lane_joins", hooked)
        return submitted

    def long_and_late(
        self, monkeypatch, session: str, submit: Callable[[], str], *, handed: bool = True
    ) -> tuple[str, str]:
        """LONG of `session`, and at its stream's first boundary what `submit` submits
        (at_first_boundary); once all settled, (LONG's id, the late sample's id)."""
        late = self.at_first_boundary(monkeypatch, submit, handed=handed)
        long_id = self.submit(session, SAMPLE, LONG)
        self.drain()
        (short_id,) = late
        return long_id, short_id


def handed_off(worker: ResourceWorker) -> None:
    """Wait until a sample waits for the generator lanes."""
    deadline = time.monotonic() + SETTLE_S
    while not worker._samples:
        assert time.monotonic() < deadline, "no sample was handed to the lanes"
        time.sleep(0.001)


def test_a_sample_handed_to_a_busy_lane_joins_its_running_generation(services, monkeypatch):
    queue = LaneQueue(services, 2)
    s, t = queue.sessions
    short_alone, long_alone = queue.alone(t, SHORT), queue.alone(s, LONG)
    assert services.scheduler.metrics.shared_passes == 0
    long_id, short_id = queue.long_and_late(monkeypatch, s, lambda: queue.submit(t, SAMPLE, SHORT))
    # SHORT joined LONG's generation on the replica and completed while LONG went on.
    assert queue.finished_at(short_id) < queue.finished_at(long_id)
    assert services.scheduler.metrics.shared_passes == 1
    assert services.scheduler.metrics.shared_pass_operations == 2
    assert_same(queue.output(short_id), short_alone)
    assert_same(queue.output(long_id), long_alone)


def test_a_sample_handed_off_during_a_call_of_many_blocks_wakes_it_and_joins(services, monkeypatch):
    """The lane runs LONG's blocks in calls so long that one would reach LONG's end; a sample
    handed off while such a call runs wakes the replica (ResourceWorker._hand_off ->
    wake_lanes): the call stops at the next block and the sample joins, finishing first."""
    monkeypatch.setattr(sample_streams, "LANE_BLOCKS_PER_CALL", 10_000)
    queue = LaneQueue(services, 2)
    s, t = queue.sessions
    short_alone = queue.alone(t, SHORT)
    late: list[str] = []
    submitters: list[threading.Thread] = []
    lane_stream = queue.engine.lane_stream

    def submitting(*args, **kwargs):
        """A lane stream whose first block call submits SHORT from another thread."""
        stream = lane_stream(*args, **kwargs)
        block = stream.block

        def first_call_submits(most: int = 1) -> None:
            if not submitters:
                submit = threading.Thread(
                    target=lambda: late.append(queue.submit(t, SAMPLE, SHORT))
                )
                submit.start()
                submitters.append(submit)  # started: the test joins it
            block(most)

        stream.block = first_call_submits  # type: ignore[method-assign]
        return stream

    monkeypatch.setattr(queue.engine, "lane_stream", submitting)
    long_id = queue.submit(s, SAMPLE, LONG)
    deadline = time.monotonic() + SETTLE_S
    while not submitters:
        assert time.monotonic() < deadline, "no block call was made"
        time.sleep(0.001)
    submitters[0].join()
    queue.drain()
    (short_id,) = late
    assert queue.finished_at(short_id) < queue.finished_at(long_id)
    assert services.scheduler.metrics.shared_passes == 1
    assert_same(queue.output(short_id), short_alone)


def test_a_free_lane_takes_a_sample_before_a_busy_lanes_stream(services, monkeypatch):
    """Two replicas: the sample handed off while lane 0 decodes LONG runs on lane 1 at once,
    in a generation of its own, so the load spreads; a stream joins only while every lane is
    busy."""
    queue = LaneQueue(services, 2, lanes=2)
    s, t = queue.sessions
    short_alone = queue.alone(t, SHORT)

    def submit_and_start() -> str:
        op_id = queue.submit(t, SAMPLE, SHORT)
        deadline = time.monotonic() + SETTLE_S
        while (op := services.repo.get_operation(op_id)) is None or (
            op.status == OperationStatus.PENDING
        ):
            assert time.monotonic() < deadline, "the free lane did not start it"
            time.sleep(0.001)
        return op_id

    long_id, short_id = queue.long_and_late(monkeypatch, s, submit_and_start, handed=False)
    assert queue.finished_at(short_id) < queue.finished_at(long_id)
    assert services.scheduler.metrics.shared_passes == 0  # its own generation, not a join
    assert_same(queue.output(short_id), short_alone)


def test_a_sample_after_another_sessions_weights_sync_joins_with_the_new_weights(
    services, monkeypatch
):
    """The sync runs on the trainer's lane while LONG decodes on the replica; SHORT's fence
    is past it, it changes no decoding session, so SHORT joins, on its session's new weights."""
    queue = LaneQueue(services, 2)
    s, t = queue.sessions
    long_alone = queue.alone(s, LONG)

    def train_sync_sample() -> str:
        queue.submit(t, FB, fb_request())
        queue.submit(t, STEP, OptimStepRequest())
        queue.submit(t, SYNC, WeightsSyncRequest())
        return queue.submit(t, SAMPLE, SHORT)

    long_id, short_id = queue.long_and_late(monkeypatch, s, train_sync_sample)
    assert queue.finished_at(short_id) < queue.finished_at(long_id)
    assert services.scheduler.metrics.shared_passes == 1
    assert {r.policy_segments[0] for r in queue.output(short_id).results} == {PolicySegment(0, 1)}
    assert_same(queue.output(long_id), long_alone)  # version 0 throughout
    monkeypatch.undo()
    assert_same(queue.output(short_id), queue.alone(t, SHORT))


def test_a_sample_after_a_decoding_sessions_weights_sync_waits_for_the_next_generation(
    services, monkeypatch
):
    """A SYNCHRONOUS weights-sync of the session decoding LONG runs on the trainer at once;
    LONG keeps its weights, and SHORT (another session, its fence past the sync) may not join:
    its replica would change LONG's rows. It runs after LONG, on the new weights' fence."""
    queue = LaneQueue(services, 2)
    s, t = queue.sessions
    short_alone, long_alone = queue.alone(t, SHORT), queue.alone(s, LONG)
    synced: list[str] = []

    def train_sync_sample() -> str:
        queue.submit(s, FB, fb_request())
        queue.submit(s, STEP, OptimStepRequest())
        synced.append(queue.submit(s, SYNC, WeightsSyncRequest()))
        return queue.submit(t, SAMPLE, SHORT)

    long_id, short_id = queue.long_and_late(monkeypatch, s, train_sync_sample)
    assert queue.finished_at(synced[0]) < queue.finished_at(long_id)  # the trainer went on
    assert queue.finished_at(long_id) < queue.finished_at(short_id)
    assert services.scheduler.metrics.shared_passes == 0
    assert_same(queue.output(long_id), long_alone)  # version 0 throughout
    assert_same(queue.output(short_id), short_alone)
    monkeypatch.undo()
    after = queue.alone(s, SHORT)  # the next generation serves s's new weights
    assert {r.policy_segments[0] for r in after.results} == {PolicySegment(0, 1)}


def test_a_pipeline_weights_sync_switches_the_running_rows_on_the_replica(services, monkeypatch):
    """A PIPELINE install of the decoding session lands between the stream's blocks: LONG's
    rows switch there, and SHORT (another session, joining past it) keeps its weights."""
    queue = LaneQueue(services, 2)
    s, t = queue.sessions
    short_alone = queue.alone(t, SHORT)
    queue.submit(s, FB, fb_request())
    queue.submit(s, STEP, OptimStepRequest())
    queue.drain()

    def sync_sample() -> str:
        queue.submit(s, SYNC, WeightsSyncRequest(WeightSyncType.PIPELINE))
        return queue.submit(t, SAMPLE, SHORT)

    long_id, short_id = queue.long_and_late(monkeypatch, s, sync_sample)
    assert queue.finished_at(short_id) < queue.finished_at(long_id)
    for result in queue.output(long_id).results:
        first, switched = result.policy_segments
        assert (first.start_token, first.version) == (0, 0)
        assert 0 < switched.start_token < 120 and switched.version == 1
    assert_same(queue.output(short_id), short_alone)


def test_a_replica_killed_mid_stream_fails_its_operations_and_the_next_sample_runs(
    services, monkeypatch
):
    queue = LaneQueue(services, 2)
    s, t = queue.sessions
    short_alone = queue.alone(t, SHORT)
    (pid,) = queue.engine.replica_pids(queue.resource)
    boundaries: list[int] = []
    lane_joins = queue.worker.lane_joins
    late: list[str] = []

    def hooked(may_join):
        """SHORT joins at the first boundary; the replica dies at the second."""
        boundaries.append(len(boundaries))
        if len(boundaries) == 1:
            late.append(queue.submit(t, SAMPLE, SHORT))
            handed_off(queue.worker)
        if len(boundaries) == 2:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        return lane_joins(may_join)

    monkeypatch.setattr(queue.worker, "lane_joins", hooked)
    long_id = queue.submit(s, SAMPLE, LONG)
    queue.drain()
    assert len(boundaries) == 2
    for op_id in (long_id, *late):  # the running operation and the one that joined it
        op = services.repo.get_operation(op_id)
        assert op is not None and op.status == OperationStatus.FAILED, op
        assert op.error_code == INTERNAL_ERROR
        assert f"generator replica 0 of model resource {queue.resource} (pid {pid})" in (
            op.error_message or ""
        ), op.error_message
    monkeypatch.undo()
    assert_same(queue.alone(t, SHORT), short_alone)  # on a new replica
    assert queue.engine.replica_pids(queue.resource)[0] not in (None, pid)
