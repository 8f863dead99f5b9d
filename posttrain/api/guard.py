"""ASGI middleware that bounds a request before its body is read: the caller's key is checked
first (401 without reading a byte), and no body may exceed the configured size (413, as soon
as the declared Content-Length or the bytes received so far pass it).

Every POST route of the API needs a bearer key, so a POST is authenticated here; a payload
upload (PUT of a signed URL, api.md 1.6: the SDK sends no Authorization) is authorized by its
signature in the route, and only bounded here, by the larger payload limit. Methods without a
body pass through.

Imports: api.deps, api.responses, api.tinker.handshake, errors, service (the Services the
app's state holds).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from posttrain.api.deps import authenticate
from posttrain.api.responses import error_response
from posttrain.api.tinker.handshake import authorization_of
from posttrain.errors import PayloadTooLarge, posttrainError
from posttrain.service import Services

PAYLOAD_UPLOAD_PREFIX = "/v1/rl/payloads/"


class RequestGuard:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        services: Services | None = (
            getattr(scope["app"].state, "services", None) if scope["type"] == "http" else None
        )
        if services is None or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limits = services.config.limits
        upload = scope["method"] == "PUT" and scope["path"].startswith(PAYLOAD_UPLOAD_PREFIX)
        mib = limits.max_payload_mib if upload else limits.max_body_mib
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            if not upload:
                authenticate(services.config, authorization_of(headers))
            declared = headers.get("content-length", "")
            if declared.isdigit() and int(declared) > mib << 20:
                raise _too_large(mib)
        except posttrainError as exc:
            await _answer(exc, scope, receive, send)
            return
        await self.app(scope, _bounded(receive, mib), send)


def _too_large(mib: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the request body is over the server's {mib} MiB limit", param="body")


def _bounded(receive: Receive, mib: int) -> Receive:
    """`receive` that raises PayloadTooLarge once more than `mib` MiB arrived (a chunked body
    declares no length); the app's error handler answers 413."""
    received = 0

    async def bounded() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > mib << 20:
                raise _too_large(mib)
        return message

    return bounded


async def _answer(exc: posttrainError, scope: Scope, receive: Receive, send: Send) -> None:
    response = error_response(exc.http_status, exc.error_type, exc.message, exc.param)
    # Closing after an unread body: the client may still be sending it.
    response.headers["connection"] = "close"
    await response(scope, receive, send)
