"""A session's chart series (service/dashboard.py) on a real SQLite store: steps numbered from 1
as an SDK loop counts them, and the loss per token beside the summed loss."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from posttrain.errors import NotFound
from posttrain.records import OperationRecord
from posttrain.records import ResourceRecord as Resource
from posttrain.records import SessionRecord as Session
from posttrain.service.dashboard import DashboardService, loss_per_token
from posttrain.statuses import OperationStatus, ResourceStatus
from posttrain.statuses import SessionStatus as Status
from posttrain.store.db import connect
from posttrain.store.repo import Repo
from posttrain.types import OperationKind

FB, OPT = OperationKind.FORWARD_BACKWARD, OperationKind.OPTIM_STEP


def service_with_steps(tmp_path: Path, outputs: list[dict]) -> DashboardService:
    """One session that ran forward-backward + optim-step once per output."""
    repo = Repo(connect(tmp_path))
    repo.put_resource(Resource("mr-a", "m", "alice", 1.0, 1.0, ResourceStatus.READY))
    session = Session("ts-1", "mr-a", "m", "alice", 1.0, 1.0, Status.RUNNING)
    repo.put_session(dataclasses.replace(session, step=len(outputs)))
    for index, output in enumerate(outputs):
        for kind, body in ((FB, output), (OPT, {})):
            op_id = f"op-{index}-{kind.value}"
            op = OperationRecord(
                op_id, "ts-1", kind, OperationStatus.PENDING, 1.0, 1.0, op_id, "f", "alice"
            )
            repo.insert_operation(op)
            done = dataclasses.replace(op, status=OperationStatus.COMPLETED, output=body)
            repo.put_operation(done)
    return DashboardService(repo, queue_depth=lambda: 0)


def test_points_count_steps_from_one_with_the_loss_per_counted_token(tmp_path):
    outputs = [
        {"loss": 8.0, "metrics": {"loss:sum": 8.0, "valid_tokens:sum": 4.0}},
        {"loss": 6.0, "metrics": {"loss:sum": 6.0, "valid_tokens:sum": 5.0}},
        {"loss": 3.0, "metrics": {"loss:sum": 3.0}},  # a loss that reports no token count
    ]
    series = service_with_steps(tmp_path, outputs).session_series("alice", "ts-1")
    assert [p.step for p in series.points] == [1, 2, 3]
    assert [p.loss for p in series.points] == [8.0, 6.0, 3.0]
    assert [p.loss_per_token for p in series.points] == [2.0, 1.2, None]
    with pytest.raises(NotFound):
        service_with_steps(tmp_path / "b", outputs).session_series("bob", "ts-1")


def test_loss_per_token_needs_a_loss_and_a_nonzero_count():
    assert loss_per_token(7.5, {"valid_tokens:sum": 3.0}) == 2.5
    assert loss_per_token(7.5, {"valid_tokens:sum": 0.0}) is None
    assert loss_per_token(None, {"valid_tokens:sum": 3.0}) is None
    assert loss_per_token(7.5, {}) is None
