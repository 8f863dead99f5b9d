"""ResourceService.create with compute_config.num_generator_replicas on a server whose
generators run inline: one generator (or none) is created as asked; more is refused with a 400
naming the field and the flags that give replicas, and nothing is created (real services,
SQLite in tmp_path, the built-in model)."""

from __future__ import annotations

import pytest
from inprocess import USER, services_fixture  # noqa: F401

from posttrain.config import BUILTIN_MODEL_ID
from posttrain.errors import InvalidRequest
from posttrain.service import Services
from posttrain.statuses import ResourceStatus


def create(services: Services, replicas: int):
    return services.resources.create(
        USER,
        base_model=BUILTIN_MODEL_ID,
        lora_enabled=True,
        num_generator_replicas=replicas,
        inactive_timeout=300,
        muon_scaling=None,
    )


@pytest.mark.parametrize("replicas", [1, 0])
def test_inline_generators_create_what_they_run(services: Services, replicas: int):
    assert services.config.engine.generators == "inline"
    record = create(services, replicas)
    assert record.status == ResourceStatus.READY
    assert record.num_generator_replicas == replicas


def test_inline_generators_refuse_more_than_one_replica(services: Services):
    with pytest.raises(InvalidRequest) as refused:
        create(services, 2)
    assert refused.value.param == "compute_config.num_generator_replicas"
    message = str(refused.value)
    assert "num_generator_replicas 2" in message
    assert "--generators process" in message and "--generators vllm" in message
    assert services.resources.list(USER, None) == []  # nothing was created
