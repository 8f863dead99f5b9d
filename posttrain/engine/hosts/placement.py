"""What a placement is: the one seam through which a model resource's processes are started.

The remote engines (hosts/process/remote.py's ProcessEngine, hosts/ranks/trainer_group.py's ranks)
and ReplicatedEngine (hosts/replicas/engine.py, the generator replicas) start every process they
need through a `Placement`, and talk to it through the `WorkerHandle` it returns: a process
hosting an engine of class C (`Hosted[C]`) is a WorkerHandle[C], which takes the messages
(hosts/messages.py) whose handlers C can run, and only those. Two placements
implement it: hosts/process/local_placement.py (the default: child processes on this machine) and
hosts/ray/placement.py (`--ray local|ADDRESS`: Ray actors, one placement group per resource);
engine/build.py picks one.

A resource's processes are its trainer worker (role TRAINER, with `--workers process`) or the
ranks of its trainer group (role RANK, index 0..N-1, with `--trainer-ranks N`), and its
generator replicas (role GENERATOR, index 0..n-1, with `--generators process`; `start_replica`,
whose handle also takes staged changes). `reserve` and
`release` bracket a resource's life (a Ray placement group holds one bundle per process); both
engines call them, and a second call is a no-op, so neither needs to know whether the other
runs processes too.

Imports: config, engine.hosts.messages. It imports no placement: they import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from posttrain.config import EngineConfig
from posttrain.engine.hosts.messages import Message

# The roles of a resource's processes, which name them and order their places.
TRAINER = "worker"  # a resource's one trainer worker (`--workers process`)
GENERATOR = "generator"
RANK = "rank"  # a rank of a --trainer-ranks N group (hosts/ranks/trainer_group.py), index 0..N-1


C = TypeVar("C")  # the class of the engine a process hosts
C_co = TypeVar("C_co", covariant=True)
R = TypeVar("R")


@dataclass(frozen=True)
class Hosted(Generic[C]):
    """The engine a process serves, built there (pickled across, the class by name)."""

    engine_class: Callable[..., C]  # called as (config, model_paths, *args, *extra)
    args: tuple[Any, ...] = ()

    def build(self, config: EngineConfig, model_paths: dict[str, Path], *extra: object) -> C:
        """`extra`: what the placement adds (a replica's staging channel)."""
        return self.engine_class(config, model_paths, *self.args, *extra)


class WorkerHandle(Protocol[C_co]):
    """One started engine process, as its engine sees it; the engine there is a C_co."""

    label: str  # names it in errors
    dead: str | None  # why it died, once a call found it dead

    @property
    def pid(self) -> int | None: ...

    @property
    def alive(self) -> bool: ...

    def call(self, message: Message[C_co, R]) -> R:
        """Run the message's handler on the engine there; its exception is raised here, a
        dead process raises WorkerDied."""
        ...

    def stop(self) -> None: ...

    def kill(self) -> None:
        """End it now, without waiting for the call in flight."""
        ...


class StagedHandle(WorkerHandle[C_co], Protocol):
    """A generator replica's process: its calls, and its staged changes beside them."""

    def stage(self, data: bytes) -> None:
        """A replica's staged change (a pickled `Arrival`, hosts/replicas/staged.py), without
        waiting for its calls; a dead replica misses it (it is rebuilt, not replayed)."""
        ...


class Placement(Protocol):
    host: str  # where its processes reach this one (the weights broadcast's store)

    def reserve(self, resource_id: str, generator_replicas: int) -> None:
        """Make room for the resource's processes (idempotent while it lives)."""
        ...

    def start(
        self, resource_id: str, role: str, engine: Hosted[C], *, label: str, index: int = 0
    ) -> WorkerHandle[C]:
        """Start a TRAINER or RANK process serving `engine`, built there as
        `engine.build(config, model_paths)`."""
        ...

    def start_replica(
        self, resource_id: str, engine: Hosted[C], *, label: str, index: int
    ) -> StagedHandle[C]:
        """Start GENERATOR replica `index`, as `start` does; its engine is also given its
        staging channel (a Connection to read, or None where `stage` calls bring the
        changes)."""
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
