"""Sample passes as streams on a resource hosted in a worker process (`--workers process`,
engine/hosts/remote_streams.py): the stream lives in the worker and the scheduler drives it
step by step, so a queued sample joins the running generation and another session's training
runs between blocks, as in process; a worker killed mid-stream fails the stream's operations
with INTERNAL_ERROR naming the process, and the next sample runs on the restarted worker.
Real services and real worker processes (the tiny model on the CPU, prefix cache off); the
queue is built while the worker is held, so what joins when is decided by the queue; orderings
are read from the operations' records, never bounded by the clock."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import test_sample_streams
from test_sample_streams import (
    FB,
    LONG,
    SAMPLE,
    SHORT,
    STEP,
    Queue,
    assert_same,
    engine_services,
    fb_request,
)

from posttrain.engine.hosts.messages import StreamRunningRows
from posttrain.engine.hosts.process.remote import ProcessEngine
from posttrain.errors import INTERNAL_ERROR, EngineFailure
from posttrain.service import Services
from posttrain.statuses import OperationStatus, SessionStatus
from posttrain.types import OptimStepRequest


def worker_services(tmp_path: Path, ray: str | None = None) -> Iterator[Services]:
    """Services whose resources live in worker processes (placed by Ray where `ray` says)."""
    yield from engine_services(tmp_path, workers="process", ray=ray)


@pytest.fixture(name="services")
def services_fixture(tmp_path: Path) -> Iterator[Services]:
    yield from worker_services(tmp_path)


def process_engine(services: Services) -> ProcessEngine:
    engine = services.scheduler.engine
    assert isinstance(engine, ProcessEngine)
    return engine


def assert_no_stream_open(services: Services, resource_id: str, stream_id: int) -> None:
    """The worker holds no stream `stream_id` any more: its pass closed it."""
    host = process_engine(services)._host(resource_id)
    assert host is not None
    with pytest.raises(EngineFailure, match=f"no decode stream {stream_id} is open"):
        host.call(StreamRunningRows(resource_id, stream_id))


def test_a_sample_queued_behind_a_running_generation_in_a_worker_joins_it(services):
    queue = Queue(services, 2)
    s, t = queue.sessions
    release = queue.hold()
    long_id = queue.submit(s, SAMPLE, LONG)
    step = queue.submit(t, STEP, OptimStepRequest())  # a barrier: SHORT is not in LONG's group
    short_id = queue.submit(t, SAMPLE, SHORT)
    release.set()
    queue.drain()
    # SHORT joined the generation running in the worker and completed while LONG went on.
    assert queue.finished_at(step) < queue.finished_at(short_id) < queue.finished_at(long_id)
    assert services.scheduler.metrics.shared_passes == 1
    assert services.scheduler.metrics.shared_pass_operations == 2
    got_long, got_short = queue.output(long_id), queue.output(short_id)
    assert_same(got_short, queue.alone(t, SHORT))
    assert_same(got_long, queue.alone(s, LONG))
    assert_no_stream_open(services, queue.resource, 1)  # the first stream's pass closed it


def test_another_sessions_forward_backward_runs_in_the_worker_between_blocks(services):
    queue = Queue(services, 2)
    s, t = queue.sessions
    release = queue.hold()
    long_id = queue.submit(s, SAMPLE, LONG)
    own = queue.submit(s, FB, fb_request())  # s is decoding: its own training keeps its order
    other = queue.submit(t, FB, fb_request())
    release.set()
    queue.drain()
    assert queue.finished_at(other) < queue.finished_at(long_id) < queue.finished_at(own)
    assert_same(queue.output(long_id), queue.alone(s, LONG))


def test_a_weights_sync_in_a_worker_runs_between_blocks_and_its_sample_joins_after_it(services):
    """The in-process test's queue and assertions, on a worker process."""
    test_sample_streams.test_a_weights_sync_of_a_session_not_decoding_runs_between_blocks_before_its_sample(
        services
    )


def test_a_pipeline_weights_sync_switches_the_running_rows_in_a_worker(services):
    """The publish between blocks is a command of its own; the stream in the worker picks it
    up at its next block (the in-process test's queue and assertions)."""
    test_sample_streams.test_a_pipeline_weights_sync_switches_the_running_rows_at_a_block_boundary(
        services
    )


def killed_mid_stream(queue: Queue, monkeypatch, kill: Callable[[], None], named: str) -> None:
    """On `queue` (two sessions): LONG running, an optim-step, SHORT joining it; `kill` (the
    resource's host) at the second block boundary: both stream operations fail with
    INTERNAL_ERROR naming `named`, and the next samples stream on the restarted host, equal to
    alone (the Ray test's scenario too)."""
    services = queue.services
    s, t = queue.sessions
    short_alone = queue.alone(t, SHORT)
    boundaries = []
    publish = services.scheduler.mailbox.publish_in_flight

    def killing(resource_id: str) -> None:
        """At the second block boundary (SHORT joined at the first): kill the host."""
        boundaries.append(resource_id)
        if len(boundaries) == 2:
            kill()
        publish(resource_id)

    monkeypatch.setattr(services.scheduler.mailbox, "publish_in_flight", killing)
    release = queue.hold()
    long_id = queue.submit(s, SAMPLE, LONG)
    step = queue.submit(t, STEP, OptimStepRequest())
    short_id = queue.submit(t, SAMPLE, SHORT)
    release.set()
    queue.drain()
    assert len(boundaries) == 2 and queue.record(step).status == OperationStatus.COMPLETED
    for op_id in (long_id, short_id):  # the running operation and the one that joined it
        op = services.repo.get_operation(op_id)
        assert op is not None and op.status == OperationStatus.FAILED, op
        assert op.error_code == INTERNAL_ERROR
        assert named in (op.error_message or ""), op.error_message

    monkeypatch.undo()
    assert_same(queue.alone(t, SHORT), short_alone)  # the next sample streams on it
    assert_same(queue.alone(s, SHORT), short_alone)


def test_a_worker_killed_mid_stream_fails_its_operations_and_the_next_sample_runs(
    services, monkeypatch
):
    engine = process_engine(services)
    queue = Queue(services, 2)
    resource = queue.resource
    worker = engine.worker_pid(resource)
    host = engine._host(resource)
    assert worker is not None and host is not None

    def kill() -> None:
        os.kill(worker, signal.SIGKILL)
        host.process.join()

    named = f"model resource {resource} (pid {worker}) was killed by signal 9"
    killed_mid_stream(queue, monkeypatch, kill, named)
    assert engine.worker_pid(resource) not in (None, worker)  # restarted


def test_a_worker_killed_under_training_between_blocks_is_recovered_once(services, monkeypatch):
    """The forward-backward run between blocks meets the dead worker first; the stream's own
    next call fails too, and the sessions are restored once, all of them live after it."""
    queue = Queue(services, 2)
    s, t = queue.sessions
    short_alone = queue.alone(t, SHORT)
    engine = process_engine(services)
    worker = engine.worker_pid(queue.resource)
    host = engine._host(queue.resource)
    assert worker is not None and host is not None
    resource_worker = services.scheduler.worker(queue.resource)
    between_blocks = resource_worker.between_blocks

    def killing(*args):
        if host.process.is_alive():
            os.kill(worker, signal.SIGKILL)
            host.process.join()
        return between_blocks(*args)

    monkeypatch.setattr(resource_worker, "between_blocks", killing)
    release = queue.hold()
    long_id = queue.submit(s, SAMPLE, LONG)
    other = queue.submit(t, FB, fb_request())
    release.set()
    queue.drain()
    monkeypatch.undo()
    for op_id in (other, long_id):  # the training met the dead worker first, then the stream
        op = services.repo.get_operation(op_id)
        assert op is not None and op.status == OperationStatus.FAILED, op
        assert op.error_code == INTERNAL_ERROR
        assert f"(pid {worker}) was killed by signal 9" in (op.error_message or "")
    for session in (s, t):
        record = services.repo.get_session(session)
        assert record is not None and record.status == SessionStatus.RUNNING, record
    assert_same(queue.alone(t, SHORT), short_alone)
    assert_same(queue.alone(s, SHORT), short_alone)
