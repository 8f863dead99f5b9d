"""Read-only digests of the store (dashboard, /metrics) on a real SQLite file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from posttrain.api.schemas.dashboard import DashboardOperation
from posttrain.records import OperationRecord, ResourceRecord, SessionRecord
from posttrain.statuses import OperationStatus, ResourceStatus, SessionStatus
from posttrain.store.db import connect
from posttrain.store.repo import OperationDigest, Repo
from posttrain.types import OperationKind


def make_repo(tmp_path: Path) -> Repo:
    repo = Repo(connect(tmp_path))
    for rid, status in (("mr-a", ResourceStatus.READY), ("mr-b", ResourceStatus.STOPPED)):
        repo.put_resource(ResourceRecord(rid, "m", "alice", 1.0, 1.0, status))
    sessions = (("ts-1", "mr-a", "alice"), ("ts-2", "mr-a", "alice"), ("ts-3", "mr-b", "bob"))
    for sid, rid, user in sessions:
        repo.put_session(SessionRecord(sid, rid, "m", user, 1.0, 1.0, SessionStatus.RUNNING))
    return repo


def add_op(repo: Repo, op_id: str, session_id: str, kind: OperationKind, **fields) -> None:
    op = OperationRecord(
        op_id, session_id, kind, OperationStatus.PENDING, 1.0, 1.0, op_id, "f", "alice"
    )
    repo.insert_operation(op)
    if fields:
        repo.put_operation(dataclasses.replace(op, **fields))


def test_counts_group_by_their_labels(tmp_path):
    repo = make_repo(tmp_path)
    add_op(repo, "op-1", "ts-1", OperationKind.FORWARD_BACKWARD)
    add_op(repo, "op-2", "ts-1", OperationKind.FORWARD_BACKWARD, status=OperationStatus.COMPLETED)
    add_op(repo, "op-3", "ts-3", OperationKind.FORWARD_BACKWARD, status=OperationStatus.COMPLETED)
    add_op(repo, "op-4", "ts-2", OperationKind.OPTIM_STEP, status=OperationStatus.FAILED)
    assert repo.count_operations() == [
        ("forward-backward", OperationStatus.COMPLETED.value, 2),
        ("forward-backward", OperationStatus.PENDING.value, 1),
        ("optim-step", OperationStatus.FAILED.value, 1),
    ]
    running = SessionStatus.RUNNING.value
    assert repo.count_sessions() == [(running, 3)]
    assert repo.count_resources() == [
        (ResourceStatus.READY.value, 1),
        (ResourceStatus.STOPPED.value, 1),
    ]


def test_digests_carry_loss_and_metrics_but_not_the_output(tmp_path):
    repo = make_repo(tmp_path)
    output = {"loss": 2.5, "metrics": {"loss:sum": 2.5}, "loss_fn_outputs": [[0.1] * 1000]}
    add_op(
        repo,
        "op-1",
        "ts-1",
        OperationKind.FORWARD_BACKWARD,
        status=OperationStatus.COMPLETED,
        output=output,
    )
    add_op(repo, "op-2", "ts-1", OperationKind.OPTIM_STEP, status=OperationStatus.COMPLETED)
    add_op(repo, "op-3", "ts-1", OperationKind.SAMPLE, status=OperationStatus.COMPLETED)
    add_op(repo, "op-4", "ts-3", OperationKind.SAMPLE)  # bob's session
    recent = repo.recent_operations("alice", limit=2)
    assert [d.id for d in recent] == ["op-3", "op-2"]  # newest first, alice's only
    series = repo.session_operations(
        "ts-1", (OperationKind.FORWARD_BACKWARD, OperationKind.OPTIM_STEP), limit=10
    )
    assert [d.id for d in series] == ["op-1", "op-2"]  # submission order
    assert (series[0].loss, series[0].metrics) == (2.5, {"loss:sum": 2.5})
    assert (series[1].loss, series[1].metrics) == (None, {})
    last = repo.session_operations("ts-1", (OperationKind.FORWARD_BACKWARD,), limit=1)
    assert [d.id for d in last] == ["op-1"]


def test_a_digest_is_an_operation_record_and_the_dashboard_shows_its_fields():
    """One definition of an operation's fields: the digest derives from the record, and the
    dashboard's operation names only fields the digest has, besides what it derives from them
    (loss_per_token: the loss over its metrics' token count)."""
    digest = {f.name for f in dataclasses.fields(OperationDigest)}
    assert {f.name for f in dataclasses.fields(OperationRecord)} | {"loss", "metrics"} == digest
    assert set(DashboardOperation.model_fields) - {"loss_per_token"} <= digest
