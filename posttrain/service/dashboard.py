"""Read-only views behind the dashboard page (api/routes/dashboard.py).

What one user's model resources, sessions and recent operations look like now, and one
session's loss and metrics over its optimizer steps, read from the forward-backward outputs
the scheduler stored. Nothing here writes.

Imports: store, types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from posttrain.errors import NotFound
from posttrain.records import ResourceRecord, SessionRecord
from posttrain.statuses import OperationStatus
from posttrain.store.repo import OperationDigest, Repo
from posttrain.types import OperationKind

__all__ = [
    "DashboardService",
    "OperationDigest",
    "Overview",
    "SeriesPoint",
    "SessionSeries",
    "loss_per_token",
]

RECENT_OPERATIONS = 60
# A chart needs no more points than a screen has pixels across.
MAX_SERIES_OPERATIONS = 4000
SERIES_KINDS = (OperationKind.FORWARD_BACKWARD, OperationKind.OPTIM_STEP)


@dataclass(frozen=True)
class Overview:
    resources: list[ResourceRecord]
    sessions: list[SessionRecord]
    operations: list[OperationDigest]
    queue_depth: int


def loss_per_token(loss: float | None, metrics: dict[str, float]) -> float | None:
    """The summed loss over the tokens it counted (`valid_tokens:sum`): the per-token loss an SDK
    loop prints (examples/sft.py divides by its answer tokens, the same count). None when the
    loss reported no count, or counted nothing."""
    count = metrics.get("valid_tokens:sum")
    if loss is None or not count:
        return None
    return loss / count


@dataclass(frozen=True)
class SeriesPoint:
    """One completed forward-backward. `step` is the optimizer step its gradients went into,
    numbered from 1 as an SDK loop counts its steps: one more than the number of optim-steps
    the session had completed before it. `loss` is the summed loss the operation returned."""

    step: int
    created_at: float
    loss: float
    loss_per_token: float | None
    metrics: dict[str, float]


@dataclass(frozen=True)
class SessionSeries:
    session: SessionRecord
    points: list[SeriesPoint]


class DashboardService:
    def __init__(self, repo: Repo, queue_depth: Callable[[], int]) -> None:
        self.repo = repo
        self.queue_depth = queue_depth

    def overview(self, user: str) -> Overview:
        return Overview(
            resources=self.repo.list_resources(user),
            sessions=self.repo.list_sessions(user),
            operations=self.repo.recent_operations(user, RECENT_OPERATIONS),
            queue_depth=self.queue_depth(),
        )

    def session_series(self, user: str, session_id: str) -> SessionSeries:
        """Loss and metrics of the session's forward-backwards, oldest first."""
        session = self.repo.get_session(session_id)
        if session is None or session.created_by != user:
            raise NotFound(f"session {session_id} not found", param="session_id")
        digests = self.repo.session_operations(session_id, SERIES_KINDS, MAX_SERIES_OPERATIONS)
        completed = [d for d in digests if d.status == OperationStatus.COMPLETED]
        # When the window cuts off early history, start counting where the window starts.
        num_steps = sum(d.kind == OperationKind.OPTIM_STEP for d in completed)
        step = max(0, session.step - num_steps) + 1
        points = []
        for digest in completed:
            if digest.kind == OperationKind.OPTIM_STEP:
                step += 1
            elif digest.loss is not None:
                per_token = loss_per_token(digest.loss, digest.metrics)
                points.append(
                    SeriesPoint(step, digest.created_at, digest.loss, per_token, digest.metrics)
                )
        return SessionSeries(session, points)
