"""Trainer ranks as Ray actors (`--trainer-ranks 2 --ray local`, engine/hosts/ray/placement.py)
with a decode stream: test_trainer_group.py's stream test, run again with the ranks placed by
Ray. The stream lives on rank 0 and another session's training between its blocks reaches every
rank; the sample is what one process samples, the training what one process trains, and a rank
killed fails the group and the stream's next call. One Ray start for the module."""

from __future__ import annotations

import pytest
from test_trainer_group import (  # noqa: F401 - collected again, with this module's fixture
    GROUP,
    MODELS,
    test_a_stream_on_rank_zero_lets_training_reach_every_rank_between_blocks,
)

from posttrain.config import BUILTIN_MODEL_ID
from posttrain.engine.build import placement_for
from posttrain.engine.hosts.ranks.trainer_group import TrainerGroupEngine
from posttrain.engine.hosts.ray.placement import RayWorker

ray = pytest.importorskip("ray")

RAY_GROUP = GROUP.model_copy(update={"ray": "local"})


@pytest.fixture(scope="module")
def group():
    """test_trainer_group.py's `group`, its ranks placed by Ray."""
    placement = placement_for(RAY_GROUP, MODELS)
    engine = TrainerGroupEngine(RAY_GROUP, MODELS, placement)
    yield engine
    engine.close()
    placement.close()
    assert not ray.is_initialized()


def test_the_ranks_are_ray_actors(group):
    group.load_resource("q", BUILTIN_MODEL_ID, muon_scaling=None)
    host = group._host("q")
    assert host is not None and all(isinstance(rank, RayWorker) for rank in host.ranks)
    assert len(host.ranks) == 2
    group.unload_resource("q")
