"""Response models of the dashboard's JSON (routes/dashboard.py), which the page polls: times
are epoch seconds, and absent values are written as null.

An operation's fields are declared once, on records.OperationRecord: DashboardOperation takes
those it shows (OPERATION_FIELDS), with their types, from the record.

Imports: api.schemas.reply, records.
"""

from __future__ import annotations

from typing import Any, get_type_hints

from pydantic import create_model

from posttrain.api.schemas.reply import Reply
from posttrain.records import OperationRecord
from posttrain.statuses import ResourceStatus, SessionStatus

# The operation record's fields the dashboard shows, in the order it writes them.
OPERATION_FIELDS = (
    "id",
    "session_id",
    "kind",
    "status",
    "created_at",
    "updated_at",
    "error_code",
    "error_message",
)


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


def _record_fields(names: tuple[str, ...]) -> dict[str, Any]:
    """The record's fields by these names, each required (the dashboard writes null for None)."""
    types = get_type_hints(OperationRecord)
    return {name: (types[name], ...) for name in names}


_OperationRecordFields: type[Reply] = create_model(
    "_OperationRecordFields", __base__=Reply, **_record_fields(OPERATION_FIELDS)
)


# The record's OPERATION_FIELDS, then what a forward-backward stored. (A comment, not a
# docstring: the docstring would be the schema's description in /openapi.json.)
class DashboardOperation(_OperationRecordFields):
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
