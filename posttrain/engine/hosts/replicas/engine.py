"""Generator replicas: a resource's sampling runs in processes of its own, beside its trainer.

`ReplicatedEngine` implements the LanedEngine protocol (engine/interface.py: the Engine protocol,
with a sample's generator lane and fence) over a trainer engine (LocalEngine in the API
process, or ProcessEngine) and `compute_config.num_generator_replicas` replica processes per
resource, each a `ReplicaEngine`: the same base model loaded again, serving every session's
generator and nothing else. The scheduler runs samples on generator lanes of their own, one per
replica (service/scheduling/worker.py): a free lane takes the next sample, so the load spreads, a
long sample never holds the trainer, and two replicas sample at the same time. Everything but
sampling goes to the trainer.

The lanes themselves (fences, staging under the resource's lock, a dead replica's restart, the
join rule's record) are hosts/lanes.py's GeneratorLanes, which VllmEngine shares; this module is
what differs for replica processes: how a replica starts and is reached, and how a change gets
there.

What each generator serves reaches the replicas as staged changes (hosts/replicas/staged.py):
create, drop, install. Each change of a resource has a number (its fence), and is sent to every
replica the moment the trainer makes it (a publish, a restore, a checkpoint load), without
waiting for a replica busy sampling: the resource's sender thread writes it down each replica's
one-way pipe (an install's bytes by broadcast in the resource's weights group,
hosts/replicas/weights_broadcast.py), and a thread in the replica receives it and keeps it. A
sample carries the fence of its place in its resource's FIFO; before it generates, the replica
applies every staged change up to that fence and none after it. So a sample submitted after a
weights-sync sees the new weights, and a sample submitted before it does not, whichever replica
runs it and whenever.
A PIPELINE weights-sync's install may also land between two decode passes of a generation that
is running (`mid_generation`): the replica applies it there, and its rows switch weights at that
token boundary, which policy_segments record (generate/generator.py).

A lane's samples run as a stream on its replica (`lane_stream`; FencedStream in
hosts/replicas/worker.py, driven step by step as hosts/remote_streams.py describes): a sample
handed to the lanes while every lane is busy joins a running generation at a block boundary,
its replica applying the changes staged up to the sample's fence first. The scheduler lets it
join only where none of those changes alters a session decoding there (`changed_sessions`;
service/scheduling/sample_streams.py), so running rows never see a change staged after their own
place.

A replica that dies fails the samples in flight with GeneratorReplicaDied (INTERNAL_ERROR naming
it); the trainer is untouched, and the next sample starts a new replica, rebuilt from what the
trainer's generators serve.

The replica side (the engine in each replica process) is hosts/replicas/worker.py.

Imports: config, errors, types, model.loader, engine (interface, memory: estimate, headroom;
hosts: lanes, messages, placement, process.local_placement, remote_streams; replicas: channel,
staged, weights_broadcast, worker).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import TypeVar

from transformers import AutoConfig

from posttrain.config import EngineConfig
from posttrain.engine.hosts.lanes import GeneratorLanes, Lanes
from posttrain.engine.hosts.messages import (
    CreateSession,
    InstallGenerator,
    LoadResource,
    Message,
    OpenStreamAtFence,
    Rebuilt,
    Received,
    SampleAtFence,
)
from posttrain.engine.hosts.placement import Placement
from posttrain.engine.hosts.process.local_placement import LocalPlacement
from posttrain.engine.hosts.remote_streams import RemoteStream
from posttrain.engine.hosts.replicas.channel import Channel, GeneratorReplica, in_buckets
from posttrain.engine.hosts.replicas.staged import (
    CreateGenerator,
    DropGenerator,
    InstallBucket,
    JoinGroup,
    ReplicaChange,
    Wake,
)
from posttrain.engine.hosts.replicas.weights_broadcast import Delivery, Root, pack
from posttrain.engine.hosts.replicas.worker import ReplicaEngine
from posttrain.engine.interface import DecodeStream, Engine, Headroom
from posttrain.engine.memory import estimate
from posttrain.engine.memory.headroom import headroom
from posttrain.errors import GeneratorReplicaDied, WorkerDied
from posttrain.model.loader import path_kv_shape, resolve_device, resolve_dtype
from posttrain.types import (
    LoraConfig,
    OperationKind,
    OperationRequest,
    SampleRequest,
    SampleResult,
)

# An install crosses in buckets of at most BUCKET_BYTES (a whole model is never one message),
# each a staged change of its own (hosts/replicas/staged.py), the last one saying so.
BUCKET_BYTES = 64 << 20

R = TypeVar("R")


class _Replicas(Lanes[GeneratorReplica]):
    """A resource's replica processes, and the channel their changes cross."""

    def __init__(self, base_model: str, shape: estimate.ModelShape, channel: Channel) -> None:
        super().__init__(base_model)
        self.shape = shape
        self.channel = channel


class ReplicatedEngine(GeneratorLanes[_Replicas, GeneratorReplica]):
    """A LanedEngine: the trainer engine for everything but sampling, replicas for that."""

    def __init__(
        self,
        trainer: Engine,
        config: EngineConfig,
        model_paths: dict[str, Path],
        placement: Placement | None = None,
    ) -> None:
        """`placement` starts the replicas (hosts/placement.py; default: local processes)."""
        super().__init__(trainer, nullcontext())  # trainer_forwarding.py says why no lock
        self.config = config
        self.model_paths = model_paths
        self.placement = placement or LocalPlacement(config, model_paths)

    # ------------------------------------------------------------ replica processes

    def _new_lanes(self, resource_id: str, base_model: str) -> _Replicas:
        broadcast = self.config.weights_transport == "broadcast"
        root = Root(self.placement.host, broadcast=broadcast, join=JoinGroup)
        return _Replicas(base_model, self._shape(base_model), Channel(resource_id, root))

    def _start(self, resource_id: str, state: _Replicas, count: int) -> list[GeneratorReplica]:
        # Started together, then loaded: their spawns and model loads overlap.
        self.placement.reserve(resource_id, count)
        started = [GeneratorReplica(resource_id, index, self.placement) for index in range(count)]
        for replica in started:
            replica.worker.call(LoadResource(resource_id, state.base_model, muon_scaling=None))
        return started

    def _rebuilt(self, resource_id: str, state: _Replicas, lane: int) -> GeneratorReplica:
        new = GeneratorReplica(resource_id, lane, self.placement)
        worker = new.worker
        worker.call(LoadResource(resource_id, state.base_model, muon_scaling=None))
        for session_id, lora in state.sessions.items():
            worker.call(CreateSession(resource_id, session_id, lora))
            tensors, version = self.trainer.generator_state(resource_id, session_id)
            worker.call(InstallGenerator(resource_id, session_id, tensors, version))
        worker.call(Rebuilt(state.fence))
        return new

    def _stop_lanes(self, state: _Replicas) -> None:
        for replica in state.replicas:
            replica.stop()
        state.channel.stop()  # after them: a broadcast to a stopped replica fails at once

    def _unloaded(self, resource_id: str) -> None:
        self.placement.release(resource_id)

    def _closed(self) -> None:
        self.placement.close()

    def _alive(self, replica: GeneratorReplica) -> bool:
        return replica.alive

    def _stop(self, replica: GeneratorReplica) -> None:
        replica.stop()

    def _pid(self, replica: GeneratorReplica) -> int | None:
        return replica.worker.pid

    def wait_received(self, resource_id: str) -> None:
        """Return once every live replica holds every change staged so far (not yet applied:
        a sample applies them at its fence). Staging never waits; this does, for operators
        and tests that need a PIPELINE install wholly on a replica before a generation."""
        state = self._required(resource_id)
        fence = self.generator_fence(resource_id)
        for replica in list(state.replicas):
            if replica.alive:
                replica.worker.call(Received(fence))

    def delivery(self, resource_id: str) -> Delivery:
        """How the resource's installs reached its replicas so far (weights_broadcast.py)."""
        return self._required(resource_id).channel.root.delivery

    # ------------------------------------------------------------ staged changes

    def _stage_create(
        self, resource_id: str, state: _Replicas, session_id: str, lora: LoraConfig | None
    ) -> None:
        self._stage(state, CreateGenerator(state.fence + 1, session_id, resource_id, lora))

    def _stage_drop(
        self, resource_id: str, state: _Replicas, session_id: str, lora: LoraConfig | None
    ) -> None:
        self._stage(state, DropGenerator(state.fence + 1, session_id, resource_id))

    def _stage_install(
        self, resource_id: str, state: _Replicas, session_id: str, *, mid_generation: bool
    ) -> None:
        """What the session's generator serves on the trainer now, in buckets, each a change."""
        tensors, version = self.trainer.generator_state(resource_id, session_id)
        buckets = in_buckets(tensors, BUCKET_BYTES)
        for index, tensors in enumerate(buckets):
            last = index == len(buckets) - 1
            bucket, buffer = pack(tensors)  # a copy: the trainer may move on at once
            change = InstallBucket(
                state.fence + 1, session_id, resource_id, bucket, version, mid_generation, last
            )
            self._record(state, change)
            state.channel.put_bucket(state.replicas, change, buffer)

    def _stage(self, state: _Replicas, change: ReplicaChange) -> None:
        """Caller holds state.lock."""
        self._record(state, change)
        state.channel.put(state.replicas, change)

    def wake_lanes(self, resource_id: str) -> None:
        """A wake down every replica's staging channel (after what is staged already)."""
        state = self._state(resource_id)
        if state is not None:
            state.channel.put(state.replicas, Wake())

    # ------------------------------------------------------------ sampling

    def lane_stream(
        self, resource_id: str, session_id: str, *, fence: int, lane: int
    ) -> DecodeStream:
        """A stream open on the lane's replica (its FencedStream, hosts/replicas/worker.py),
        driven step by step (hosts/remote_streams.py): samples handed to the lane join its
        running generation, each applying the changes staged up to its fence first. Bound to
        that replica: if it dies, the stream's operations fail with GeneratorReplicaDied."""
        replica = self._lane_replica(self._required(resource_id), resource_id, lane)
        stream_id = _on_replica(replica, OpenStreamAtFence(resource_id, session_id, fence))
        return RemoteStream(replica.worker.call, resource_id, stream_id, died=replica_died)

    def sample_batch(
        self,
        resource_id: str,
        items: list[tuple[str, SampleRequest]],
        *,
        between_tokens: Callable[[], None] | None = None,
        fence: int = 0,
        lane: int = 0,
    ) -> list[list[SampleResult]]:
        """One generation on the lane's replica, as of `fence`. A lane takes samples in FIFO
        order, so its replica's fences never go back: it never serves weights newer than a
        sample's place. `between_tokens` is not called: publishes reach the replicas as
        staged changes, PIPELINE ones mid-generation."""
        replica = self._lane_replica(self._required(resource_id), resource_id, lane)
        return _on_replica(replica, SampleAtFence(resource_id, items, fence))

    # ------------------------------------------------------------ memory

    def peak_bytes(
        self, resource_id: str, kind: OperationKind, items: list[tuple[str, OperationRequest]]
    ) -> int:
        """A sample's estimate from the model's shape alone, without asking a busy process."""
        if kind != OperationKind.SAMPLE:
            return self.trainer.peak_bytes(resource_id, kind, items)
        state = self._required(resource_id)
        requests = [request for _, request in items]
        assert all(isinstance(r, SampleRequest) for r in requests)
        chunk = self.config.logprob_chunk_tokens
        return estimate.sample_bytes(state.shape, requests, chunk_tokens=chunk)  # type: ignore[arg-type]

    def headroom(self, resource_id: str, kind: OperationKind | None = None) -> Headroom:
        """For a sample, the host's (or the device's) headroom seen from this process; the
        trainer's own for everything else."""
        if kind != OperationKind.SAMPLE:
            return self.trainer.headroom(resource_id, kind)
        return headroom(resolve_device(self.config.device), self.config.memory_limit)

    # The rest (training, checkpoints, limits, persistence) is the trainer's: TrainerForwarding.

    def _shape(self, base_model: str) -> estimate.ModelShape:
        path = self.model_paths[base_model]
        dtype = resolve_dtype(self.config.dtype, resolve_device(self.config.device))
        config, kv = AutoConfig.from_pretrained(path, local_files_only=True), path_kv_shape(path)
        return estimate.model_shape(config, kv, dtype.itemsize)


def replica_died(exc: WorkerDied) -> GeneratorReplicaDied:
    """A replica's death as its lane's operations report it: the trainer lives on."""
    return GeneratorReplicaDied(f"{exc}; a new replica starts with the next sample")


def _on_replica(replica: GeneratorReplica, message: Message[ReplicaEngine, R]) -> R:
    """`message` on the replica; its death reported as the replica's (replica_died)."""
    try:
        return replica.worker.call(message)
    except WorkerDied as exc:
        raise replica_died(exc) from exc
