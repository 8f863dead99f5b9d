"""engine/hosts/placement.py: where a resource's processes run. Without --ray nothing imports Ray;
a resource's processes take their places (trainer or ranks first, then each replica) in its group;
--ray without any worker process is a start-up error naming the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.build import placement_for
from posttrain.engine.hosts.placement import (
    GENERATOR,
    RANK,
    TRAINER,
    bundle_index,
    processes_per_resource,
)
from posttrain.engine.hosts.process.local_placement import LocalPlacement
from posttrain.errors import ConfigError

MODELS = {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}
ROOT = Path(__file__).resolve().parents[3]


def test_without_ray_nothing_imports_it():
    code = (
        "import sys, posttrain.service, posttrain.api.app, posttrain.cli\n"
        "from posttrain.config import EngineConfig\n"
        "from posttrain.engine.build import placement_for\n"
        "placement_for(EngineConfig(workers='process', generators='process'), {})\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_the_local_placement_is_the_default():
    config = EngineConfig(device="cpu", workers="process", generators="process")
    assert isinstance(placement_for(config, MODELS), LocalPlacement)


def test_a_resource_s_processes_take_the_trainer_s_place_then_the_replicas():
    both = EngineConfig(workers="process", generators="process")
    assert processes_per_resource(both, 2) == 3
    places = [bundle_index(both, TRAINER, 0), *(bundle_index(both, GENERATOR, i) for i in (0, 1))]
    assert places == [0, 1, 2]
    replicas_only = EngineConfig(generators="process")
    assert processes_per_resource(replicas_only, 2) == 2
    assert [bundle_index(replicas_only, GENERATOR, i) for i in (0, 1)] == [0, 1]
    trainer_only = EngineConfig(workers="process")
    assert processes_per_resource(trainer_only, 2) == 1
    assert processes_per_resource(EngineConfig(), 2) == 0
    # A trainer group's ranks first, whatever --workers says, then the replicas.
    ranks = EngineConfig(trainer_ranks=3, generators="process")
    assert processes_per_resource(ranks, 2) == 5
    places = [bundle_index(ranks, RANK, i) for i in range(3)]
    assert places + [bundle_index(ranks, GENERATOR, i) for i in (0, 1)] == [0, 1, 2, 3, 4]


def test_ray_without_worker_processes_is_a_config_error():
    with pytest.raises(ConfigError, match="--generators process or --trainer-ranks N") as info:
        EngineConfig(ray="local")
    assert info.value.param == "engine.ray"
    assert EngineConfig(ray="local", generators="process").ray == "local"
    assert EngineConfig(ray="local", trainer_ranks=2).ray == "local"
