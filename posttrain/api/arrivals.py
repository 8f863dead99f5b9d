"""ASGI middleware: each sample POST counts as arriving (service/operations/arrivals.py) from the
moment its request is received until its operation is queued (or, for a request refused with a 4xx,
until it is answered), and as unanswered until it is answered.

Imports: service (through the app's state).
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from posttrain.service import Services
from posttrain.service.operations.arrivals import CURRENT_ARRIVAL

SAMPLE_POST = re.compile(r"^/v1/rl/training-sessions/([^/:]+)(?::sample|/operations/sample)$")


class ArrivalsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = None
        if scope["type"] == "http" and scope["method"] == "POST":
            match = SAMPLE_POST.match(scope["path"])
        services: Services | None = (
            getattr(scope["app"].state, "services", None) if match else None
        )
        if match is None or services is None:
            await self.app(scope, receive, send)
            return
        arrival = services.arrivals.start(match.group(1))

        async def answering(message: Message) -> None:
            # Counted answered before the answer's last bytes leave, not after: a client that
            # sends its next sample POST as soon as this one is answered (the tinker shim's
            # synchronous sample) must not find this one still unanswered and be held.
            if message["type"] == "http.response.body" and not message.get("more_body"):
                arrival.answered()
            await send(message)

        # Seen by the handler's worker thread (the context is copied there): the scheduler
        # ends the arrival once the operation is queued.
        reset = CURRENT_ARRIVAL.set(arrival)
        try:
            await self.app(scope, receive, answering)
        finally:  # a request that ended without an answer (a dropped connection)
            arrival.answered()
            CURRENT_ARRIVAL.reset(reset)
