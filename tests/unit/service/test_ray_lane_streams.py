"""Sample passes as streams on generator replicas placed by Ray (`--generators process --ray
local`, engine/hosts/ray/placement.py): the lane-stream tests of test_lane_streams.py, run again
with the replica a Ray actor. The stream lives in the actor and the lane drives it with the same
step-wise commands, so a sample handed to the busy lane joins its generation under the same
fence rule, with the same results as alone. Each test's services start a local Ray instance of
their own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_lane_streams import (  # noqa: F401 - collected again, with this module's fixture
    LaneQueue,
    replica_services,
    test_a_sample_after_a_decoding_sessions_weights_sync_waits_for_the_next_generation,
    test_a_sample_after_another_sessions_weights_sync_joins_with_the_new_weights,
    test_a_sample_handed_to_a_busy_lane_joins_its_running_generation,
)

from posttrain.engine.hosts.ray.placement import RayWorker
from posttrain.service import Services

ray = pytest.importorskip("ray")


@pytest.fixture(name="services")
def services_fixture(tmp_path: Path) -> Iterator[Services]:
    yield from replica_services(tmp_path, ray="local")


def test_the_lane_stream_runs_in_the_ray_actor(services):
    queue = LaneQueue(services, 1)
    (s,) = queue.sessions
    (replica,) = queue.engine._required(queue.resource).replicas
    assert isinstance(replica.worker, RayWorker)
    fence = queue.engine.generator_fence(queue.resource)  # the session's create staged
    stream = queue.engine.lane_stream(queue.resource, s, fence=fence, lane=0)
    assert stream.can_join(s)  # a StreamCanJoin the actor answers
    stream.close()
