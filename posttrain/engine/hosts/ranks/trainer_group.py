"""The trainer of each model resource split over a group of N rank processes
(`posttrain serve --trainer-ranks N`), data parallel (parallel/data_parallel.py).

`TrainerGroupEngine` is a RemoteEngine (remote.py) as ProcessEngine is, but
`load_resource` starts N worker processes for the resource through its Placement (local
processes, or Ray actors in the resource's placement group with `--ray`; hosts/placement.py),
each serving a `RankEngine`: a LocalEngine that
joins the resource's own torch.distributed group (gloo on CPU, NCCL on CUDA; its own TCP store
on a free port, so two resources' groups never meet) and marks its resource with its rank.

"Rank 0 takes commands and broadcasts them" (DESIGN.md) in its simplest form: this process
sends each command that changes a rank's state to every rank at once (rank 0 from the calling
thread, the others from a thread each) and answers with rank 0's result. The ranks then run
the same command in the same order, meeting in its collectives (the gather of logprobs and the
all-reduce of gradients), so every rank holds the same weights, optimizer state and generator
after every command (but a full-weight session's shards, below). What only reads a rank's
state (sampling, sizes, adapter and model exports) goes to rank 0 alone: its state is the
truth, and only it writes files; checkpoints and persisted state go to every rank, which
gather a sharded session's state onto rank 0 (RANK_ZERO). A sample on rank 0 alone leaves
the others' training state as it is (it moves only the sampler's prefix cache and random
numbers; a training checkpoint's RNG state is rank 0's).

Every rank holds a full replica of the base model and the LoRA adapters with their optimizer
state (replicated data parallel: each rank forwards about 1/N of a batch's tokens and runs
the whole optimizer step; measured in bench/trainer_ranks.py, where replicating the frozen
base is the choice for LoRA). A full-weight session shards the model itself with FSDP2
(parallel/fsdp.py): each rank holds 1/N of every parameter, gradient and AdamW/Muon moment,
and rank 0 alone the generator's copy.

A rank that dies fails the call in flight with WorkerDied naming the rank; its group is stopped
(the others would wait for it in the next collective), `is_loaded` answers False, and
`load_resource` starts a fresh group.

Calls that concern a base model, not a resource, run in the API process as in ProcessEngine.

Imports: config, errors, types, engine (parallel.data_parallel, hosts: in_process, messages,
placement, remote), model (loader); torch.distributed (the rendezvous store here, the process
group inside the ranks).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch

# Where torch's stubs declare it: torch.distributed re-exports it implicitly.
from torch._C._distributed_c10d import TCPStore

from posttrain.config import EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.hosts.messages import (
    GeneratorState,
    MeasureHeadroom,
    MeasureResourceFootprint,
    MeasureSessionFootprint,
    Message,
    OpenStream,
    PeakBytes,
    ResourceMessage,
    SampleBatch,
    SaveAdapter,
    StreamMessage,
)
from posttrain.engine.hosts.placement import RANK, Hosted, Placement, WorkerHandle
from posttrain.engine.hosts.process.remote import RemoteEngine
from posttrain.engine.hosts.threads import use_intra_op_threads
from posttrain.engine.parallel.data_parallel import DataParallel
from posttrain.errors import ConfigError, WorkerDied
from posttrain.model.loader import resolve_device
from posttrain.types import MuonScaling

# Served by rank 0 alone: they read a rank's state (or write files from it) and change nothing
# the next training command depends on. Not persist_session, save_training_state and
# save_full_model: a sharded session's parameters, optimizer state and gradients
# (parallel/fsdp.py) are gathered from every rank, so every rank takes part, and only rank 0
# writes (RankEngine.writes_files). A decode stream's messages (hosts/remote_streams.py) go
# to rank 0 alone too, under the group's lock in the order they are made, as its samples do;
# training between its blocks reaches every rank as always.
RANK_ZERO: tuple[type[Message[Any, Any]], ...] = (
    SampleBatch,
    OpenStream,
    StreamMessage,
    PeakBytes,
    MeasureHeadroom,
    MeasureResourceFootprint,
    MeasureSessionFootprint,
    GeneratorState,
    SaveAdapter,
)
# How long a rank waits in a collective for the others: a live group's ranks run the same
# message side by side, so only a rank that is gone (or wedged) makes one wait this long.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)

R = TypeVar("R")


class RankEngine(LocalEngine):
    """The engine of one rank of a resource's trainer group (runs in the rank's process)."""

    def __init__(
        self,
        config: EngineConfig,
        model_paths: dict[str, Path],
        rank: int,
        world: int,
        store: tuple[str, int],
    ) -> None:
        """`store`: (host, port) of the group's rendezvous, a TCPStore in the API process."""
        super().__init__(config, model_paths)
        # The ranks share the machine's cores; oversubscribed threads would slow them all.
        use_intra_op_threads(config.threads, processes=world, model_dirs=model_paths.values())
        backend = "gloo"
        if self.device.type == "cuda":
            # Local ranks see every GPU (rank r takes cuda:r); a Ray actor sees its own alone.
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
            backend = "nccl"
        host, port = store
        rendezvous = TCPStore(host, port, world, False, timeout=COLLECTIVE_TIMEOUT)
        torch.distributed.init_process_group(
            backend, store=rendezvous, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
        )
        self.group = DataParallel(rank, world)
        self.writes_files = rank == 0

    def load_resource(
        self,
        resource_id: str,
        base_model: str,
        *,
        muon_scaling: MuonScaling | None,
        generator_replicas: int = 1,
    ) -> None:
        super().load_resource(
            resource_id,
            base_model,
            muon_scaling=muon_scaling,
            generator_replicas=generator_replicas,
        )
        self._resource(resource_id).group = self.group

    def persist_session(
        self,
        resource_id: str,
        session_id: str,
        directory: Path,
        parts: Collection[str],
        record: dict[str, Any],
    ) -> None:
        """Rank 0 writes; another rank only takes part in gathering a sharded session's state."""
        if self.writes_files or self._is_sharded(resource_id, session_id):
            super().persist_session(resource_id, session_id, directory, parts, record)

    def save_training_state(self, resource_id: str, session_id: str, directory: Path) -> None:
        if self.writes_files or self._is_sharded(resource_id, session_id):
            super().save_training_state(resource_id, session_id, directory)

    def save_full_model(
        self, resource_id: str, session_id: str, directory: Path, *, base_model: str
    ) -> None:
        """Rank 0 writes; another rank only takes part in gathering sharded parameters."""
        if self.writes_files or self._resource(resource_id).param_shards is not None:
            super().save_full_model(resource_id, session_id, directory, base_model=base_model)

    def _is_sharded(self, resource_id: str, session_id: str) -> bool:
        return self._session(resource_id, session_id)[1].optimizer.sharding is not None


class _Group:
    """One resource's ranks, and the lock that keeps their commands in one order."""

    def __init__(self, resource_id: str, config: EngineConfig, placement: Placement):
        world = config.trainer_ranks
        # The rendezvous lives here, where every rank can reach it (on a Ray cluster the ranks
        # may be on other nodes); its port is the OS's, so two groups never meet.
        self._store = TCPStore(placement.host, 0, None, True, wait_for_workers=False)
        store = (placement.host, self._store.port)
        self.ranks: list[WorkerHandle[RankEngine]] = [
            placement.start(
                resource_id,
                RANK,
                Hosted(RankEngine, (rank, world, store)),
                label=f"rank {rank} of the trainer group of model resource {resource_id}",
                index=rank,
            )
            for rank in range(world)
        ]
        self._pool = ThreadPoolExecutor(
            max(1, world - 1), thread_name_prefix=f"ranks-{resource_id}"
        )
        # Reentrant: a PIPELINE publish runs inside rank 0's sample, on the sampling thread.
        self._lock = threading.RLock()
        self.died: WorkerDied | None = None  # the first rank's death, which ends the group

    @property
    def alive(self) -> bool:
        return self.died is None and all(rank.dead is None for rank in self.ranks)

    def call(self, message: Message[RankEngine, R]) -> R:
        """Rank 0's answer to the message; sent to every rank unless it is RANK_ZERO's."""
        with self._lock:
            if self.died is not None:
                raise self.died
            if isinstance(message, RANK_ZERO):
                return self._guarded(lambda: self.ranks[0].call(message))
            others = [self._pool.submit(rank.call, message) for rank in self.ranks[1:]]
            for future in others:
                future.add_done_callback(self._watch)
            error: BaseException | None = None
            try:
                answer = self.ranks[0].call(message)
            except BaseException as exc:
                error = exc
            outcomes = [future.exception() for future in others]
            # A rank that died explains the others' failures (a collective whose peer is gone).
            for outcome in (error, *outcomes):
                if isinstance(outcome, WorkerDied):
                    self._end(outcome)
            if self.died is not None:
                raise self.died
            for outcome in (error, *outcomes):
                if outcome is not None:
                    raise outcome  # rank 0's error; another rank's alone is never expected
            return answer

    def _guarded(self, call: Callable[[], R]) -> R:
        try:
            return call()
        except WorkerDied as exc:
            raise self._end(exc) from None

    def _watch(self, future: Future[Any]) -> None:
        exc = future.exception()
        if isinstance(exc, WorkerDied):
            self._end(exc)

    def _end(self, exc: WorkerDied) -> WorkerDied:
        """A rank is gone: stop the others, which would wait for it in their collectives;
        the death that ended the group (the first one)."""
        if self.died is None:
            self.died = exc
        for rank in self.ranks:
            rank.kill()
        return self.died

    def stop(self) -> None:
        for rank in self.ranks:
            rank.stop()
        self._pool.shutdown()


class TrainerGroupEngine(RemoteEngine[_Group]):
    """`--trainer-ranks N`: each resource in a group of N rank processes."""

    def _start(self, resource_id: str) -> _Group:
        return _Group(resource_id, self.config, self.placement)

    def _is_gone(self, host: _Group) -> bool:
        return not host.alive

    def rank_pids(self, resource_id: str) -> list[int | None]:
        """The process ids of the resource's ranks, rank 0 first (operators, fault tests)."""
        group = self._host(resource_id)
        return [] if group is None else [rank.pid for rank in group.ranks]

    def on_every_rank(self, message: ResourceMessage[RankEngine, R]) -> list[R]:
        """Each rank's answer to a read-only message, rank 0 first (tests that the ranks
        agree)."""
        group = self._host(message.resource_id)
        assert group is not None, f"model resource {message.resource_id} has no trainer group"
        return [rank.call(message) for rank in group.ranks]


def check_trainer_ranks(config: EngineConfig) -> None:
    """At start-up: a group has at most one rank per CUDA device, or per CPU core on CPU (more
    would only share them, slower than fewer ranks)."""
    if config.trainer_ranks == 1 or config.ray is not None:
        return  # on Ray the cluster's placement group says whether the ranks fit
    if resolve_device(config.device).type == "cuda":
        available, what = torch.cuda.device_count(), "CUDA devices"
    else:
        available, what = os.cpu_count() or 1, "CPU cores"
    if config.trainer_ranks > available:
        raise ConfigError(
            f"--trainer-ranks {config.trainer_ranks} is more than the {available} {what} of"
            " this machine",
            param="trainer_ranks",
        )
