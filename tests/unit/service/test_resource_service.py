"""ResourceService.create with compute_config.num_generator_replicas on a server whose
generators run inline: accepted and reported as asked, and the operator is told that replicas
need `--generators process` (real services, SQLite in tmp_path, the built-in model)."""

from __future__ import annotations

import logging

import pytest
from inprocess import USER, services_fixture  # noqa: F401

from posttrain.config import BUILTIN_MODEL_ID
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


@pytest.mark.parametrize("replicas, warned", [(1, False), (0, False), (2, True)])
def test_inline_generators_say_that_replicas_need_generator_processes(
    services: Services, caplog: pytest.LogCaptureFixture, replicas: int, warned: bool
):
    assert services.config.engine.generators == "inline"
    with caplog.at_level(logging.WARNING, logger="posttrain.resources"):
        record = create(services, replicas)
    assert record.status == ResourceStatus.READY
    assert record.num_generator_replicas == replicas  # reported as asked
    warnings = [r.getMessage() for r in caplog.records if r.name == "posttrain.resources"]
    if warned:
        (message,) = warnings
        assert "num_generator_replicas 2" in message and "--generators process" in message
    else:
        assert warnings == []
