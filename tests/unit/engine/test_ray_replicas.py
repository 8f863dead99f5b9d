"""Generator replicas as Ray actors (engine/hosts/ray/placement.py, `--ray local`): the replica
tests of test_generator_replicas.py, run again with the replicas placed by Ray beside a trainer
in this process (two bundles in the resource's placement group). The same numbers, the same
fences and PIPELINE boundaries, the same death and rebuild. One Ray start for the module."""

from __future__ import annotations

import pytest
from test_generator_replicas import (  # noqa: F401 - collected again, with this module's fixture
    inline,
    test_a_killed_replica_fails_its_sample_and_is_rebuilt_from_the_trainer,
    test_a_pipeline_install_lands_mid_generation_and_a_synchronous_one_does_not,
    test_replicas_sample_exactly_what_the_inline_generator_does_as_of_their_fence,
)
from test_process_engine import CONFIG, LORA, MODELS

from posttrain.config import BUILTIN_MODEL_ID
from posttrain.engine.build import placement_for
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.hosts.replicas.engine import ReplicatedEngine

ray = pytest.importorskip("ray")

RAY = CONFIG.model_copy(update={"generators": "process", "ray": "local"})


@pytest.fixture(scope="module")
def placement():
    placement = placement_for(RAY, MODELS)
    yield placement
    placement.close()
    assert not ray.is_initialized()


@pytest.fixture
def replicated(placement):
    engine = ReplicatedEngine(LocalEngine(CONFIG, MODELS), RAY, MODELS, placement)
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None, generator_replicas=2)
    engine.create_session("r", "s", LORA)
    assert live_groups("posttrain-r") == [[{"CPU": 1.0}] * 2]  # one bundle per replica
    yield engine
    engine.unload_resource("r")  # its actors and placement group go; Ray stays for the next
    assert live_groups("posttrain-r") == []


def live_groups(name: str) -> list[list[dict]]:
    """The bundles of each placement group of that name that is not removed."""
    table = ray.util.placement_group_table().values()
    return [
        list(g["bundles"].values()) for g in table if g["name"] == name and g["state"] != "REMOVED"
    ]
