"""The engine inside a generator replica process (hosts/replicas/engine.py): every session's
generator and nothing else, fed by staged changes (hosts/replicas/staged.py).

What is staged arrives in fence order on the staging pipe (a thread here reads it) or by
`receive` calls (a Ray actor's, hosts/ray/placement.py); an inbox thread takes each arrival in
that order and runs its handler (`Arrival.arrive`): a change is kept until a sample's fence
reaches it (an install's bucket once its bytes are here, by broadcast where they come so), a
wake stops a lane's several-block stream call at its next boundary, a join forms the resource's
weights group. A sample applies the changes kept up to its fence (`ReplicaChange.apply`), and
PIPELINE installs land between its decode passes.

Imports: config, types, engine (state, generate: generator, sample_stream; optim.optimizer;
hosts: in_process, messages; replicas: staged, weights_broadcast).
"""

from __future__ import annotations

import pickle
import queue
import threading
from collections.abc import Callable, Collection
from multiprocessing.connection import Connection
from pathlib import Path

from torch import Tensor, nn

from posttrain.config import EngineConfig
from posttrain.engine.generate.generator import generator_key
from posttrain.engine.generate.sample_stream import JoinRoom, SessionSampleStream
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.hosts.messages import HostedStream, ReplicaHosting
from posttrain.engine.hosts.replicas.staged import (
    Arrival,
    InstallBucket,
    JoinGroup,
    ReplicaChange,
)
from posttrain.engine.hosts.replicas.weights_broadcast import Bucket, Member, buffer_of
from posttrain.engine.optim.optimizer import SessionOptimizer
from posttrain.engine.state import ResourceState, SessionState
from posttrain.types import SampleRequest, SampleResult


class ReplicaEngine(LocalEngine, ReplicaHosting):
    """The engine inside a replica process: sessions' generators only, fed by staged changes."""

    def __init__(
        self, config: EngineConfig, model_paths: dict[str, Path], staging: Connection | None
    ):
        """`staging`: the pipe its changes arrive on; None where they arrive by `receive`
        calls instead (a Ray actor's, hosts/ray/placement.py)."""
        super().__init__(config, model_paths)
        self._staged: list[ReplicaChange] = []
        self._received = 0  # the highest fence received (or rebuilt up to)
        # session -> the tensors of an install not yet whole
        self._buckets: dict[str, dict[str, Tensor]] = {}
        self._arrived = threading.Condition()
        self._inbox: queue.SimpleQueue[Arrival] = queue.SimpleQueue()
        self._member = Member()  # of the resource's weights group, once it forms
        # Set by a wake (a sample was handed to the lanes): a stream's several-block call
        # stops at its next boundary (FencedStream.block).
        self._woken = threading.Event()
        threading.Thread(target=self._take, daemon=True).start()
        if staging is not None:
            threading.Thread(target=self._read, args=(staging,), daemon=True).start()

    def _read(self, staging: Connection) -> None:
        while True:
            try:
                arrival: Arrival = pickle.loads(staging.recv_bytes())
            except (EOFError, OSError):
                return  # the API process is gone
            self.receive(arrival)

    def receive(self, arrival: Arrival) -> None:
        """A staged change (or a wake, or a weights group message), for the inbox thread:
        never waits (a Ray actor's `stage` call returns before the broadcast it announces)."""
        self._inbox.put(arrival)

    def _take(self) -> None:
        while True:
            self._inbox.get().arrive(self)

    # ------------------------------------------------------------ the inbox (staged.Inbox)

    def join_group(self, join: JoinGroup) -> None:
        self._member.join(join.host, join.port, join.prefix, join.rank, join.size)

    def wake(self) -> None:
        self._woken.set()

    def bucket_bytes(self, bucket: Bucket) -> Tensor | None:
        if bucket.data is None:  # its bytes come by broadcast
            return self._member.receive(bucket)  # None: the root resends it down the pipe
        return buffer_of(bucket)

    def keep(self, change: ReplicaChange) -> None:
        """Keep a staged change until a sample's fence reaches it; one received already (a
        resend after a broken broadcast, or one from before a rebuild) is dropped."""
        with self._arrived:
            if change.fence <= self._received:
                return
            self._staged.append(change)
            self._received = change.fence
            self._arrived.notify_all()

    def _create_full_weight_session(self, resource: ResourceState, session_id: str) -> None:
        """A replica never trains: its full-weight session serves the resource's own model,
        which installs overwrite, instead of a second copy (half a trainer's memory); ending
        the session puts the base weights back, as on the trainer."""
        assert not resource.sessions, "a full-weight session shares its resource with no one"
        model: nn.Module = resource.loaded.model
        model.eval()
        resource.sessions[session_id] = SessionState(
            session_id, generator_key(session_id), SessionOptimizer([]), generator_model=model
        )

    def woken(self) -> bool:
        """Whether a wake arrived since the last call that said so."""
        if not self._woken.is_set():
            return False
        self._woken.clear()
        return True

    def rebuilt(self, fence: int) -> None:
        """A new replica was given the state as of `fence` directly: nothing before it is due."""
        with self._arrived:
            self._received = max(self._received, fence)
            self._staged = [c for c in self._staged if c.fence > fence]

    def received(self, fence: int) -> None:
        """Return once every change up to `fence` is here (kept, not yet applied)."""
        with self._arrived:
            while self._received < fence:
                self._arrived.wait()

    def sample_batch(
        self,
        resource_id: str,
        items: list[tuple[str, SampleRequest]],
        *,
        between_tokens: Callable[[], None] | None = None,
        fence: int = 0,
    ) -> list[list[SampleResult]]:
        """The generation at its FIFO place: apply the changes up to `fence`, then sample;
        PIPELINE installs that arrive meanwhile land between decode passes. The replica is one
        generator lane of a LanedEngine (hosts/replicas/engine.py sends it the sample's fence), so
        it takes no lane; nor a `between_tokens`: its own hook (`_mid_generation`) runs there."""
        assert between_tokens is None, "a replica runs its own hook between decode passes"
        self.advance(fence)
        return super().sample_batch(resource_id, items, between_tokens=self._mid_generation)

    def open_stream(self, resource_id: str, session_id: str, fence: int = 0) -> int:
        """A lane's stream (StreamHost.open_stream), its generator as of `fence` (the first
        operations' place): their sessions exist here from then on. A FencedStream:
        operations bring their fence to `admit`, and PIPELINE installs land before any
        block."""
        self.advance(fence)
        stream = FencedStream(self.sample_stream(resource_id, session_id), self)
        return self._opened(resource_id, stream)

    def advance(self, fence: int) -> None:
        """Apply every change staged up to `fence` (waiting for those not received yet)."""
        self.received(fence)
        with self._arrived:
            due = [c for c in self._staged if c.fence <= fence]
            self._staged = [c for c in self._staged if c.fence > fence]
        for change in due:
            change.apply(self)

    def _mid_generation(self) -> None:
        """Between decode passes: apply each session's staged PIPELINE installs that nothing
        staged before them, for that session, holds back, once every bucket of an install
        has arrived (a generation never runs on half-installed weights)."""
        with self._arrived:
            held: set[str] = set()
            due: list[ReplicaChange] = []
            run: dict[str, list[ReplicaChange]] = {}  # a session's buckets of an unfinished install
            for change in list(self._staged):
                session_id = change.session_id
                if session_id in held:
                    continue
                if (
                    isinstance(change, InstallBucket)
                    and change.mid_generation
                    and self.is_loaded(change.resource_id)
                ):
                    run.setdefault(session_id, []).append(change)
                    if change.last:  # its last bucket: the whole install is here
                        due += run.pop(session_id)
                else:
                    held.add(session_id)
            for change in due:
                self._staged.remove(change)
        for change in due:
            change.apply(self)

    def install_bucket(
        self,
        resource_id: str,
        session_id: str,
        tensors: dict[str, Tensor],
        *,
        version: int,
        last: bool,
    ) -> None:
        """A bucket of an install (staged.InstallBucket); the last one installs them all."""
        parts = self._buckets.setdefault(session_id, {})
        parts.update(tensors)
        if last:
            del self._buckets[session_id]
            self.install_generator(resource_id, session_id, parts, version=version)


class FencedStream(HostedStream):
    """A replica's decode stream (a DecodeStream, engine/interface.py, driven by its lane through
    hosts/remote_streams.py's messages): operations joining bring the fence of their place in
    the resource's FIFO, and the changes staged up to it are applied before they are admitted.
    The lane admits only operations whose fence changes no session decoding here (service/
    sample_streams.py), so running rows keep their weights; PIPELINE installs land before each
    block, as between the decode passes of a whole batch (`_mid_generation`), and the running
    rows of their sessions switch there (policy_segments)."""

    def __init__(self, stream: SessionSampleStream, engine: ReplicaEngine) -> None:
        self.stream = stream  # the replica's own (generate/sample_stream.py)
        self.engine = engine

    def can_join(self, session_id: str) -> bool:
        """A replica's sessions all sample the resource's one model (a full-weight session
        serves the resource's own model, and shares it with no other), so any may join; one
        whose create is still staged (its fence is ahead of the stream's) is not here yet."""
        return True

    def admit(
        self,
        items: list[tuple[str, SampleRequest]],
        fence: int = 0,
        *,
        row_limit: int = 0,
        spare_bytes: int = 0,
    ) -> list[int]:
        self.engine.advance(fence)
        return self.stream.admit(items, row_limit=row_limit, spare_bytes=spare_bytes)

    def block(self, most: int = 1) -> None:
        """Up to `most` blocks, each after the PIPELINE installs due: fewer where a sequence
        ended, or a wake arrived (a sample waits to join; one that arrived before this call
        stops it after one block, which only costs a round trip)."""
        self.stream.block(most, between=self.engine._mid_generation, woken=self.engine.woken)

    def take_finished(self) -> list[tuple[int, list[SampleResult]]]:
        return self.stream.take_finished()

    def follow(self, ids: Collection[int]) -> None:
        self.stream.follow(ids)

    def take_progress(self) -> list[tuple[int, list[list[int]]]]:
        return self.stream.take_progress()

    def running_rows(self) -> int:
        return self.stream.running_rows()

    def fits(self, items: list[tuple[str, SampleRequest]], spare_bytes: int) -> bool:
        return self.stream.fits(items, spare_bytes)

    def room(self) -> JoinRoom:
        return self.stream.room()

    def close(self) -> None:
        self.stream.close()
