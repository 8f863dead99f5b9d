"""The Tinker wire's REST views of training runs and named checkpoints (`/api/v1/...`), as the
tinker 0.38 SDK's RestClient calls them and validates the answers (types.TrainingRun,
Checkpoint, Cursor, WeightsInfoResponse): listing, delete, TTL, publish, weights_info. Each
route is a thin adapter over service/tinker/checkpoints.py; times go out as ISO 8601 (UTC).

A checkpoint id in a path holds a slash (`weights/NAME`): the SDK puts it into the URL as is,
so those routes take it as two segments. Mutations answer 204 without a body (the SDK reads
none). `project_id` (a Tinker project) is accepted and ignored: posttrain has no projects.
`external_weights` checkpoints are not served (posttrain has no save_weights_external), so
their download-URL route is absent and answers the framework's JSON 404.

Imports: api, service.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Depends, Response

from posttrain.api.deps import RawBodyDep, ServicesDep, loads_strict, parse
from posttrain.api.tinker import wire as w
from posttrain.api.tinker.handshake import tinker_user
from posttrain.service.tinker.checkpoints import CheckpointView, Page, RunView

router = APIRouter(prefix="/api/v1", include_in_schema=False)  # as routes.py says why

TinkerUser = Depends(tinker_user)
CHECKPOINT = "/training_runs/{model_id}/checkpoints/{segment}/{name}"


def _time(seconds: float | None) -> str | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC).isoformat()


def _checkpoint(view: CheckpointView) -> dict[str, Any]:
    return {
        "checkpoint_id": view.checkpoint_id,
        "checkpoint_type": view.checkpoint_type,
        "time": _time(view.time),
        "tinker_path": view.tinker_path,
        "size_bytes": view.size_bytes,
        "public": view.public,
        "user_metadata": view.user_metadata,
        "expires_at": _time(view.expires_at),
    }


def _run(view: RunView) -> dict[str, Any]:
    run = view.run
    return {
        "training_run_id": run.model_id,
        "base_model": run.base_model,
        "model_owner": run.user,
        "is_lora": True,
        "corrupted": view.corrupted,
        "lora_rank": run.lora_rank,
        "last_request_time": _time(view.last_request_time),
        "last_checkpoint": _checkpoint(view.last_checkpoint) if view.last_checkpoint else None,
        "last_sampler_checkpoint": (
            _checkpoint(view.last_sampler_checkpoint) if view.last_sampler_checkpoint else None
        ),
        # TrainingRun.user_metadata is dict[str, str]; create_model's may hold other JSON.
        "user_metadata": (
            None
            if run.user_metadata is None
            else {k: v if isinstance(v, str) else str(v) for k, v in run.user_metadata.items()}
        ),
    }


def _cursor(page: Page[Any]) -> dict[str, int]:
    return {"offset": page.offset, "limit": page.limit, "total_count": page.total_count}


# ------------------------------------------------------------------ training runs


@router.get("/training_runs")
def list_training_runs(
    svc: ServicesDep,
    limit: int = 20,
    offset: int = 0,
    access_scope: str = "owned",
    project_id: str | None = None,
    user: str = TinkerUser,
) -> dict[str, Any]:
    page = svc.tinker.checkpoints.training_runs(user, limit, offset, access_scope)
    return {"training_runs": [_run(v) for v in page.items], "cursor": _cursor(page)}


@router.get("/training_runs/{model_id}")
def get_training_run(
    model_id: str, svc: ServicesDep, access_scope: str = "owned", user: str = TinkerUser
) -> dict[str, Any]:
    return _run(svc.tinker.checkpoints.training_run(user, model_id, access_scope))


# ------------------------------------------------------------------ checkpoints


@router.get("/training_runs/{model_id}/checkpoints")
def list_run_checkpoints(model_id: str, svc: ServicesDep, user: str = TinkerUser) -> dict[str, Any]:
    views = svc.tinker.checkpoints.run_checkpoints(user, model_id)
    return {"checkpoints": [_checkpoint(v) for v in views]}


@router.get("/checkpoints")
def list_user_checkpoints(
    svc: ServicesDep, limit: int = 100, offset: int = 0, user: str = TinkerUser
) -> dict[str, Any]:
    page = svc.tinker.checkpoints.user_checkpoints(user, limit, offset)
    return {"checkpoints": [_checkpoint(v) for v in page.items], "cursor": _cursor(page)}


@router.delete(CHECKPOINT, status_code=204)
def delete_checkpoint(
    model_id: str, segment: str, name: str, svc: ServicesDep, user: str = TinkerUser
) -> Response:
    svc.tinker.checkpoints.delete(user, model_id, f"{segment}/{name}")
    return Response(status_code=204)


@router.put(CHECKPOINT + "/ttl", status_code=204)
def set_checkpoint_ttl(
    model_id: str,
    segment: str,
    name: str,
    body: RawBodyDep,
    svc: ServicesDep,
    user: str = TinkerUser,
) -> Response:
    request = parse(w.Ttl, loads_strict(body))
    svc.tinker.checkpoints.set_ttl(user, model_id, f"{segment}/{name}", request.ttl_seconds)
    return Response(status_code=204)


@router.post(CHECKPOINT + "/publish", status_code=204)
def publish_checkpoint(
    model_id: str, segment: str, name: str, svc: ServicesDep, user: str = TinkerUser
) -> Response:
    svc.tinker.checkpoints.publish(user, model_id, f"{segment}/{name}", True)
    return Response(status_code=204)


@router.delete(CHECKPOINT + "/publish", status_code=204)
def unpublish_checkpoint(
    model_id: str, segment: str, name: str, svc: ServicesDep, user: str = TinkerUser
) -> Response:
    svc.tinker.checkpoints.publish(user, model_id, f"{segment}/{name}", False)
    return Response(status_code=204)


@router.post("/weights_info")
def weights_info(body: RawBodyDep, svc: ServicesDep, user: str = TinkerUser) -> dict[str, Any]:
    request = parse(w.WeightsInfo, loads_strict(body))
    info = svc.tinker.checkpoints.weights_info(user, request.tinker_path)
    adapts = True if info.is_lora else None  # posttrain's adapters cover attention and MLP
    return {
        "base_model": info.base_model,
        "is_lora": info.is_lora,
        "lora_rank": info.lora_rank,
        "train_unembed": info.train_unembed,
        "train_mlp": adapts,
        "train_attn": adapts,
        "optimizer_config": {"type": "adamw"},
    }
