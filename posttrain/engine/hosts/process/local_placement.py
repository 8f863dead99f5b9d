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
from typing import Generic, TypeVar

from posttrain.config import EngineConfig
from posttrain.engine.hosts.placement import (
    GENERATOR,
    RANK,
    TRAINER,
    Hosted,
    Placement,
    StagedHandle,
)
from posttrain.engine.hosts.process.worker import WorkerProcess

C = TypeVar("C")  # the class of the engine a process hosts


class StagedWorkerProcess(WorkerProcess[C], StagedHandle[C], Generic[C]):
    """A replica's worker process and the API end of its staging pipe."""

    def __init__(
        self,
        resource_id: str,
        config: EngineConfig,
        model_paths: dict[str, Path],
        engine: Hosted[C],
        *,
        role: str,
        label: str,
        staging: Connection,
        receive: Connection,
    ) -> None:
        """`staging`: the end this process writes; `receive`: the replica's, which its engine
        is built with (closed here once the process has it)."""
        super().__init__(
            resource_id, config, model_paths, engine, role=role, label=label, extra=(receive,)
        )
        receive.close()
        self.staging = staging

    def stage(self, data: bytes) -> None:
        try:
            self.staging.send_bytes(data)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass

    def stop(self) -> None:
        super().stop()
        self.staging.close()


class LocalPlacement(Placement):
    """Every process a child of this one, on this machine: nothing to reserve."""

    host = "127.0.0.1"

    def __init__(self, config: EngineConfig, model_paths: dict[str, Path]) -> None:
        self.config = config
        self.model_paths = model_paths

    def reserve(self, resource_id: str, generator_replicas: int) -> None:
        pass

    def start(
        self, resource_id: str, role: str, engine: Hosted[C], *, label: str, index: int = 0
    ) -> WorkerProcess[C]:
        assert role in (TRAINER, RANK), f"{role} is not a trainer's role"
        return WorkerProcess(
            resource_id,
            self.config,
            self.model_paths,
            engine,
            role=TRAINER if role == TRAINER else f"{role}{index}",
            label=label,
        )

    def start_replica(
        self, resource_id: str, engine: Hosted[C], *, label: str, index: int
    ) -> StagedWorkerProcess[C]:
        receive, send = multiprocessing.get_context("spawn").Pipe(duplex=False)
        return StagedWorkerProcess(
            resource_id,
            self.config,
            self.model_paths,
            engine,
            role=f"{GENERATOR}{index}",
            label=label,
            staging=send,
            receive=receive,
        )

    def release(self, resource_id: str) -> None:
        pass

    def close(self) -> None:
        pass
