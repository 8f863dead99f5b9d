"""Sample passes as streams on a resource hosted in a Ray actor (`--workers process --ray
local`, engine/hosts/ray/placement.py): the process-worker stream tests of
test_process_streams.py, run again with the worker placed by Ray. The stream lives in the
actor and the scheduler drives it with the same step-wise commands, so a queued sample joins
the running generation, another session's training and weights-syncs run between blocks, and a
PIPELINE publish switches running rows, with the same results as alone. An actor killed
mid-stream fails the stream's operations with INTERNAL_ERROR naming it, and the next sample
runs on the restarted actor. Each test's services start a local Ray instance of their own.
Trainer ranks as Ray actors: tests/unit/engine/test_ray_trainer_group.py."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_process_streams import (  # noqa: F401 - collected again, with this module's fixture
    killed_mid_stream,
    test_a_pipeline_weights_sync_switches_the_running_rows_in_a_worker,
    test_a_sample_queued_behind_a_running_generation_in_a_worker_joins_it,
    test_a_weights_sync_in_a_worker_runs_between_blocks_and_its_sample_joins_after_it,
    test_another_sessions_forward_backward_runs_in_the_worker_between_blocks,
    worker_services,
)
from test_sample_streams import Queue

from posttrain.engine.hosts.ray.placement import RayWorker
from posttrain.service import Services

ray = pytest.importorskip("ray")


@pytest.fixture(name="services")
def services_fixture(tmp_path: Path) -> Iterator[Services]:
    yield from worker_services(tmp_path, ray="local")


def test_the_stream_runs_in_the_ray_actor(services):
    queue = Queue(services, 1)
    (s,) = queue.sessions
    host = services.scheduler.engine._host(queue.resource)
    assert isinstance(host, RayWorker) and host.pid not in (None, os.getpid())
    stream = services.scheduler.engine.sample_stream(queue.resource, s)
    assert stream is not None  # a stream, not whole batches
    assert stream.can_join(s)  # a StreamCanJoin the actor answers
    stream.close()


def test_an_actor_killed_mid_stream_fails_its_operations_and_the_next_sample_runs(
    services, monkeypatch
):
    queue = Queue(services, 2)
    host = services.scheduler.engine._host(queue.resource)
    assert isinstance(host, RayWorker)
    actor = host.pid
    assert actor is not None

    def kill() -> None:
        os.kill(actor, signal.SIGKILL)  # Ray sees it at the stream's next call

    killed_mid_stream(queue, monkeypatch, kill, f"(pid {actor}) is gone")
    restarted = services.scheduler.engine._host(queue.resource)
    assert isinstance(restarted, RayWorker) and restarted.pid not in (None, actor)
