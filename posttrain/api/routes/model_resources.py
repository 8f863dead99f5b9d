"""Model-resource routes: create, list, retrieve, estimate-cost, extend-expiry, stop."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from posttrain.api.contract import documented
from posttrain.api.deps import BodyDep, ServicesDep, UserDep, parse
from posttrain.api.responses import page
from posttrain.api.schemas import objects as o
from posttrain.api.schemas.sessions import ExtendExpiryIn, ResourceCreateIn, status_filter
from posttrain.statuses import ResourceStatus

router = APIRouter(prefix="/v1/rl/model-resources")

DEFAULT_INACTIVE_TIMEOUT_S = 3600


@router.post("", **documented(o.ModelResources, body=ResourceCreateIn))
def create(
    *,
    body: BodyDep,
    svc: ServicesDep,
    user: UserDep,
) -> dict[str, Any]:
    request = parse(ResourceCreateIn, body)
    request.check_supported()
    compute = request.compute_config
    replicas = (
        1
        if compute is None or compute.num_generator_replicas is None
        else (compute.num_generator_replicas)
    )
    record = svc.resources.create(
        user,
        base_model=request.base_model,
        lora_enabled=True if request.lora_enabled is None else request.lora_enabled,
        num_generator_replicas=replicas,
        inactive_timeout=(
            DEFAULT_INACTIVE_TIMEOUT_S
            if request.inactive_timeout is None
            else request.inactive_timeout
        ),
        muon_scaling=request.muon_scaling(),
    )
    return o.ModelResources.of(record).wire()


@router.post("/estimate-cost", **documented(o.EstimateCost, body=ResourceCreateIn))
def estimate_cost(
    *,
    body: BodyDep,
    svc: ServicesDep,
    user: UserDep,
) -> dict[str, Any]:
    request = parse(ResourceCreateIn, body)
    request.check_supported()
    svc.resources.check_base_model(request.base_model)
    if request.inactive_timeout is not None:
        svc.resources.check_inactive_timeout(request.inactive_timeout)
    # Self-hosted: the hardware is already paid for.
    return o.EstimateCost.model_construct(currency="USD", price_per_hour=0.0).wire()


@router.get("", **documented(o.ModelResourcesList))
def list_resources(
    *,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=100),
    status: Annotated[list[str] | None, Query()] = None,
    created_by: str | None = None,
    svc: ServicesDep,
    user: UserDep,
) -> dict[str, Any]:
    records = svc.resources.list(user, status_filter(status, ResourceStatus))
    if created_by not in (None, "me", user):
        records = []
    return page(
        o.ModelResourcesList, [o.ModelResources.of(r) for r in records], limit=limit, after=after
    )


@router.get("/{resource_id}", **documented(o.ModelResources))
def retrieve(*, resource_id: str, svc: ServicesDep, user: UserDep) -> dict[str, Any]:
    return o.ModelResources.of(svc.resources.get(user, resource_id)).wire()


@router.post("/{resource_id}/extend-expiry", **documented(o.ModelResources, body=ExtendExpiryIn))
def extend_expiry(
    *,
    resource_id: str,
    body: BodyDep,
    svc: ServicesDep,
    user: UserDep,
) -> dict[str, Any]:
    request = parse(ExtendExpiryIn, body)
    record = svc.resources.extend_expiry(user, resource_id, request.seconds)
    return o.ModelResources.of(record).wire()


@router.post("/{resource_id}/stop", **documented(o.ModelResources))
def stop(
    *,
    resource_id: str,
    force: bool = False,
    svc: ServicesDep,
    user: UserDep,
) -> dict[str, Any]:
    record = svc.resources.stop(user, resource_id, force=force, stop_session=svc.sessions.stop)
    return o.ModelResources.of(record).wire()
