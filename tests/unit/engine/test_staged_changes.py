"""Typed staged changes (engine/hosts/staged_changes.py, hosts/replicas/staged.py,
hosts/vllm/replica.py): the join rule's record reads both hosts' changes alike, PIPELINE
installs left out; a replica's install bucket crosses the pipe and is kept with its tensors bit
for bit, and a group's broken broadcast keeps nothing (the root resends it down the pipe)."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch import Tensor

from posttrain.engine.hosts.replicas.staged import (
    CreateGenerator,
    DropGenerator,
    InstallBucket,
    JoinGroup,
    ReplicaChange,
)
from posttrain.engine.hosts.replicas.weights_broadcast import Bucket, buffer_of, pack, with_data
from posttrain.engine.hosts.staged_changes import StagedChanges
from posttrain.engine.hosts.vllm.replica import Drop, Install


def test_the_join_rule_reads_both_hosts_changes_and_leaves_out_pipeline_installs():
    bucket, _ = pack({"w": torch.ones(2)})
    changes = [
        CreateGenerator(1, "a", "r", None),
        InstallBucket(2, "b", "r", bucket, 1, mid_generation=True, last=True),
        Install(3, "c", lora=True, version=1, path=Path("3")),
        Install(4, "b", lora=True, version=2, path=Path("4"), mid_generation=True),
        Drop(5, "a", lora=True),
        DropGenerator(6, "d", "r"),
    ]
    record, short = StagedChanges(), StagedChanges(kept=2)
    for change in changes:
        record.staged(change)
        short.staged(change)
    assert [c.pipeline for c in changes] == [False, True, False, True, False, False]
    assert record.sessions(0, 6) == {"a", "c", "d"}
    assert record.sessions(1, 4) == {"c"}
    assert record.sessions(3, 3) == frozenset()
    assert short.sessions(4, 6) == {"a", "d"}
    assert short.sessions(3, 6) is None  # fence 4 is forgotten


class Kept:
    """A replica's inbox as staged.Inbox sees it, keeping what arrives."""

    def __init__(self, broadcast: Tensor | None) -> None:
        self.broadcast = broadcast  # the bytes a broadcast brings; None: the group broke
        self.kept: list[ReplicaChange] = []

    def join_group(self, join: JoinGroup) -> None:
        raise AssertionError("no group here")

    def wake(self) -> None:
        raise AssertionError("no wake here")

    def bucket_bytes(self, bucket: Bucket) -> Tensor | None:
        return self.broadcast if bucket.data is None else buffer_of(bucket)

    def keep(self, change: ReplicaChange) -> None:
        self.kept.append(change)


def test_an_install_bucket_is_kept_with_its_tensors_whichever_way_its_bytes_came():
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5)}
    bucket, buffer = pack(tensors)
    change = InstallBucket(7, "s", "r", bucket, 3, mid_generation=False, last=True)
    piped = pickle.loads(pickle.dumps(change.carrying(with_data(bucket, buffer)), protocol=5))
    header = pickle.loads(pickle.dumps(change.carrying(bucket.header()), protocol=5))
    for arrival, inbox in ((piped, Kept(None)), (header, Kept(buffer)), (header, Kept(None))):
        arrival.arrive(inbox)
        if inbox.broadcast is None and arrival is header:
            assert inbox.kept == []  # the group broke: nothing kept until the resend
            continue
        (kept,) = inbox.kept
        assert isinstance(kept, InstallBucket) and kept.tensors is not None
        assert (kept.fence, kept.session_id, kept.version, kept.last) == (7, "s", 3, True)
        assert kept.bucket.data is None  # the bytes live on in the tensors alone
        assert kept.tensors.keys() == tensors.keys()
        assert all(torch.equal(kept.tensors[n], t) for n, t in tensors.items())
