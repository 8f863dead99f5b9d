"""Generator lanes: what a LanedEngine (engine/interface.py) with generators apart from its
trainer does whatever its generators are. `GeneratorLanes` is the one implementation that
ReplicatedEngine (hosts/replicas/engine.py: replica processes) and VllmEngine
(hosts/vllm/engine.py: vLLM servers) share; each keeps only what differs: how a replica is
started and reached, how a change's weights get there, and how it samples.

Per resource (`Lanes`): its replicas, one generator lane each; the sessions they serve; and the
fence, the number of the last staged change. Every change of what a session's generator serves
(a create, a drop, an install after a publish, a restore or a checkpoint load) is made on the
trainer and staged for the replicas under the resource's staging lock, so the fences follow the
trainer's order and a replica's rebuild reads no half-made change. Staging never waits for a
replica busy sampling: a sample carries the fence of its place in its resource's FIFO, and its
replica applies every change up to that fence, and none after it, before it generates. The
changes' record (hosts/staged_changes.py) answers the lanes' join rule (`changed_sessions`).

A lane whose replica died starts a new one with its next sample (`_lane_replica`), given what
every generator serves on the trainer as of the current fence; the trainer is untouched.

Imports: types, engine (interface; hosts: staged_changes, trainer_forwarding).
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

from posttrain.engine.hosts.staged_changes import StagedChange, StagedChanges
from posttrain.engine.hosts.trainer_forwarding import TrainerForwarding
from posttrain.engine.interface import DecodeStream, Engine, LanedEngine
from posttrain.errors import NotFound
from posttrain.types import LoraConfig, MuonScaling

P = TypeVar("P")  # one replica, as its engine reaches it
S = TypeVar("S", bound="Lanes[Any]")  # a resource's lanes, with what its engine adds
T = TypeVar("T")


class Lanes(Generic[P]):
    """A resource's generator lanes and what they must serve."""

    def __init__(self, base_model: str) -> None:
        self.base_model = base_model
        self.replicas: list[P] = []  # lane i runs on replicas[i]
        self.sessions: dict[str, LoraConfig | None] = {}  # what the replicas serve
        self.fence = 0  # the number of the last staged change
        self.staged = StagedChanges()  # the lanes' join rule (changed_sessions)
        # Held while the trainer changes what a generator serves and the change is staged,
        # so the fences follow the trainer's order and a rebuild reads no half-made change.
        self.lock = threading.RLock()


class GeneratorLanes(TrainerForwarding, LanedEngine, Generic[S, P]):
    """A LanedEngine: the trainer engine for everything but sampling, replicas (P) on generator
    lanes for that, one resource's in an S."""

    def __init__(self, trainer: Engine, trainer_lock: AbstractContextManager[object]) -> None:
        self.trainer = trainer
        self.trainer_lock = trainer_lock  # trainer_forwarding.py says when one is needed
        self._resources: dict[str, S] = {}
        self._lock = threading.Lock()  # the table

    # ------------------------------------------------------------ what differs, per host

    @abstractmethod
    def _new_lanes(self, resource_id: str, base_model: str) -> S:
        """A loaded resource's lanes, none started yet (called under the table's lock)."""

    @abstractmethod
    def _start(self, resource_id: str, state: S, count: int) -> list[P]:
        """`count` replicas, ready to serve (the caller holds state.lock)."""

    @abstractmethod
    def _rebuilt(self, resource_id: str, state: S, lane: int) -> P:
        """A new replica for `lane`, serving what every session's generator serves on the
        trainer, as of state.fence (the caller holds state.lock)."""

    @abstractmethod
    def _stop_lanes(self, state: S) -> None:
        """Stop the resource's replicas, and what carried changes to them."""

    @abstractmethod
    def _alive(self, replica: P) -> bool: ...

    @abstractmethod
    def _stop(self, replica: P) -> None: ...

    @abstractmethod
    def _pid(self, replica: P) -> int | None: ...

    @abstractmethod
    def _stage_create(
        self, resource_id: str, state: S, session_id: str, lora: LoraConfig | None
    ) -> None:
        """Stage a new session for the replicas (the caller holds state.lock)."""

    @abstractmethod
    def _stage_drop(
        self, resource_id: str, state: S, session_id: str, lora: LoraConfig | None
    ) -> None:
        """Stage a session's end (the caller holds state.lock)."""

    @abstractmethod
    def _stage_install(
        self, resource_id: str, state: S, session_id: str, *, mid_generation: bool
    ) -> None:
        """Stage what the session's generator serves on the trainer now (the caller holds
        state.lock); `mid_generation`: a PIPELINE install, which may land between two decode
        passes of a running generation."""

    def _trainer_replicas(self, generator_replicas: int) -> int:
        """The `generator_replicas` the trainer's load_resource is given."""
        return generator_replicas

    def _installed_mid_generation(self, state: S, replicas: list[P]) -> None:
        """After a PIPELINE install is staged, outside the staging lock: where replicas do not
        take such installs by themselves between decode passes, hand it to those generating."""

    def _unloaded(self, resource_id: str) -> None:
        """After the trainer unloaded the resource."""

    def _closed(self) -> None:
        """After the trainer closed."""

    # ------------------------------------------------------------ resources

    def load_resource(
        self,
        resource_id: str,
        base_model: str,
        *,
        muon_scaling: MuonScaling | None,
        generator_replicas: int = 1,
    ) -> None:
        with self.trainer_lock:
            self.trainer.load_resource(
                resource_id,
                base_model,
                muon_scaling=muon_scaling,
                generator_replicas=self._trainer_replicas(generator_replicas),
            )
        with self._lock:
            if resource_id in self._resources:
                return  # replicas live on through a trainer's reload; dead ones restart lazily
            state = self._new_lanes(resource_id, base_model)
            self._resources[resource_id] = state
        with state.lock:
            state.replicas = self._start(resource_id, state, generator_replicas)

    def unload_resource(self, resource_id: str) -> None:
        with self._lock:
            state = self._resources.pop(resource_id, None)
        if state is not None:
            self._stop_lanes(state)
        with self.trainer_lock:
            self.trainer.unload_resource(resource_id)
        self._unloaded(resource_id)

    def close(self) -> None:
        """Stop every replica and the trainer (server shutdown)."""
        with self._lock:
            states, self._resources = list(self._resources.values()), {}
        for state in states:
            self._stop_lanes(state)
        with self.trainer_lock:
            self.trainer.close()
        self._closed()

    def replica_pids(self, resource_id: str) -> list[int | None]:
        """The resource's replica process ids, by lane (for operators and the fault tests)."""
        state = self._state(resource_id)
        return [] if state is None else [self._pid(r) for r in state.replicas]

    def generator_lanes(self, resource_id: str) -> int:
        state = self._state(resource_id)
        return 0 if state is None else len(state.replicas)

    def generator_fence(self, resource_id: str) -> int:
        state = self._state(resource_id)
        if state is None:
            return 0
        with state.lock:  # never between two changes of one install
            return state.fence

    def changed_sessions(self, resource_id: str, after: int, upto: int) -> frozenset[str] | None:
        state = self._required(resource_id)
        with state.lock:
            return state.staged.sessions(after, upto)

    # ------------------------------------------------------------ what generators serve

    def create_session(self, resource_id: str, session_id: str, lora: LoraConfig | None) -> None:
        state = self._required(resource_id)
        with state.lock:
            with self.trainer_lock:
                self.trainer.create_session(resource_id, session_id, lora)
            state.sessions[session_id] = lora
            self._stage_create(resource_id, state, session_id, lora)

    def drop_session(self, resource_id: str, session_id: str) -> None:
        with self.trainer_lock:
            self.trainer.drop_session(resource_id, session_id)
        state = self._state(resource_id)
        if state is None:
            return
        with state.lock:
            if session_id in state.sessions:
                lora = state.sessions.pop(session_id)
                self._stage_drop(resource_id, state, session_id, lora)

    def publish(
        self, resource_id: str, session_id: str, *, version: int, mid_generation: bool = False
    ) -> None:
        """weights-sync: the trainer's generator serves its weights, and every replica will
        (before the samples queued after this; PIPELINE: from the next token boundary)."""

        def publish() -> None:
            with self.trainer_lock:
                self.trainer.publish(resource_id, session_id, version=version)

        self._changing(resource_id, session_id, publish, mid_generation=mid_generation)

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
            self._stage_install(resource_id, state, session_id, mid_generation=mid_generation)
            replicas = list(state.replicas)
        if mid_generation:  # outside the staging lock: a replica's own lock comes first
            self._installed_mid_generation(state, replicas)
        return result

    def _record(self, state: S, change: StagedChange[Any]) -> None:
        """`change` is the resource's latest (its fence the next): for generator_fence and
        the join rule. The caller holds state.lock, and sends it on to the replicas."""
        state.fence = change.fence
        state.staged.staged(change)

    # ------------------------------------------------------------ sampling

    def sample_stream(self, resource_id: str, session_id: str) -> DecodeStream | None:
        """None: samples run on generator lanes (lane_stream; training goes on beside them on
        the trainer's lane)."""
        return None

    def _lane_replica(self, state: S, resource_id: str, lane: int) -> P:
        """The lane's replica, a new one where it died (the lane's next sample starts it)."""
        replica: P = state.replicas[lane]
        if not self._alive(replica):
            replica = self._restart(resource_id, state, lane, replica)
        return replica

    def _restart(self, resource_id: str, state: S, lane: int, dead: P) -> P:
        """A dead replica's successor, given what every generator serves on the trainer."""
        with state.lock:
            current: P = state.replicas[lane]
            if current is not dead:
                return current  # another caller restarted it already
            self._stop(dead)
            new = self._rebuilt(resource_id, state, lane)
            state.replicas[lane] = new
            return new

    # ------------------------------------------------------------ the table

    def _state(self, resource_id: str) -> S | None:
        with self._lock:
            return self._resources.get(resource_id)

    def _required(self, resource_id: str) -> S:
        state = self._state(resource_id)
        if state is None:
            raise NotFound(f"model resource {resource_id} is not loaded")
        return state
