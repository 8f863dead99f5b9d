"""Weights-sync over torch.distributed: each bucket of an install that a resource's generator
replicas must serve crosses in one broadcast of a process group {this process (rank 0),
replica 1..R}, not pickled once per replica down each replica's pipe.

The pipe (or a Ray actor's `stage` call) still carries every staged change, in fence order
(hosts/replicas/staged.py): an install's bucket travels there as a `Bucket` whose `data` is None
(its layout only), and its bytes follow as one gloo broadcast of a flat uint8 buffer once the
header has gone to every replica. A replica's inbox thread (hosts/replicas/worker.py) takes the
changes in order and, for such a header, joins the broadcast and keeps the tensors it received.

The group forms lazily: when a bucket is sent, every replica is alive and the group is missing
or was formed with other replicas, a join message with a fresh store prefix goes to each,
and all build their member of one ProcessGroupGloo on a TCPStore hosted here. A join that
fails (a replica died meanwhile) is not retried for the same replicas.

Faults: each broadcast ends in a barrier, so the root learns of any member that did not get
the bytes. A broadcast or barrier that fails (a replica died: gloo reports the reset peer at
once) drops the group here, which closes its connections, so the live members fail at once too;
the same change is then sent to every replica down the pipe with its bytes. A member whose
broadcast failed waits for that resend; one that got the bytes keeps them and ignores the
resend (its fence is received already). The first bucket after the dead replica's successor
starts forms a new group.

Gloo moves host memory: CUDA tensors are copied to the host first. NCCL (device to device, one
device per member) is not built: it needs a GPU per replica, and none was lent to test it.

Imports: torch, numpy.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import torch
from torch import Tensor

# Where torch's stubs declare them: torch.distributed re-exports them implicitly.
from torch._C._distributed_c10d import (
    BarrierOptions,
    BroadcastOptions,
    PrefixStore,
    ProcessGroupGloo,
    TCPStore,
)

# Offsets in a packed bucket are multiples of this, so every tensor is an aligned view of it.
ALIGN = 64
# How long building a group may wait for its members, and a broadcast for its bytes: a live
# replica's inbox thread answers at once, a dead one never; a failed broadcast ends at once.
JOIN_TIMEOUT = datetime.timedelta(seconds=20)
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)

# (name, dtype, shape, offset, nbytes) of each tensor in a packed bucket.
Entry = tuple[str, str, tuple[int, ...], int, int]
# One replica, as the caller of Root.send knows it.
Replica = TypeVar("Replica")
# (host, port, store prefix, rank, size) -> the message that makes a replica join a group.
Joining = Callable[[str, int, str, int, int], object]


@dataclass(frozen=True)
class Bucket:
    """One bucket of an install: where each tensor lies in a flat uint8 buffer of `nbytes`,
    and the buffer itself when it crosses the pipe (None: it comes by broadcast)."""

    entries: tuple[Entry, ...]
    nbytes: int
    data: np.ndarray | None = None

    def header(self) -> Bucket:
        return Bucket(self.entries, self.nbytes)


def pack(tensors: dict[str, Tensor]) -> tuple[Bucket, Tensor]:
    """The tensors copied into one flat host buffer (a snapshot: later changes to them do not
    show), and its layout."""
    entries: list[Entry] = []
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        dtype = str(tensor.dtype).removeprefix("torch.")
        entries.append((name, dtype, tuple(tensor.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    buffer = torch.empty(offset, dtype=torch.uint8)
    for (_, _, _, start, nbytes), tensor in zip(entries, tensors.values(), strict=True):
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[start : start + nbytes].copy_(flat)
    return Bucket(tuple(entries), offset), buffer


def unpack(bucket: Bucket, buffer: Tensor) -> dict[str, Tensor]:
    """The bucket's tensors: views of `buffer`."""
    return {
        name: buffer[start : start + nbytes].view(getattr(torch, dtype)).reshape(shape)
        for name, dtype, shape, start, nbytes in bucket.entries
    }


def with_data(bucket: Bucket, buffer: Tensor) -> Bucket:
    """The bucket carrying its bytes, for the pipe."""
    return Bucket(bucket.entries, bucket.nbytes, buffer.numpy())


def buffer_of(bucket: Bucket) -> Tensor:
    """A bucket that crossed the pipe, as the buffer `unpack` reads."""
    assert bucket.data is not None
    return torch.from_numpy(bucket.data)


def broadcast(group: ProcessGroupGloo, buffer: Tensor) -> None:
    options = BroadcastOptions()
    options.rootRank = 0
    options.timeout = COLLECTIVE_TIMEOUT
    # torch's stubs give a Backend none of its collectives (bound at runtime).
    group.broadcast([buffer], options).wait()  # type: ignore[attr-defined]


def barrier(group: ProcessGroupGloo) -> None:
    """After a broadcast: the root's send finishing does not prove that every member received
    (a member that relays to another may die); a member that failed has dropped the group, so
    this fails for the root too, and it resends."""
    options = BarrierOptions()
    options.timeout = COLLECTIVE_TIMEOUT
    group.barrier(options).wait()  # type: ignore[attr-defined]  # as in broadcast


class Carrying(Protocol):
    """A staged change that carries one bucket of an install (hosts/replicas/staged.py's
    InstallBucket)."""

    @property
    def bucket(self) -> Bucket: ...

    def carrying(self, bucket: Bucket) -> object:
        """The same change with `bucket` instead."""
        ...


class Member:
    """A replica's end: its member of the current group, if any (used by one thread)."""

    def __init__(self) -> None:
        self.group: ProcessGroupGloo | None = None

    def join(self, host: str, port: int, prefix: str, rank: int, size: int) -> None:
        self.group = None  # the old group's connections close before the new one forms
        try:
            store = TCPStore(host, port, None, False, timeout=JOIN_TIMEOUT)
            self.group = ProcessGroupGloo(PrefixStore(prefix, store), rank, size, JOIN_TIMEOUT)
        except RuntimeError:
            self.group = None  # the root gives up too: changes come down the pipe

    def receive(self, bucket: Bucket) -> Tensor | None:
        """The bucket's bytes from the root; None if they did not come (the group broke:
        the root resends them down the pipe)."""
        if self.group is None:
            return None
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
        try:
            broadcast(self.group, buffer)
        except RuntimeError:
            self.group = None  # closes its connections: the root's barrier fails
            return None
        try:
            barrier(self.group)
        except RuntimeError:
            self.group = None  # another member failed; these bytes are whole all the same
        return buffer


@dataclass
class Delivery:
    """What a Root did with the buckets it sent (for /metrics-like checks and the tests)."""

    broadcast: int = 0  # buckets whose bytes crossed in a broadcast
    piped: int = 0  # buckets whose bytes went down each replica's pipe
    groups: int = 0  # groups formed


class Root:
    """Rank 0 of one resource's weights group: it sends each staged change to every replica,
    an install's bytes by broadcast where the group stands (called from one thread)."""

    def __init__(self, host: str, *, broadcast: bool, join: Joining) -> None:
        """`broadcast` False: every bucket goes down the pipes (`--weights-sync pipe`); `join`:
        the message that makes a replica a member of a group."""
        self.host = host
        self._store = TCPStore(host, 0, None, True, wait_for_workers=False) if broadcast else None
        self._join = join
        self._group: ProcessGroupGloo | None = None
        self._members: tuple[object, ...] = ()  # the replicas of the current group
        self._tried: tuple[object, ...] = ()  # the replicas a join last failed with
        self._generation = 0
        self.delivery = Delivery()

    def send(
        self, replicas: Sequence[Replica], stage: Callable[[Replica, bytes], None], change: object
    ) -> None:
        """Deliver `change` to each replica with `stage(replica, data)`."""
        data = pickle.dumps(change, protocol=pickle.HIGHEST_PROTOCOL)
        for replica in replicas:
            stage(replica, data)

    def send_bucket(
        self,
        replicas: Sequence[Replica],
        stage: Callable[[Replica, bytes], None],
        alive: Callable[[Replica], bool],
        change: Carrying,
        buffer: Tensor,
    ) -> None:
        """Deliver `change`, an install's bucket whose bytes are `buffer`, by broadcast when
        the group stands, else down each replica's pipe with its bytes."""
        group = self._ready(replicas, stage, alive)
        if group is not None:
            self.send(replicas, stage, change.carrying(change.bucket.header()))
            try:
                broadcast(group, buffer)
                barrier(group)
                self.delivery.broadcast += 1
                return
            except RuntimeError:
                self._drop()  # closes its connections: the live members stop waiting
        self.delivery.piped += 1
        self.send(replicas, stage, change.carrying(with_data(change.bucket, buffer)))

    def _ready(
        self,
        replicas: Sequence[Replica],
        stage: Callable[[Replica, bytes], None],
        alive: Callable[[Replica], bool],
    ) -> ProcessGroupGloo | None:
        """The group of `replicas`, formed now if it does not stand; None where it cannot."""
        members = tuple(replicas)
        if self._group is not None and members == self._members:
            return self._group
        self._drop()
        if self._store is None or not members or members == self._tried:
            return None
        if not all(alive(r) for r in members):
            return None
        self._generation += 1
        prefix = f"weights{self._generation}"
        size = len(members) + 1
        for rank, replica in enumerate(members, start=1):
            join = self._join(self.host, self._store.port, prefix, rank, size)
            stage(replica, pickle.dumps(join, protocol=pickle.HIGHEST_PROTOCOL))
        try:
            group = ProcessGroupGloo(PrefixStore(prefix, self._store), 0, size, JOIN_TIMEOUT)
        except RuntimeError:
            self._tried = members
            return None
        self._group, self._members = group, members
        self.delivery.groups += 1
        return group

    def _drop(self) -> None:
        self._group = None
        self._members = ()

    def close(self) -> None:
        self._drop()
