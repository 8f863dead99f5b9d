"""Operation routes: POST .../operations/{kind} (Idempotency-Key required) and its GET.

The route turns the wire body (with any offloaded payload merged in, api.md 1.6) into a domain
request and hands it to the service; the request fingerprint is taken over the inline body
only, because retries resend the same inline body with the same payload_id (api.md 7.1).
A replay of a known Idempotency-Key is answered before the body is validated or its payload
loaded. Every step that parses, reads the store or renders runs on a worker thread, never on
the event loop.

The GET of a PENDING or RUNNING operation is held until the operation finishes or
`poll_hold_seconds` pass (service/completion.py): the SDK's first poll, sent right after the
POST, then already carries the result, and the SDK never sleeps its 0.5 s poll interval.

A sample POST sent while other sample POSTs of its session are unanswered is held the same way
(service/arrivals.py counts them). The SDK checks the status a POST answers before it polls
(`async_wait_for_operation`), so an operation answered done is never polled: a client that
fans out one-sample operations (tinker-cookbook's RL loop, `Generator.sample_async` under
asyncio.gather) sends one request per operation instead of two. Measured, 64 such operations
cost the SDK 0.16 s of CPU instead of 0.43 s (docs/benchmarks.md). A POST sent alone is
answered at once: a loop that submits operations one by one and collects them later (the
tinker shim's synchronous `sample`, which blocks until its POST is answered) keeps submitting
while they run, and their operations still share a pass.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Header, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from posttrain.api.contract import documented
from posttrain.api.deps import RawBodyDep, ServicesDep, UserDep, loads_strict, parse
from posttrain.api.responses import operation_json
from posttrain.api.schemas.losses import CustomForwardBackwardIn, ForwardBackwardIn
from posttrain.api.schemas.outputs import OPERATION_REPLIES
from posttrain.api.schemas.steps import OptimStepIn, SampleIn, WeightsSyncIn
from posttrain.errors import InvalidRequest, NotFound, Unsupported
from posttrain.service import Services
from posttrain.service.completion import Waiter
from posttrain.statuses import OPERATION_TERMINAL
from posttrain.types import (
    CheckpointRequest,
    CheckpointType,
    OperationKind,
    OperationRecord,
    OperationRequest,
)

router = APIRouter(prefix="/v1/rl/training-sessions")


def rendered(op: OperationRecord) -> Response:
    """The operation as JSON bytes, built by the caller's worker thread: FastAPI would otherwise
    run jsonable_encoder and json.dumps over a large sample output on the event loop."""
    body = json.dumps(operation_json(op), separators=(",", ":"), allow_nan=False)
    return Response(content=body.encode(), media_type="application/json")


def _kind(kind: str) -> OperationKind:
    try:
        return OperationKind(kind)
    except ValueError:
        raise NotFound(f"unknown operation kind {kind!r}", param="kind") from None


def to_request(kind: OperationKind, body: dict[str, Any], svc: Services) -> OperationRequest:
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
        training = kind == OperationKind.TRAINING_CHECKPOINT
        return CheckpointRequest(CheckpointType.TRAINING if training else CheckpointType.INFERENCE)
    raise Unsupported(f"{kind} operations are not supported yet", param="kind")


def submit(
    svc: Services, user: str, session_id: str, kind: OperationKind, raw: bytes, key: str | None
) -> OperationRecord:
    if not key:
        raise InvalidRequest(
            "the Idempotency-Key header is required on operation POSTs", param="Idempotency-Key"
        )
    svc.sessions.get(user, session_id)  # 404 before any body work for an unknown session
    body = loads_strict(raw)
    fingerprint = hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    replayed = svc.operations.replay(session_id, kind, key, fingerprint)
    if replayed is not None:
        return replayed
    request = parsed(svc, session_id, kind, body)
    return svc.operations.submit(
        user,
        session_id,
        kind,
        idempotency_key=key,
        fingerprint=fingerprint,
        request=request,
        body=raw,
    )


def parsed(svc: Services, session_id: str, kind: OperationKind, body: dict[str, Any]):
    """The domain request of an inline body, its offloaded payload merged in (api.md 1.6)."""
    full = body
    if isinstance(payload_id := body.get("payload_id"), str):
        try:
            payload = loads_strict(svc.payloads.read(session_id, payload_id))
        except InvalidRequest as exc:  # the payload's own problem: name the field that sent it
            raise InvalidRequest(
                f"payload {payload_id}: {exc.message}", param="payload_id"
            ) from None
        full = {**body, **payload}
    return to_request(kind, full, svc)


def reparsed(svc: Services, op: OperationRecord, raw: bytes) -> OperationRequest:
    """After a restart: the request of an operation that had not finished, from the body it
    arrived with, parsed exactly as at submit."""
    return parsed(svc, op.session_id, op.kind, loads_strict(raw))


async def answered_when_done(
    svc: Services,
    user: str,
    session_id: str,
    kind: OperationKind,
    look: Callable[[], OperationRecord],
    known_id: str | None = None,
) -> Response:
    """The operation `look` returns, answered once it finishes or the poll hold passes.

    On one worker thread, the operation is watched before its status is read, so a completion
    in between is not missed: when `known_id` names it (a GET), the watch comes first and
    `look` is the one read; otherwise (a POST, whose id `look` makes) `look`, then for an
    operation not yet terminal a watch and a second read. A terminal one is rendered in the
    same trip. A woken request renders the record the completion handed over; one that was not
    (a hold that passed, a shutdown) reads it again."""

    def read(op_id: str) -> OperationRecord:
        return svc.operations.get(user, session_id, kind, op_id)

    hold = svc.config.poll_hold_seconds
    loop = asyncio.get_running_loop()
    watched: list[Waiter] = []

    def first() -> tuple[OperationRecord, Response | None]:
        if known_id is not None and hold > 0:
            watched.append(svc.watch.watch(known_id, loop))
        op = look()
        if op.status in OPERATION_TERMINAL or hold <= 0:
            return op, rendered(op)
        if not watched:
            watched.append(svc.watch.watch(op.id, loop))
            op = read(op.id)
        return op, (rendered(op) if op.status in OPERATION_TERMINAL else None)

    try:
        op, response = await run_in_threadpool(first)
        if response is not None:
            return response
        (waiter,) = watched
        try:
            await asyncio.wait_for(waiter.wait(), timeout=hold)
        except TimeoutError:
            pass  # the hold passed: answer the current status, the SDK polls again
        done = waiter.record
        response = await run_in_threadpool(
            lambda: rendered(done if done is not None else read(op.id))
        )
    finally:
        for waiter in watched:
            svc.watch.forget(waiter)
    # A client with many operations in flight holds a connection per held request besides
    # those of its other requests, and httpx's pool (the SDK's client) scans every idle
    # connection on each request and response: measured, 64 concurrent one-sample SDK
    # operations took 1.7-2.4 s with the connections kept and 0.5-0.7 s with held GETs closing
    # theirs (docs/benchmarks.md). A new loopback connection costs well under a millisecond.
    response.headers["Connection"] = "close"
    return response


async def held(
    svc: Services, user: str, session_id: str, kind: OperationKind, operation_id: str
) -> Response:
    """The GET of an operation, answered once it finishes or the poll hold passes."""

    def look() -> OperationRecord:
        return svc.operations.get(user, session_id, kind, operation_id)

    return await answered_when_done(svc, user, session_id, kind, look, known_id=operation_id)


async def posted(
    svc: Services, user: str, session_id: str, kind: OperationKind, raw: bytes, key: str | None
) -> Response:
    """The POST of an operation; a sample POST beside others of its session is held."""

    def look() -> OperationRecord:
        return submit(svc, user, session_id, kind, raw, key)

    if kind == OperationKind.SAMPLE and svc.arrivals.unanswered(session_id) > 1:
        return await answered_when_done(svc, user, session_id, kind, look)
    return await run_in_threadpool(lambda: rendered(look()))


# The body model of each operation kind that takes one; the checkpoints take none.
BODIES: dict[OperationKind, type[BaseModel]] = {
    OperationKind.FORWARD_BACKWARD: ForwardBackwardIn,
    OperationKind.CUSTOM_FORWARD_BACKWARD: CustomForwardBackwardIn,
    OperationKind.OPTIM_STEP: OptimStepIn,
    OperationKind.WEIGHTS_SYNC: WeightsSyncIn,
    OperationKind.SAMPLE: SampleIn,
}


def _poster(kind: OperationKind) -> Callable[..., Awaitable[Response]]:
    async def create(
        *,
        session_id: str,
        body: RawBodyDep,
        idempotency_key: str | None = Header(None, alias="Idempotency-Key"),
        svc: ServicesDep,
        user: UserDep,
    ) -> Response:
        return await posted(svc, user, session_id, kind, body, idempotency_key)

    return create


# April-era route (api.md 5.6), an alias of .../operations/sample.
router.post(
    "/{session_id}:sample",
    name="sample_alias",
    **documented(OPERATION_REPLIES[OperationKind.SAMPLE], body=SampleIn),
)(_poster(OperationKind.SAMPLE))


def _getter(kind: OperationKind) -> Callable[..., Awaitable[Response]]:
    async def retrieve(
        *, session_id: str, operation_id: str, svc: ServicesDep, user: UserDep
    ) -> Response:
        return await held(svc, user, session_id, kind, operation_id)

    return retrieve


def _add_kind_routes() -> None:
    """One documented path per kind, each with its own body and reply (contract.py); the
    path-templated routes below answer the same, and a 404 for an unknown kind."""
    for kind in OperationKind:
        path = f"/{{session_id}}/operations/{kind.value}"
        reply = OPERATION_REPLIES[kind]
        name = kind.name.lower()
        body_required = kind != OperationKind.OPTIM_STEP  # `{}` or nothing: the defaults
        router.add_api_route(
            path,
            _poster(kind),
            methods=["POST"],
            name=f"create_{name}",
            **documented(reply, body=BODIES.get(kind), body_required=body_required),
        )
        router.add_api_route(
            f"{path}/{{operation_id}}",
            _getter(kind),
            methods=["GET"],
            name=f"retrieve_{name}",
            **documented(reply),
        )


_add_kind_routes()  # before the templated routes, which would match the same paths


@router.post("/{session_id}/operations/{kind}", include_in_schema=False)
async def create_operation(
    *,
    session_id: str,
    kind: str,
    body: RawBodyDep,
    idempotency_key: str | None = Header(None, alias="Idempotency-Key"),
    svc: ServicesDep,
    user: UserDep,
) -> Response:
    return await posted(svc, user, session_id, _kind(kind), body, idempotency_key)


@router.get("/{session_id}/operations/{kind}/{operation_id}", include_in_schema=False)
async def retrieve_operation(
    *,
    session_id: str,
    kind: str,
    operation_id: str,
    svc: ServicesDep,
    user: UserDep,
) -> Response:
    return await held(svc, user, session_id, _kind(kind), operation_id)
