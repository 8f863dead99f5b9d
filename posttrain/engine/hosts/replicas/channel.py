"""A resource's generator replica processes as hosts/replicas/engine.py drives them: each
replica's handle (`GeneratorReplica`, started through a Placement), and the `Channel` that
carries the resource's staged changes (hosts/replicas/staged.py) to them in fence order on a
sender thread of its own, an install's bytes in buckets (`in_buckets`) by broadcast
(weights_broadcast.py), so the trainer's lane never waits for a replica busy sampling.

Imports: engine.hosts (placement; replicas: staged, weights_broadcast, worker); torch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from torch import Tensor

from posttrain.engine.hosts.placement import Hosted, Placement
from posttrain.engine.hosts.replicas.staged import Arrival, InstallBucket
from posttrain.engine.hosts.replicas.weights_broadcast import Root
from posttrain.engine.hosts.replicas.worker import ReplicaEngine


class GeneratorReplica:
    """One replica process, with its command and staging channels (hosts/placement.py)."""

    def __init__(self, resource_id: str, index: int, placement: Placement) -> None:
        self.index = index
        self.worker = placement.start_replica(
            resource_id,
            Hosted(ReplicaEngine),
            label=f"generator replica {index} of model resource {resource_id}",
            index=index,
        )

    @property
    def alive(self) -> bool:
        return self.worker.alive

    def stop(self) -> None:
        self.worker.stop()


class Channel:
    """The resource's staged changes on their way to its replicas: one thread sends them in
    fence order (hosts/replicas/weights_broadcast.py: an install's bytes by broadcast), so the
    trainer's lane never waits for a replica to read (a pipe holds 64 KiB; a replica busy
    sampling reads it slowly)."""

    def __init__(self, resource_id: str, root: Root) -> None:
        self.root = root
        # Each a change's sending, to the replicas it was staged for.
        self._outbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(
            target=self._send, name=f"posttrain-stage-{resource_id}", daemon=True
        )
        self._sender.start()

    def put(self, replicas: list[GeneratorReplica], change: Arrival) -> None:
        to = list(replicas)
        self._outbox.put(lambda: self.root.send(to, stage_on, change))

    def put_bucket(
        self, replicas: list[GeneratorReplica], change: InstallBucket, buffer: Tensor
    ) -> None:
        """An install's bucket, its bytes in `buffer`."""
        to = list(replicas)
        self._outbox.put(lambda: self.root.send_bucket(to, stage_on, is_alive, change, buffer))

    def _send(self) -> None:
        # A dead replica misses what is staged: it is rebuilt, not replayed.
        while (send := self._outbox.get()) is not None:
            send()

    def stop(self) -> None:
        self._outbox.put(None)
        self._sender.join()
        self.root.close()


def stage_on(replica: GeneratorReplica, data: bytes) -> None:
    replica.worker.stage(data)


def is_alive(replica: GeneratorReplica) -> bool:
    return replica.alive


def in_buckets(tensors: dict[str, Tensor], limit: int) -> list[dict[str, Tensor]]:
    """Consecutive groups of tensors of at most `limit` bytes each (a larger tensor alone);
    at least one group, so an install with no tensors still arrives."""
    groups: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += nbytes
    return groups
