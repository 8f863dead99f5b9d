"""A resource's engine processes as children of this process, on this machine (the default
placement; hosts/placement.py says what a placement does).

`LocalPlacement` spawns a `WorkerProcess` (hosts/process/worker.py) for a trainer worker or a
trainer group's rank; for a generator replica it adds the one-way staging pipe its
ReplicaEngine reads (hosts/replicas/worker.py). Nothing to reserve: the machine is what it is.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from posttrain.config import EngineConfig
from posttrain.engine.hosts.placement import GENERATOR, RANK, TRAINER
from posttrain.engine.hosts.process.worker import WorkerProcess


class StagedWorkerProcess(WorkerProcess):
    """A replica's worker process and the API end of its staging pipe."""

    def __init__(self, *args: Any, staging: Connection, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.staging = staging

    def stage(self, data: bytes) -> None:
        try:
            self.staging.send_bytes(data)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass

    def stop(self) -> None:
        super().stop()
        self.staging.close()


class LocalPlacement:
    """Every process a child of this one, on this machine: nothing to reserve."""

    host = "127.0.0.1"

    def __init__(self, config: EngineConfig, model_paths: dict[str, Path]) -> None:
        self.config = config
        self.model_paths = model_paths

    def reserve(self, resource_id: str, generator_replicas: int) -> None:
        pass

    def start(
        self, resource_id: str, role: str, engine: tuple[Any, ...], *, label: str, index: int = 0
    ) -> WorkerProcess:
        assert role in (TRAINER, RANK), f"{role} is not a trainer's role"
        return WorkerProcess(
            resource_id,
            self.config,
            self.model_paths,
            role=TRAINER if role == TRAINER else f"{role}{index}",
            label=label,
            engine=engine,
        )

    def start_replica(
        self, resource_id: str, engine: tuple[Any, ...], *, label: str, index: int
    ) -> StagedWorkerProcess:
        receive, send = multiprocessing.get_context("spawn").Pipe(duplex=False)
        worker = StagedWorkerProcess(
            resource_id,
            self.config,
            self.model_paths,
            role=f"{GENERATOR}{index}",
            label=label,
            engine=(*engine, receive),
            staging=send,
        )
        receive.close()
        return worker

    def release(self, resource_id: str) -> None:
        pass

    def close(self) -> None:
        pass
