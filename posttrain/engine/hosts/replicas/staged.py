"""What crosses a generator replica's staging channel (hosts/replicas/engine.py sends it, in
order; hosts/replicas/worker.py's inbox thread takes it): frozen dataclasses, one per kind, each
with its handlers, so the checker sees each kind's fields and what its handlers need.

`Arrival.arrive` is the handler on the replica's inbox thread, in the order they arrive:
- `JoinGroup`: join the resource's weights group (hosts/replicas/weights_broadcast.py).
- `Wake`: a sample was handed to the lanes: a lane's stream running several blocks in one call
  stops at its next boundary (FencedStream.block).
- a `ReplicaChange` (a staged change, hosts/staged_changes.py) is kept until a sample's fence
  reaches it; an `InstallBucket` first receives its bytes, by broadcast where they come so.

`ReplicaChange.apply` is a change's handler on the replica's engine, at the change's fence:
- `CreateGenerator`: a session's generator, from the base model.
- `DropGenerator`: a session's end.
- `InstallBucket`: one bucket of what a session's generator serves (an install crosses in
  buckets, hosts/replicas/channel.py's `in_buckets`); the last one installs them all.

Imports: types, engine (hosts: staged_changes, replicas.weights_broadcast); torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Protocol

from torch import Tensor

from posttrain.engine.hosts.replicas.weights_broadcast import Bucket, unpack
from posttrain.engine.hosts.staged_changes import StagedChange
from posttrain.types import LoraConfig

# ---------------------------------------------------------------- what handlers need


class Applying(Protocol):
    """What a change needs of the replica's engine (hosts/replicas/worker.py's ReplicaEngine)."""

    def create_session(
        self, resource_id: str, session_id: str, lora: LoraConfig | None
    ) -> None: ...

    def drop_session(self, resource_id: str, session_id: str) -> None: ...

    def install_bucket(
        self,
        resource_id: str,
        session_id: str,
        tensors: dict[str, Tensor],
        *,
        version: int,
        last: bool,
    ) -> None: ...


class Inbox(Protocol):
    """What an arrival needs of the replica's inbox (ReplicaEngine, on its inbox thread)."""

    def join_group(self, join: JoinGroup) -> None: ...

    def wake(self) -> None: ...

    # The bucket's bytes: its own, or from the weights group's broadcast; None where the group
    # broke (the root resends the same change down the pipe with them).
    def bucket_bytes(self, bucket: Bucket) -> Tensor | None: ...

    def keep(self, change: ReplicaChange) -> None: ...


# ---------------------------------------------------------------- arrivals


class Arrival(ABC):
    """One message down a replica's staging channel."""

    @abstractmethod
    def arrive(self, inbox: Inbox) -> None:
        """Its handler on the replica's inbox thread."""


@dataclass(frozen=True)
class JoinGroup(Arrival):
    """Form the resource's weights group: this replica is member `rank` of `size`, on the
    root's store at host:port under `prefix` (weights_broadcast.Root sends one to each)."""

    host: str
    port: int
    prefix: str
    rank: int
    size: int

    def arrive(self, inbox: Inbox) -> None:
        inbox.join_group(self)


@dataclass(frozen=True)
class Wake(Arrival):
    def arrive(self, inbox: Inbox) -> None:
        inbox.wake()


@dataclass(frozen=True)
class ReplicaChange(StagedChange[Applying], Arrival):
    """A staged change of one of the resource's sessions."""

    resource_id: str

    def arrive(self, inbox: Inbox) -> None:
        inbox.keep(self)


@dataclass(frozen=True)
class CreateGenerator(ReplicaChange):
    lora: LoraConfig | None

    def apply(self, generator: Applying) -> None:
        # Dropped first: a trainer rebuilt after its death creates its sessions again.
        generator.drop_session(self.resource_id, self.session_id)
        generator.create_session(self.resource_id, self.session_id, self.lora)


@dataclass(frozen=True)
class DropGenerator(ReplicaChange):
    def apply(self, generator: Applying) -> None:
        generator.drop_session(self.resource_id, self.session_id)


@dataclass(frozen=True)
class InstallBucket(ReplicaChange):
    """One bucket of an install. It crosses with `bucket` (its layout, and its bytes where they
    do not come by broadcast); the replica keeps it with `tensors`, once its bytes are here."""

    bucket: Bucket
    version: int
    mid_generation: bool  # PIPELINE: it may land between two decode passes
    last: bool  # the install's final bucket
    tensors: dict[str, Tensor] | None = None

    @property
    def pipeline(self) -> bool:
        return self.mid_generation

    def carrying(self, bucket: Bucket) -> InstallBucket:
        """The same change with `bucket` instead (its header alone, or with its bytes)."""
        return replace(self, bucket=bucket)

    def arrive(self, inbox: Inbox) -> None:
        buffer = inbox.bucket_bytes(self.bucket)
        if buffer is not None:
            inbox.keep(
                replace(self, bucket=self.bucket.header(), tensors=unpack(self.bucket, buffer))
            )

    def apply(self, generator: Applying) -> None:
        assert self.tensors is not None, "kept once its bytes arrived"
        generator.install_bucket(
            self.resource_id, self.session_id, self.tensors, version=self.version, last=self.last
        )
