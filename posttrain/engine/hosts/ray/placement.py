"""`posttrain serve --ray local|ADDRESS`: a resource's engine processes as Ray actors.

The only module that imports Ray; hosts/placement.py imports it only when `--ray` is given.
Each model resource gets a placement group (`reserve`), one bundle per process it runs (its
trainer worker or its `--trainer-ranks N` ranks, then each generator replica; PACK by default,
SPREAD with `--ray-strategy SPREAD`), removed when the resource unloads (`release`). A bundle is
`{"CPU": 1}`, and `{"CPU": 1, "GPU": 1}` when the engine runs on CUDA: each actor then sees one
GPU of its node (Ray sets CUDA_VISIBLE_DEVICES), as cuda:0. Each process is an
`EngineHost` actor in its bundle, hosting the same engine object a local worker process does
(LocalEngine, RankEngine, ReplicaEngine) and answering each message (hosts/messages.py: its
`run` on that engine) as the pipe does: a pickled `(kind, value)`, so results and posttrain's
errors arrive as themselves. The actors are named
`posttrain-<resource>-<role>-<n>` (role: worker, rank0, generator0, ...; n counts starts) in the
`posttrain` namespace, for operators and tests.

A replica's staged changes go to its actor's `stage` method, which runs beside a call (the
actor runs two at a time: one call, one stage), in fence order: the resource's one sender
thread (hosts/replicas/engine.py) sends them one at a time, and the replica's inbox thread takes
them (hosts/replicas/worker.py), so a busy replica never holds a weights-sync, a `stage` never
waits for the broadcast it announces, and none arrives out of order.

A callable field cannot cross to an actor: an inline generator's `between_tokens` (the
scheduler's hook that publishes PIPELINE weights-syncs mid-sample) is not passed, and those
syncs publish at their FIFO place instead (service/scheduling/publishing.py); with `--generators
process` PIPELINE installs still land mid-generation, since they are staged. A dead actor fails the
call in flight and every later one with WorkerDied naming it, as a dead worker process does.

`--ray local` starts a Ray instance on this machine (no dashboard) whose logical CPUs are the
machine's cores or, if more, the bundles of a few resources at `--max-generator-replicas`:
Ray's CPUs are places to schedule, not pinned cores. `--ray ADDRESS` joins a running cluster
whose nodes have posttrain installed. `close()` kills every actor, removes every group and
disconnects (a local instance stops with it). The instance's address is logged at start.

Imports: config, errors, engine.hosts (messages, placement, threads), model.loader; ray, torch.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar, cast

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import posttrain
from posttrain.config import EngineConfig
from posttrain.engine.hosts.messages import Message, callables, replaced
from posttrain.engine.hosts.placement import (
    GENERATOR,
    RANK,
    TRAINER,
    Hosted,
    Placement,
    StagedHandle,
    bundle_index,
    processes_per_resource,
)
from posttrain.engine.hosts.threads import WAIT_SETTINGS
from posttrain.errors import ConfigError, EngineFailure, ResourceExhausted, WorkerDied
from posttrain.model.loader import resolve_device

log = logging.getLogger("posttrain")

NAMESPACE = "posttrain"
# A placement group not placed within this many seconds: the cluster has no room for it.
READY_TIMEOUT_S = 120.0
# A local instance schedules at least this many resources at the replica bound at once.
LOCAL_RESOURCES = 4

C = TypeVar("C")  # the class of the engine an actor hosts
R = TypeVar("R")


class EngineHost:
    """The actor (`ray.remote` is applied at runtime): one engine object and its calls."""

    def __init__(
        self,
        config: EngineConfig,
        model_paths: dict[str, Path],
        engine: Hosted[Any],
        staged: bool,
    ) -> None:
        # A replica's changes arrive by `stage`, not on a pipe: its staging channel is None.
        self.engine = engine.build(config, model_paths, *((None,) if staged else ()))

    def pid(self) -> int:
        return os.getpid()

    def call(self, message: Message[Any, object]) -> bytes:
        answer: tuple[str, object]
        try:
            answer = ("ok", message.run(self.engine))
        except BaseException as exc:
            answer = ("error", exc)
        try:
            return pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # an unpicklable result or exception: say what it was
            return pickle.dumps(("error", EngineFailure(f"{type(answer[1]).__name__}: {exc}")))

    def stage(self, data: bytes) -> None:
        self.engine.receive(pickle.loads(data))


class RayWorker(StagedHandle[C], Generic[C]):
    """The API process's handle on one EngineHost actor (a WorkerHandle; a StagedHandle,
    whose `stage` does nothing unless it hosts a replica)."""

    def __init__(self, actor: Any, label: str, *, staged: bool) -> None:
        self.actor = actor
        self.label = label
        self.dead: str | None = None
        self._pid_ref = actor.pid.remote()  # resolved lazily: starts overlap
        self._pid: int | None = None
        self._lock = threading.Lock()  # one call at a time, as on a pipe
        self._staged = staged

    @property
    def pid(self) -> int | None:
        if self._pid is None:
            try:
                self._pid = ray.get(self._pid_ref)
            except ray.exceptions.RayError:
                return None
        return self._pid

    @property
    def alive(self) -> bool:
        return self.dead is None

    def call(self, message: Message[C, R]) -> R:
        # A callable cannot cross to an actor: see the module docstring.
        sent = replaced(message, {name: None for name in callables(message)})
        with self._lock:
            self._check()
            try:
                data = ray.get(self.actor.call.remote(sent))
            except ray.exceptions.RayActorError as exc:
                self._died(exc)
        kind, value = pickle.loads(data)
        if kind == "error":
            raise value
        return cast(R, value)  # what the message's `run` answered there

    def stage(self, data: bytes) -> None:
        """Deliver one staged change and wait for it (the actor's second thread takes it
        beside a running call); the resource's one sender thread (hosts/replicas/engine.py) calls
        this in fence order, so changes arrive in order."""
        if not self._staged or self.dead is not None:
            return
        try:
            ray.get(self.actor.stage.remote(data))
        except ray.exceptions.RayError:
            pass  # a dead replica misses it: it is rebuilt, not replayed

    def stop(self) -> None:
        """Kill the actor (its state is the resource's; nothing to flush)."""
        with self._lock:
            ray.kill(self.actor, no_restart=True)
            self.dead = self.dead or "stopped"

    def kill(self) -> None:
        """Kill it without waiting for the call in flight (which then fails WorkerDied)."""
        ray.kill(self.actor, no_restart=True)

    def _check(self) -> None:
        if self.dead is not None:
            raise WorkerDied(f"{self.label} {self.dead}")

    def _died(self, exc: ray.exceptions.RayActorError) -> NoReturn:
        why = (str(exc).strip().splitlines() or [""])[0][:200]  # Ray's first line says how
        self.dead = f"(pid {self.pid}) is gone ({type(exc).__name__}: {why})"
        raise WorkerDied(f"{self.label} {self.dead}")


class RayPlacement(Placement):
    def __init__(self, config: EngineConfig, model_paths: dict[str, Path]) -> None:
        self.config = config
        self.model_paths = model_paths
        self._groups: dict[str, PlacementGroup] = {}
        self._workers: dict[tuple[str, str, int], RayWorker[Any]] = {}
        self._lock = threading.Lock()
        self._started = 0
        self._host = ray.remote(EngineHost)
        # One GPU a process where the engine runs on CUDA (a trainer rank, a replica).
        cuda = resolve_device(config.device).type == "cuda"
        self._bundle = {"CPU": 1, "GPU": 1} if cuda else {"CPU": 1}
        if config.ray == "local":
            # Ray's workers import the posttrain this process runs, not another install's,
            # and compute with the threads a local worker process would (Ray would give each
            # one thread per bundle CPU; float sums then round differently).
            here = str(Path(posttrain.__file__).resolve().parents[1])
            path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
            threads = str(torch.get_num_threads())
            # ... and whose idle OpenMP threads wait as this process's do (hosts/threads.py).
            waits = {name: os.environ[name] for name in WAIT_SETTINGS if name in os.environ}
            cpus = max(os.cpu_count() or 1, LOCAL_RESOURCES * (1 + config.max_generator_replicas))
            ray.init(
                num_cpus=cpus,
                include_dashboard=False,
                namespace=NAMESPACE,
                runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": threads, **waits}},
            )
        else:
            try:
                ray.init(address=config.ray, namespace=NAMESPACE)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ConfigError(
                    f"--ray {config.ray}: cannot join that Ray cluster: {exc}", param="engine.ray"
                ) from exc
        self.address = ray.get_runtime_context().gcs_address
        # Where replicas reach this process's weights broadcast: a local instance's actors
        # are on this machine; a cluster's may be on other nodes.
        self.host: str = "127.0.0.1"
        if config.ray != "local":
            self.host = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # Ray's own
        log.info("posttrain: Ray placement on %s (address %s)", config.ray, self.address)

    def reserve(self, resource_id: str, generator_replicas: int) -> None:
        size = processes_per_resource(self.config, generator_replicas)
        with self._lock:
            if size == 0 or resource_id in self._groups:
                return
            group = placement_group(
                [self._bundle] * size,
                strategy=self.config.ray_strategy,
                name=f"posttrain-{resource_id}",
            )
            self._groups[resource_id] = group
        try:  # not holding the lock: other resources start meanwhile
            ray.get(group.ready(), timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.release(resource_id)
            raise ResourceExhausted(
                f"the Ray cluster has no room for model resource {resource_id}'s {size}"
                f" processes ({size} bundles of {self._bundle}, {self.config.ray_strategy})"
            ) from None

    def start(
        self, resource_id: str, role: str, engine: Hosted[C], *, label: str, index: int = 0
    ) -> RayWorker[C]:
        assert role in (TRAINER, RANK), f"{role} is not a trainer's role"
        return self._start(resource_id, role, engine, label=label, index=index)

    def start_replica(
        self, resource_id: str, engine: Hosted[C], *, label: str, index: int
    ) -> RayWorker[C]:
        return self._start(resource_id, GENERATOR, engine, label=label, index=index)

    def _start(
        self, resource_id: str, role: str, engine: Hosted[C], *, label: str, index: int
    ) -> RayWorker[C]:
        with self._lock:
            group = self._groups[resource_id]
            staged = role == GENERATOR
            self._started += 1  # a restarted process's name is new: the old one may linger
            place = role if role == TRAINER else f"{role}{index}"
            name = f"posttrain-{resource_id}-{place}-{self._started}"
            actor = self._host.options(
                name=name,
                num_cpus=1,
                num_gpus=self._bundle.get("GPU", 0),
                max_concurrency=2,  # a call and a stage at once
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=bundle_index(self.config, role, index)
                ),
            ).remote(self.config, self.model_paths, engine, staged)
            worker: RayWorker[C] = RayWorker(actor, label, staged=staged)
            self._workers[(resource_id, role, index)] = worker
            return worker

    def release(self, resource_id: str) -> None:
        with self._lock:
            group = self._groups.pop(resource_id, None)
            workers = [w for key, w in self._workers.items() if key[0] == resource_id]
            self._workers = {k: w for k, w in self._workers.items() if k[0] != resource_id}
        for worker in workers:
            if worker.dead != "stopped":
                worker.stop()
        if group is not None:
            remove_placement_group(group)

    def close(self) -> None:
        with self._lock:
            resources = list(self._groups)
        for resource_id in resources:
            self.release(resource_id)
        if ray.is_initialized():
            ray.shutdown()
