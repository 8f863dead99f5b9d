"""ASGI middleware: each sample POST counts as arriving (service/arrivals.py) from the moment
its request is received until its response starts, which is after its operation was queued.

Imports: service (through the app's state).
"""

from __future__ import annotations

import re
from typing import Any

SAMPLE_POST = re.compile(r"^/v1/rl/training-sessions/([^/:]+)(?::sample|/operations/sample)$")


class ArrivalsMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        match = None
        if scope["type"] == "http" and scope["method"] == "POST":
            match = SAMPLE_POST.match(scope["path"])
        services = getattr(scope["app"].state, "services", None) if match else None
        if services is None:
            await self.app(scope, receive, send)
            return
        arriving = services.arrivals.arriving(match.group(1))  # type: ignore[union-attr]
        arriving.__enter__()
        done = False

        async def send_and_release(message: dict) -> None:
            nonlocal done
            if message["type"] == "http.response.start" and not done:
                done = True
                arriving.__exit__(None, None, None)
            await send(message)

        try:
            await self.app(scope, receive, send_and_release)
        finally:
            if not done:
                arriving.__exit__(None, None, None)
