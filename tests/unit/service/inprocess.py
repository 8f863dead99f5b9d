"""Real services in this process for the service tests: SQLite in tmp_path, the tiny model on
the CPU, and a ready LoRA resource with a running session made through the services' own API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from posttrain.config import BUILTIN_MODEL_ID, EngineConfig, ServerConfig
from posttrain.records import ResourceRecord, SessionRecord
from posttrain.service import Services, build_services

USER = "user_local"


@pytest.fixture(name="services")
def services_fixture(tmp_path: Path) -> Iterator[Services]:
    built = build_services(ServerConfig(data_dir=tmp_path, engine=EngineConfig(device="cpu")))
    yield built
    built.close()


def ready_resource(services: Services) -> ResourceRecord:
    return services.resources.create(
        USER,
        base_model=BUILTIN_MODEL_ID,
        lora_enabled=True,
        num_generator_replicas=1,
        inactive_timeout=300,
        muon_scaling=None,
    )


def open_session(services: Services, resource_id: str) -> SessionRecord:
    return services.sessions.create(
        USER,
        resource_id=resource_id,
        lora=None,
        display_name=None,
        metadata={},
        resume_from_checkpoint_id=None,
    )
