"""Large-payload offload routes (api.md 1.6): upload-url and download-url for the SDK, and the
signed PUT/GET URLs they hand out, which the SDK calls without an Authorization header."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse

from posttrain.api.contract import documented
from posttrain.api.deps import ServicesDep, UserDep
from posttrain.api.schemas import objects as o
from posttrain.api.schemas.wire import JsonObject

router = APIRouter(prefix="/v1/rl")


@router.post("/training-sessions/{session_id}/payloads/upload-url", **documented(o.UploadUrl))
def upload_url(*, session_id: str, svc: ServicesDep, user: UserDep) -> dict[str, Any]:
    payload_id, url = svc.payloads.create_upload(user, session_id)
    return o.UploadUrl.model_construct(payload_id=payload_id, upload_url=url).wire()


@router.post(
    "/training-sessions/{session_id}/payloads/{payload_id}/download-url",
    **documented(o.DownloadUrl),
)
def download_url(
    *,
    session_id: str,
    payload_id: str,
    svc: ServicesDep,
    user: UserDep,
) -> dict[str, Any]:
    url = svc.payloads.download_url(user, session_id, payload_id)
    return o.DownloadUrl.model_construct(download_url=url).wire()


@router.put("/payloads/{payload_id}", **documented(o.PayloadStored, body=JsonObject))
async def put_payload(
    *,
    payload_id: str,
    request: Request,
    expires: str | None = None,
    sig: str | None = None,
    svc: ServicesDep,
) -> dict[str, Any]:
    path = svc.payloads.authorize("PUT", payload_id, expires, sig)
    body = await request.body()
    await run_in_threadpool(svc.payloads.write, path, body)
    return o.PayloadStored.model_construct(payload_id=payload_id, size=len(body)).wire()


@router.get("/payloads/{payload_id}", **documented(None, media_type="application/json"))
def get_payload(
    *,
    payload_id: str,
    expires: str | None = None,
    sig: str | None = None,
    svc: ServicesDep,
) -> FileResponse:
    path = svc.payloads.authorize("GET", payload_id, expires, sig)
    return FileResponse(path, media_type="application/json")
