"""Operation routes: POST .../operations/{kind} (Idempotency-Key required) and its GET.

The route turns the wire body (with any offloaded payload merged in, api.md 1.6) into a domain
request and hands it to the service; the request fingerprint is taken over the inline body
only, because retries resend the same inline body with the same payload_id (api.md 7.1).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from fastapi import APIRouter, Header

from posttrain.api.deps import BodyDep, ServicesDep, UserDep, parse
from posttrain.api.responses import operation_json
from posttrain.api.schemas.losses import CustomForwardBackwardIn, ForwardBackwardIn
from posttrain.api.schemas.steps import OptimStepIn, SampleIn, WeightsSyncIn
from posttrain.errors import InvalidRequest, NotFound, Unsupported
from posttrain.service import Services
from posttrain.types import OperationKind

router = APIRouter(prefix="/v1/rl/training-sessions")


def _kind(kind: str) -> OperationKind:
    try:
        return OperationKind(kind)
    except ValueError:
        raise NotFound(f"unknown operation kind {kind!r}", param="kind") from None


def to_request(kind: OperationKind, body: dict[str, Any], svc: Services) -> Any:
    if kind == OperationKind.FORWARD_BACKWARD:
        return parse(ForwardBackwardIn, body).to_domain()
    if kind == OperationKind.CUSTOM_FORWARD_BACKWARD:
        return parse(CustomForwardBackwardIn, body).to_domain()
    if kind == OperationKind.OPTIM_STEP:
        return parse(OptimStepIn, body).to_domain()
    if kind == OperationKind.WEIGHTS_SYNC:
        return parse(WeightsSyncIn, body).to_domain()
    if kind == OperationKind.SAMPLE:
        sampler = svc.config.sampler
        return parse(SampleIn, body).to_domain(
            max_tokens=sampler.max_tokens,
            temperature=sampler.temperature,
            num_samples=sampler.num_samples,
        )
    if kind in (OperationKind.TRAINING_CHECKPOINT, OperationKind.INFERENCE_CHECKPOINT):
        if body:  # these operations take no body (api.md 1.4.7, 1.4.8)
            field = next(iter(body))
            raise InvalidRequest(f"{field}: unknown field; {kind} takes no body", param=field)
        return None
    raise Unsupported(f"{kind} operations are not supported yet", param="kind")


def submit(
    svc: Services, user: str, session_id: str, kind: OperationKind, body: dict, key: str | None
) -> dict[str, Any]:
    if not key:
        raise InvalidRequest(
            "the Idempotency-Key header is required on operation POSTs", param="Idempotency-Key"
        )
    svc.sessions.get(user, session_id)  # 404 before any body work for an unknown session
    fingerprint = hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    full = body
    if isinstance(payload_id := body.get("payload_id"), str):
        full = {**body, **svc.payloads.load(session_id, payload_id)}
    request = to_request(kind, full, svc)
    record = svc.operations.submit(
        user, session_id, kind, idempotency_key=key, fingerprint=fingerprint, request=request
    )
    return operation_json(record)


@router.post("/{session_id}:sample")
def sample_alias(
    *,
    session_id: str,
    body: BodyDep,
    idempotency_key: str | None = Header(None, alias="Idempotency-Key"),
    svc: ServicesDep,
    user: UserDep,
) -> dict[str, Any]:
    """April-era route (api.md 5.6), an alias of .../operations/sample."""
    return submit(svc, user, session_id, OperationKind.SAMPLE, body, idempotency_key)


@router.post("/{session_id}/operations/{kind}")
def create_operation(
    *,
    session_id: str,
    kind: str,
    body: BodyDep,
    idempotency_key: str | None = Header(None, alias="Idempotency-Key"),
    svc: ServicesDep,
    user: UserDep,
) -> dict[str, Any]:
    return submit(svc, user, session_id, _kind(kind), body, idempotency_key)


@router.get("/{session_id}/operations/{kind}/{operation_id}")
def retrieve_operation(
    *,
    session_id: str,
    kind: str,
    operation_id: str,
    svc: ServicesDep,
    user: UserDep,
) -> dict[str, Any]:
    return operation_json(svc.operations.get(user, session_id, _kind(kind), operation_id))
