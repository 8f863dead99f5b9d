"""Training-session routes: create, list, retrieve, update, stop."""

from __future__ import annotations

import secrets
from typing import Annotated, Any

from fastapi import APIRouter, Query

from posttrain.api.contract import documented
from posttrain.api.deps import BodyDep, ServicesDep, UserDep, parse
from posttrain.api.responses import page
from posttrain.api.schemas import objects as o
from posttrain.api.schemas.sessions import SessionCreateIn, SessionUpdateIn, status_filter
from posttrain.errors import InvalidRequest
from posttrain.statuses import SessionStatus

router = APIRouter(prefix="/v1/rl/training-sessions")


# The resource or checkpoint the body names may not exist.
@router.post("", **documented(o.Session, body=SessionCreateIn, errors=(404,)))
def create(
    *,
    body: BodyDep,
    svc: ServicesDep,
    user: UserDep,
) -> dict[str, Any]:
    request = parse(SessionCreateIn, body)
    if request.load_optimizer is not None and request.resume_from_checkpoint_id is None:
        raise InvalidRequest(
            "load_optimizer only applies with resume_from_checkpoint_id", param="load_optimizer"
        )
    lora = request.lora_config.to_domain(secrets.randbelow(2**31)) if request.lora_config else None
    lora_given = frozenset(
        request.lora_config.model_dump(exclude_none=True) if request.lora_config else ()
    )
    record = svc.sessions.create(
        user,
        resource_id=request.model_resources_id,
        lora=lora,
        display_name=request.display_name,
        metadata=request.metadata.to_domain() if request.metadata else {},
        resume_from_checkpoint_id=request.resume_from_checkpoint_id,
        load_optimizer=request.load_optimizer,
        lora_given=lora_given,
    )
    return o.Session.of(record).wire()


@router.get("", **documented(o.SessionsList))
def list_sessions(
    *,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=100),
    status: Annotated[list[str] | None, Query()] = None,
    model_resources_id: str | None = None,
    created_by: str | None = None,
    svc: ServicesDep,
    user: UserDep,
) -> dict[str, Any]:
    records = svc.sessions.list(
        user, resource_id=model_resources_id, statuses=status_filter(status, SessionStatus)
    )
    if created_by not in (None, "me", user):
        records = []
    return page(o.SessionsList, [o.Session.of(s) for s in records], limit=limit, after=after)


@router.get("/{session_id}", **documented(o.Session))
def retrieve(*, session_id: str, svc: ServicesDep, user: UserDep) -> dict[str, Any]:
    return o.Session.of(svc.sessions.get(user, session_id)).wire()


@router.patch("/{session_id}", **documented(o.Session, body=SessionUpdateIn, body_required=False))
def update(
    *,
    session_id: str,
    body: BodyDep,
    svc: ServicesDep,
    user: UserDep,
) -> dict[str, Any]:
    request = parse(SessionUpdateIn, body)
    metadata = None
    if request.metadata is not None and request.metadata.wandb is not None:
        metadata = {"wandb": request.metadata.wandb.model_dump(exclude_none=True)}
    record = svc.sessions.update(
        user, session_id, display_name=request.display_name, metadata=metadata
    )
    return o.Session.of(record).wire()


@router.post("/{session_id}/stop", **documented(o.Session))
def stop(*, session_id: str, svc: ServicesDep, user: UserDep) -> dict[str, Any]:
    return o.Session.of(svc.sessions.stop(user, session_id)).wire()
