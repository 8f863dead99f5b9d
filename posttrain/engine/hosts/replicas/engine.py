"""Generator replicas: a resource's sampling runs in processes of its own, beside its trainer.

`ReplicatedEngine` implements the LanedEngine protocol (engine/interface.py: the Engine protocol,
with a sample's generator lane and fence) over a trainer engine (LocalEngine in the API
process, or ProcessEngine) and `compute_config.num_generator_replicas` replica processes per
resource, each a `ReplicaEngine`: the same base model loaded again, serving every session's
generator and nothing else. The scheduler runs samples on generator lanes of their own, one per
replica (service/scheduling/worker.py): a free lane takes the next sample, so the load spreads, a
long sample never holds the trainer, and two replicas sample at the same time. Everything but
sampling goes to the trainer.

What each generator serves reaches the replicas as staged changes: create, drop, install. Each
change of a resource has a number (its fence), and is sent to every replica the moment the
trainer makes it (a publish, a restore, a checkpoint load), without waiting for a replica busy
sampling: the resource's sender thread writes it down each replica's one-way pipe (an
install's bytes by broadcast in the resource's weights group, hosts/replicas/weights_broadcast.py),
and a thread in the replica receives it and keeps it. A sample carries the
fence of its place in its resource's FIFO; before it generates, the replica applies every staged
change up to that fence and none after it. So a sample submitted after a weights-sync sees the
new weights, and a sample submitted before it does not, whichever replica runs it and whenever.
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

The replica side (the engine in each replica process, and the staged changes' format) is
hosts/replicas/worker.py.

Imports: config, errors, types, model.loader, engine (interface, memory: estimate, headroom;
hosts: local_placement, messages, placement, remote_streams, replica_channel, staged_changes,
weights_broadcast).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, TypeVar

from torch import Tensor
from transformers import AutoConfig

from posttrain.config import EngineConfig
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
from posttrain.engine.hosts.replicas.weights_broadcast import Delivery, Root, pack
from posttrain.engine.hosts.replicas.worker import ReplicaEngine
from posttrain.engine.hosts.staged_changes import StagedChanges
from posttrain.engine.hosts.trainer_forwarding import TrainerForwarding
from posttrain.engine.interface import DecodeStream, Engine, Headroom, LanedEngine
from posttrain.engine.memory import estimate
from posttrain.engine.memory.headroom import headroom
from posttrain.errors import GeneratorReplicaDied, NotFound, WorkerDied
from posttrain.model.loader import path_kv_shape, resolve_device, resolve_dtype
from posttrain.types import (
    LoraConfig,
    MuonScaling,
    OperationKind,
    OperationRequest,
    SampleRequest,
    SampleResult,
)

# An install crosses in buckets of at most BUCKET_BYTES (a whole model is never one message),
# each a staged change of its own (hosts/replicas/worker.py), the last one saying so.
BUCKET_BYTES = 64 << 20

T = TypeVar("T")
R = TypeVar("R")


class _Replicas:
    """A resource's replicas and what they must serve."""

    def __init__(self, base_model: str, shape: estimate.ModelShape, channel: Channel) -> None:
        self.base_model = base_model
        self.shape = shape
        self.channel = channel
        self.replicas: list[GeneratorReplica] = []
        self.sessions: dict[str, LoraConfig | None] = {}  # what the replicas host
        self.fence = 0  # the number of the last staged change
        # Which sessions a lane's stream would change by taking a later fence.
        self.changes = StagedChanges()
        # Held while the trainer changes what a generator serves and the change is staged,
        # so the fences follow the trainer's order and a rebuild reads no half-made change.
        self.lock = threading.RLock()


class ReplicatedEngine(TrainerForwarding, LanedEngine):
    """A LanedEngine: the trainer engine for everything but sampling, replicas for that."""

    def __init__(
        self,
        trainer: Engine,
        config: EngineConfig,
        model_paths: dict[str, Path],
        placement: Placement | None = None,
    ) -> None:
        """`placement` starts the replicas (hosts/placement.py; default: local processes)."""
        self.trainer = trainer
        self.trainer_lock = nullcontext()  # trainer_forwarding.py says why none
        self.config = config
        self.model_paths = model_paths
        self.placement = placement or LocalPlacement(config, model_paths)
        self._resources: dict[str, _Replicas] = {}
        self._lock = threading.Lock()  # the table

    # ------------------------------------------------------------ resources

    def load_resource(
        self,
        resource_id: str,
        base_model: str,
        *,
        muon_scaling: MuonScaling | None,
        generator_replicas: int = 1,
    ) -> None:
        self.trainer.load_resource(
            resource_id,
            base_model,
            muon_scaling=muon_scaling,
            generator_replicas=generator_replicas,
        )
        with self._lock:
            if resource_id in self._resources:
                return  # replicas live on through a trainer's reload; dead ones restart lazily
            root = Root(self.placement.host, broadcast=self.config.weights_transport == "broadcast")
            state = _Replicas(base_model, self._shape(base_model), Channel(resource_id, root))
            self._resources[resource_id] = state
        with state.lock:
            # Started together, then loaded: their spawns and model loads overlap.
            self.placement.reserve(resource_id, generator_replicas)
            started = [
                GeneratorReplica(resource_id, index, self.placement)
                for index in range(generator_replicas)
            ]
            for replica in started:
                replica.worker.call(LoadResource(resource_id, base_model, muon_scaling=None))
            state.replicas = started

    def unload_resource(self, resource_id: str) -> None:
        with self._lock:
            state = self._resources.pop(resource_id, None)
        if state is not None:
            for replica in state.replicas:
                replica.stop()
            state.channel.stop()  # after them: a broadcast to a stopped replica fails at once
        self.trainer.unload_resource(resource_id)
        self.placement.release(resource_id)

    def close(self) -> None:
        """Stop every replica and the trainer's workers (server shutdown)."""
        with self._lock:
            states, self._resources = list(self._resources.values()), {}
        for state in states:
            for replica in state.replicas:
                replica.stop()
            state.channel.stop()
        self.trainer.close()
        self.placement.close()

    def replica_pids(self, resource_id: str) -> list[int | None]:
        """The resource's replica process ids (for operators and the fault tests)."""
        state = self._state(resource_id)
        return [] if state is None else [r.worker.pid for r in state.replicas]

    def generator_lanes(self, resource_id: str) -> int:
        state = self._state(resource_id)
        return 0 if state is None else len(state.replicas)

    def generator_fence(self, resource_id: str) -> int:
        state = self._state(resource_id)
        if state is None:
            return 0
        with state.lock:  # never between two buckets of an install
            return state.fence

    def wait_received(self, resource_id: str) -> None:
        """Return once every live replica holds every change staged so far (not yet applied:
        a sample applies them at its fence). Staging never waits; this does, for operators
        and tests that need a PIPELINE install wholly on a replica before a generation."""
        state = self._required(resource_id)
        fence = self.generator_fence(resource_id)
        for replica in list(state.replicas):
            if replica.alive:
                replica.worker.call(Received(fence))

    # ------------------------------------------------------------ what generators serve

    def create_session(self, resource_id: str, session_id: str, lora: LoraConfig | None) -> None:
        state = self._required(resource_id)
        with state.lock:
            self.trainer.create_session(resource_id, session_id, lora)
            state.sessions[session_id] = lora
            self._stage(state, "create", (resource_id, session_id, lora))

    def drop_session(self, resource_id: str, session_id: str) -> None:
        self.trainer.drop_session(resource_id, session_id)
        state = self._state(resource_id)
        if state is None:
            return
        with state.lock:
            if state.sessions.pop(session_id, False) is not False:
                self._stage(state, "drop", (resource_id, session_id))

    def publish(
        self, resource_id: str, session_id: str, *, version: int, mid_generation: bool = False
    ) -> None:
        """weights-sync: the trainer's generator serves its weights, and every replica will
        (before the samples queued after this; PIPELINE: from the next token boundary)."""
        self._changing(
            resource_id,
            session_id,
            lambda: self.trainer.publish(resource_id, session_id, version=version),
            mid_generation=mid_generation,
        )

    def _changing(
        self,
        resource_id: str,
        session_id: str,
        change: Callable[[], T],
        *,
        mid_generation: bool = False,
    ) -> T:
        """Run a trainer call that changes what the session's generator serves, then stage
        what it serves now for every replica."""
        state = self._required(resource_id)
        with state.lock:
            result = change()
            tensors, version = self.trainer.generator_state(resource_id, session_id)
            buckets = in_buckets(tensors, BUCKET_BYTES)
            for index, tensors in enumerate(buckets):
                last = index == len(buckets) - 1
                bucket, buffer = pack(tensors)  # a copy: the trainer may move on at once
                args = (resource_id, session_id, bucket, version, mid_generation, last)
                self._stage(state, "install", args, buffer)
        return result

    def delivery(self, resource_id: str) -> Delivery:
        """How the resource's installs reached its replicas so far (weights_broadcast.py)."""
        return self._required(resource_id).channel.root.delivery

    def _stage(
        self, state: _Replicas, what: str, args: tuple[Any, ...], buffer: Tensor | None = None
    ) -> None:
        """Caller holds state.lock."""
        state.fence += 1
        state.changes.staged(state.fence, args[1], what == "install" and args[4])
        state.channel.put(state.replicas, (state.fence, what, args), buffer)

    def wake_lanes(self, resource_id: str) -> None:
        """A "wake" down every replica's staging channel (after what is staged already)."""
        state = self._state(resource_id)
        if state is not None:
            state.channel.put(state.replicas, (0, "wake", ()), None)

    def changed_sessions(self, resource_id: str, after: int, upto: int) -> frozenset[str] | None:
        state = self._required(resource_id)
        with state.lock:
            return state.changes.sessions(after, upto)

    # ------------------------------------------------------------ sampling

    def sample_stream(self, resource_id: str, session_id: str) -> DecodeStream | None:
        """None: samples run on generator lanes (lane_stream; training goes on beside them on
        the trainer's lane)."""
        return None

    def lane_stream(
        self, resource_id: str, session_id: str, *, fence: int, lane: int
    ) -> DecodeStream:
        """A stream open on the lane's replica (its FencedStream, hosts/replicas/worker.py),
        driven step by step (hosts/remote_streams.py): samples handed to the lane join its
        running generation, each applying the changes staged up to its fence first. Bound to
        that replica: if it dies, the stream's operations fail with GeneratorReplicaDied."""
        replica = self._lane_replica(resource_id, lane)
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
        replica = self._lane_replica(resource_id, lane)
        return _on_replica(replica, SampleAtFence(resource_id, items, fence))

    def _lane_replica(self, resource_id: str, lane: int) -> GeneratorReplica:
        """The lane's replica, a new one where it died (the lane's next sample starts it)."""
        state = self._required(resource_id)
        replica = state.replicas[lane]
        if not replica.alive:
            replica = self._restart(resource_id, state, lane, replica)
        return replica

    def _restart(
        self, resource_id: str, state: _Replicas, index: int, dead: GeneratorReplica
    ) -> GeneratorReplica:
        """A dead replica's successor, given what every generator serves on the trainer."""
        with state.lock:
            if state.replicas[index] is not dead:
                return state.replicas[index]  # another lane restarted it already
            dead.stop()
            new = GeneratorReplica(resource_id, index, self.placement)
            worker = new.worker
            worker.call(LoadResource(resource_id, state.base_model, muon_scaling=None))
            for session_id, lora in state.sessions.items():
                worker.call(CreateSession(resource_id, session_id, lora))
                tensors, version = self.trainer.generator_state(resource_id, session_id)
                worker.call(InstallGenerator(resource_id, session_id, tensors, version))
            worker.call(Rebuilt(state.fence))
            state.replicas[index] = new
            return new

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

    def _state(self, resource_id: str) -> _Replicas | None:
        with self._lock:
            return self._resources.get(resource_id)

    def _required(self, resource_id: str) -> _Replicas:
        state = self._state(resource_id)
        if state is None:
            raise NotFound(f"model resource {resource_id} is not loaded")
        return state

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
