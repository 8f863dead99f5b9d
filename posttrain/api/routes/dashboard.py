"""The dashboard: the page at `/`, its assets, and the read-only JSON it polls.

The page and its assets are public (they hold no data). The JSON under /v1/dashboard/ takes the
same bearer key as the API and shows only the caller's resources and sessions; in single-user
mode (no keys configured) any non-empty key works, so the page sends a placeholder key until the
server answers 401 and then asks for one (README, "Dashboard").
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

from posttrain.api.contract import documented
from posttrain.api.deps import ServicesDep, UserDep
from posttrain.api.schemas import dashboard as d
from posttrain.errors import NotFound
from posttrain.records import ResourceRecord, SessionRecord
from posttrain.service.dashboard import OperationDigest, SessionSeries, loss_per_token

router = APIRouter()

# name -> media type; nothing else under static/ is served.
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def _static(name: str) -> str:
    return resources.files("posttrain.api").joinpath("static", name).read_text()


@router.get("/", include_in_schema=False)
def page() -> HTMLResponse:
    return HTMLResponse(_static("dashboard.html"), headers={"Cache-Control": "no-cache"})


@router.get("/dashboard/{name}", include_in_schema=False)
def asset(name: str) -> Response:
    if name not in ASSETS:
        raise NotFound(f"no dashboard asset {name}", param="name")
    return Response(_static(name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})


def resource_json(r: ResourceRecord) -> dict[str, Any]:
    return {
        "id": r.id,
        "base_model": r.base_model,
        "status": r.status.value,
        "created_at": r.created_at,
        "expires_at": r.expires_at,
        "lora_enabled": r.lora_enabled,
    }


def session_json(s: SessionRecord) -> dict[str, Any]:
    return {
        "id": s.id,
        "model_resources_id": s.resource_id,
        "base_model": s.base_model,
        "display_name": s.display_name,
        "status": s.status.value,
        "created_at": s.created_at,
        "updated_at": s.updated_at,
        "step": s.step,
        "weights_version": s.policy_state.applied_weights_version,
        "lora_rank": s.lora_config.rank if s.lora_config else None,
    }


def operation_json(digest: OperationDigest) -> dict[str, Any]:
    """The digest's fields that DashboardOperation names, in its order."""
    return d.DashboardOperation.copied(
        digest,
        kind=digest.kind.value,
        status=digest.status.value,
        loss_per_token=loss_per_token(digest.loss, digest.metrics),
    ).wire()


def series_json(series: SessionSeries) -> dict[str, Any]:
    return {
        "session": session_json(series.session),
        "points": [
            {
                "step": p.step,
                "created_at": p.created_at,
                "loss": p.loss,
                "loss_per_token": p.loss_per_token,
                "metrics": p.metrics,
            }
            for p in series.points
        ],
    }


@router.get("/v1/dashboard/overview", **documented(d.Overview))
def overview(*, svc: ServicesDep, user: UserDep) -> dict[str, Any]:
    view = svc.dashboard.overview(user)
    return {
        "model_resources": [resource_json(r) for r in view.resources],
        "sessions": [session_json(s) for s in view.sessions],
        "operations": [operation_json(d) for d in view.operations],
        "queue_depth": view.queue_depth,
    }


@router.get("/v1/dashboard/sessions/{session_id}/series", **documented(d.Series))
def session_series(session_id: str, *, svc: ServicesDep, user: UserDep) -> dict[str, Any]:
    return series_json(svc.dashboard.session_series(user, session_id))
