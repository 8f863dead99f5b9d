"""Operation routes: POST .../operations/{kind} (Idempotency-Key required) and its GET, and
the seed-era POST .../{session_id}:sample (the key optional).

The route turns the wire body (with any offloaded payload merged in, api.md 1.6) into a domain
request and hands it to the service; the request fingerprint is taken over the inline body
only, because retries resend the same inline body with the same payload_id (api.md 7.1).
A replay of a known Idempotency-Key is answered before the body is validated or its payload
loaded. Every step that parses, reads the store or renders runs on a worker thread, never on
the event loop.

The GET of a PENDING or RUNNING operation is held until the operation finishes or
`poll_hold_seconds` pass (service/operations/polls.py): the SDK's first poll, sent right after the
POST, then already carries the result, and the SDK never sleeps its 0.5 s poll interval.

A sample POST sent while other sample POSTs of its session are unanswered is held the same way
(service/operations/arrivals.py counts them). The SDK checks the status a POST answers before it
polls (`async_wait_for_operation`), so an operation answered done is never polled: a client that
fans out one-sample operations (tinker-cookbook's RL loop, `Generator.sample_async` under
asyncio.gather) sends one request per operation instead of two. Measured, 64 such operations
cost the SDK 0.16 s of CPU instead of 0.43 s (docs/benchmarks.md). A POST sent alone is
answered at once: a loop that submits operations one by one and collects them later (the
tinker shim's synchronous `sample`, which blocks until its POST is answered) keeps submitting
while they run, and their operations still share a pass.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Header, Response
from starlette.concurrency import run_in_threadpool

from posttrain.api.contract import OPTIONAL_KEY, documented
from posttrain.api.deps import RawBodyDep, ServicesDep, UserDep, loads_strict
from posttrain.api.kinds import WIRE_KINDS
from posttrain.api.responses import json_bytes
from posttrain.errors import InvalidRequest, NotFound, posttrainError
from posttrain.records import OperationRecord
from posttrain.service import Services
from posttrain.types import OperationKind, OperationRequest

log = logging.getLogger("posttrain.api")
router = APIRouter(prefix="/v1/rl/training-sessions")


def rendered(op: OperationRecord) -> Response:
    """The operation as JSON bytes, built by the caller's worker thread: FastAPI would otherwise
    run jsonable_encoder and json.dumps over a large sample output on the event loop."""
    reply = WIRE_KINDS[op.kind].reply.of(op)
    return Response(content=json_bytes(reply), media_type="application/json")


def _kind(kind: str) -> OperationKind:
    try:
        return OperationKind(kind)
    except ValueError:
        raise NotFound(f"unknown operation kind {kind!r}", param="kind") from None


def submit(
    svc: Services, user: str, session_id: str, kind: OperationKind, raw: bytes, key: str | None
) -> OperationRecord:
    """`key` None: the seed-era route, whose clients never send one (api.md 5.6)."""
    session = svc.sessions.get(user, session_id)  # 404 before any body work
    body = loads_strict(raw)
    fingerprint = hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    if key is not None and (replayed := svc.operations.replay(session_id, kind, key, fingerprint)):
        return replayed
    request = parsed(svc, session_id, kind, body)
    return svc.operations.submit(
        user, session, kind, idempotency_key=key, fingerprint=fingerprint, request=request
    )


def parsed(
    svc: Services, session_id: str, kind: OperationKind, body: dict[str, Any]
) -> OperationRequest:
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
    return WIRE_KINDS[kind].to_request(full, svc.config.sampler)


def keep_wire_bodies_as_requests(svc: Services) -> None:
    """At startup, before the restart recovery: an older server kept the HTTP bodies of
    unfinished and journaled operations instead of their typed requests. Parse each once, as
    at submit, and keep the request the service reads back itself. One that no longer parses
    (its payload gone) stays unreadable: the recovery fails its operation or session, saying
    so."""
    for op, raw in svc.operations.wire_bodies():
        try:
            request = parsed(svc, op.session_id, op.kind, loads_strict(raw))
        except posttrainError as exc:
            log.warning("operation %s: its kept body no longer parses: %s", op.id, exc)
            continue
        svc.operations.keep_request(op.id, request)


def closing(response: Response, was_held: bool) -> Response:
    """A request that was held closes its connection; one answered at once keeps it. A client
    with many operations in flight holds a connection per held request besides those of its
    other requests, and httpx's pool (the SDK's client) scans every idle connection on each
    request and response: measured, 64 concurrent one-sample SDK operations took 1.7-2.4 s
    with the connections kept and 0.5-0.7 s with held GETs closing theirs
    (docs/benchmarks.md). A new loopback connection costs well under a millisecond."""
    if was_held:
        response.headers["Connection"] = "close"
    return response


async def held(
    svc: Services, user: str, session_id: str, kind: OperationKind, operation_id: str
) -> Response:
    """The GET of an operation, answered once it finishes or the poll hold passes."""
    answer = await svc.polls.settled(user, session_id, kind, operation_id)
    return closing(await run_in_threadpool(rendered, answer.op), answer.was_held)


async def posted(
    svc: Services, user: str, session_id: str, kind: OperationKind, raw: bytes, key: str | None
) -> Response:
    """The POST of an operation; a sample POST beside others of its session is held. What
    finished already is rendered on the thread that submitted it."""
    if kind != OperationKind.SAMPLE or svc.arrivals.unanswered(session_id) <= 1:
        return await run_in_threadpool(
            lambda: rendered(submit(svc, user, session_id, kind, raw, key))
        )

    def first() -> tuple[OperationRecord, Response | None]:
        op = submit(svc, user, session_id, kind, raw, key)
        return op, (rendered(op) if svc.polls.is_settled(op) else None)

    op, response = await run_in_threadpool(first)
    if response is not None:
        return response
    answer = await svc.polls.settled(user, session_id, kind, op.id)
    return closing(await run_in_threadpool(rendered, answer.op), answer.was_held)


def required_key(key: str | None) -> str:
    """The Idempotency-Key every 3.1.1 operation POST carries (api.md 1.4.1)."""
    if not key:
        raise InvalidRequest(
            "the Idempotency-Key header is required on operation POSTs", param="Idempotency-Key"
        )
    return key


def _poster(kind: OperationKind) -> Callable[..., Awaitable[Response]]:
    async def create(
        *,
        session_id: str,
        body: RawBodyDep,
        idempotency_key: str | None = Header(None, alias="Idempotency-Key"),
        svc: ServicesDep,
        user: UserDep,
    ) -> Response:
        key = required_key(idempotency_key)
        return await posted(svc, user, session_id, kind, body, key)

    return create


@router.post(
    "/{session_id}:sample",
    name="sample_alias",
    **documented(
        WIRE_KINDS[OperationKind.SAMPLE].reply, body=WIRE_KINDS[OperationKind.SAMPLE].body
    ),
)
async def sample_alias(
    *,
    session_id: str,
    body: RawBodyDep,
    idempotency_key: str | None = Header(None, alias="Idempotency-Key", description=OPTIONAL_KEY),
    svc: ServicesDep,
    user: UserDep,
) -> Response:
    """The April-era sample route (api.md 5.6), an alias of .../operations/sample. Its
    clients sent no Idempotency-Key: without one, the operation is not deduplicated."""
    key = idempotency_key or None
    return await posted(svc, user, session_id, OperationKind.SAMPLE, body, key)


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
        wire = WIRE_KINDS[kind]
        name = kind.name.lower()
        router.add_api_route(
            path,
            _poster(kind),
            methods=["POST"],
            name=f"create_{name}",
            **documented(wire.reply, body=wire.body, body_required=wire.is_body_required),
        )
        router.add_api_route(
            f"{path}/{{operation_id}}",
            _getter(kind),
            methods=["GET"],
            name=f"retrieve_{name}",
            **documented(wire.reply),
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
    known = _kind(kind)
    return await posted(svc, user, session_id, known, body, required_key(idempotency_key))


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
