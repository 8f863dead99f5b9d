"""Checkpoint routes (api.md 1.5): list, retrieve, download, and the signed file URLs that
download hands out, which the SDK fetches without an Authorization header (api.md 3.6)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse

from posttrain.api.contract import documented
from posttrain.api.deps import ServicesDep, UserDep
from posttrain.api.responses import page
from posttrain.api.schemas import objects as o

router = APIRouter(prefix="/v1/rl/checkpoints")


@router.get("", **documented(o.CheckpointsList))
def list_checkpoints(
    *,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=100),
    base_model: str | None = None,
    session_id: str | None = None,
    type: str | None = None,  # noqa: A002 - the query parameter's wire name
    svc: ServicesDep,
    user: UserDep,
) -> dict[str, Any]:
    records = svc.checkpoints.list(
        user, base_model=base_model, session_id=session_id, checkpoint_type=type
    )
    return page(o.CheckpointsList, [o.Checkpoint.of(c) for c in records], limit=limit, after=after)


@router.get("/{checkpoint_id}", **documented(o.Checkpoint))
def retrieve(*, checkpoint_id: str, svc: ServicesDep, user: UserDep) -> dict[str, Any]:
    return o.Checkpoint.of(svc.checkpoints.get(user, checkpoint_id)).wire()


@router.get("/{checkpoint_id}/download", **documented(o.CheckpointDownload))
def download(
    *,
    checkpoint_id: str,
    variant: str | None = None,
    svc: ServicesDep,
    user: UserDep,
) -> dict[str, Any]:
    files = svc.checkpoints.download(user, checkpoint_id, variant)
    data = [o.CheckpointFile.copied(f) for f in files]
    return o.CheckpointDownload.model_construct(data=data).wire()


@router.get(
    "/{checkpoint_id}/files/{part}/{filename}",
    **documented(None, media_type="application/octet-stream"),
)
def get_file(
    *,
    checkpoint_id: str,
    part: str,
    filename: str,
    expires: str | None = None,
    sig: str | None = None,
    svc: ServicesDep,
) -> FileResponse:
    path = svc.checkpoints.authorize(checkpoint_id, part, filename, expires, sig)
    return FileResponse(path, media_type="application/octet-stream", filename=filename)
