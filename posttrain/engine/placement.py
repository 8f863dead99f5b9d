"""Where an engine process runs: the one place that starts a model resource's processes.

ProcessEngine (its trainer worker) and ReplicatedEngine (its generator replicas) start every
process they need through a `Placement`, and talk to it through the `WorkerHandle` it returns.
`LocalPlacement` (the default) spawns a `WorkerProcess` on this machine; for a replica it adds
the one-way staging pipe its ReplicaEngine reads. `--ray local|ADDRESS` gives a RayPlacement
instead (engine/ray_placement.py, the only module that imports Ray, imported here only then):
the same engines as Ray actors, one placement group per resource.

A resource's processes are its trainer worker (role TRAINER, with `--workers process`) or the
ranks of its trainer group (role RANK, index 0..N-1, with `--trainer-ranks N`), and its
generator replicas (role GENERATOR, index 0..n-1, with `--generators process`). `reserve` and
`release` bracket a resource's life (a Ray placement group holds one bundle per process); both
engines call them, and a second call is a no-op, so neither needs to know whether the other
runs processes too.

Imports: config, errors, engine.process; engine.ray_placement (and Ray) only with `--ray`.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from posttrain.config import EngineConfig
from posttrain.engine.process import TRAINER, WorkerProcess
from posttrain.errors import ConfigError

GENERATOR = "generator"
RANK = "rank"  # a rank of a --trainer-ranks N group (engine/trainer_group.py), index 0..N-1


class WorkerHandle(Protocol):
    """One started engine process, as its engine sees it."""

    label: str  # names it in errors
    dead: str | None  # why it died, once a call found it dead

    @property
    def pid(self) -> int | None: ...

    @property
    def alive(self) -> bool: ...

    def call(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run `engine.method(*args, **kwargs)` there; its exception is raised here, a dead
        process raises WorkerDied."""
        ...

    def stage(self, data: bytes) -> None:
        """A replica's staged change (a pickled `Staged`), without waiting for its calls; a
        dead replica misses it (it is rebuilt, not replayed)."""
        ...

    def stop(self) -> None: ...

    def kill(self) -> None:
        """End it now, without waiting for the call in flight."""
        ...


class Placement(Protocol):
    host: str  # where its processes reach this one (the weights broadcast's store)

    def reserve(self, resource_id: str, generator_replicas: int) -> None:
        """Make room for the resource's processes (idempotent while it lives)."""
        ...

    def start(
        self, resource_id: str, role: str, engine: tuple, *, label: str, index: int = 0
    ) -> WorkerHandle:
        """Start a process serving `engine` = (class, *args), built there as
        `class(config, model_paths, *args)`; a GENERATOR's class also takes its staging
        channel last."""
        ...

    def release(self, resource_id: str) -> None:
        """The resource's processes are stopped: free what `reserve` held (idempotent)."""
        ...

    def close(self) -> None:
        """Server shutdown: stop whatever is left (idempotent)."""
        ...


def trainer_processes(config: EngineConfig) -> int:
    """A resource's trainer processes: its group's ranks, its worker, or none (a thread)."""
    if config.trainer_ranks > 1:
        return config.trainer_ranks
    return 1 if config.workers == "process" else 0


def processes_per_resource(config: EngineConfig, generator_replicas: int) -> int:
    """How many processes a resource runs: its trainer's, then its replicas."""
    return trainer_processes(config) + (generator_replicas if config.generators == "process" else 0)


def bundle_index(config: EngineConfig, role: str, index: int) -> int:
    """A process's place among its resource's: the trainer (or rank `index`) first, then
    replica `index`."""
    if role in (TRAINER, RANK):
        return index
    return trainer_processes(config) + index


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
        self, resource_id: str, role: str, engine: tuple, *, label: str, index: int = 0
    ) -> WorkerProcess:
        if role in (TRAINER, RANK):
            return WorkerProcess(
                resource_id,
                self.config,
                self.model_paths,
                role=TRAINER if role == TRAINER else f"{role}{index}",
                label=label,
                engine=engine,
            )
        receive, send = multiprocessing.get_context("spawn").Pipe(duplex=False)
        worker = StagedWorkerProcess(
            resource_id,
            self.config,
            self.model_paths,
            role=f"{role}{index}",
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


def placement_for(config: EngineConfig, model_paths: dict[str, Path]) -> Placement:
    """`--ray` given: a RayPlacement (Ray imported now, and only then); else the local one."""
    if config.ray is None:
        return LocalPlacement(config, model_paths)
    try:
        from posttrain.engine.ray_placement import RayPlacement  # the optional extra
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
        raise ConfigError(
            "--ray needs Ray: pip install 'posttrain[ray]'", param="engine.ray"
        ) from None
    return RayPlacement(config, model_paths)
