"""Response models of the dashboard's JSON (routes/dashboard.py), which the page polls: times
are epoch seconds, and absent values are written as null.

Imports: api.schemas.objects, types.
"""

from __future__ import annotations

from posttrain.api.schemas.objects import Reply
from posttrain.statuses import OperationStatus, ResourceStatus, SessionStatus
from posttrain.types import OperationKind


class DashboardResource(Reply):
    id: str
    base_model: str
    status: ResourceStatus
    created_at: float
    expires_at: float | None
    lora_enabled: bool


class DashboardSession(Reply):
    id: str
    model_resources_id: str
    base_model: str
    display_name: str | None
    status: SessionStatus
    created_at: float
    updated_at: float
    step: int
    weights_version: int
    lora_rank: int | None


class DashboardOperation(Reply):
    id: str
    session_id: str
    kind: OperationKind
    status: OperationStatus
    created_at: float
    updated_at: float
    error_code: str | None
    error_message: str | None
    loss: float | None
    # The summed loss over the tokens it counted: what an SDK loop prints as loss per token.
    loss_per_token: float | None


class Overview(Reply):
    model_resources: list[DashboardResource]
    sessions: list[DashboardSession]
    operations: list[DashboardOperation]
    queue_depth: int


class SeriesPoint(Reply):
    step: int  # the optimizer step the gradients went into, from 1 as an SDK loop counts
    created_at: float
    loss: float  # summed over tokens, as the operation returned it
    loss_per_token: float | None
    metrics: dict[str, float]


class Series(Reply):
    session: DashboardSession
    points: list[SeriesPoint]
