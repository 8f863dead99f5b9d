"""Serving an app with uvicorn, ending held polls as soon as shutdown begins.

uvicorn's shutdown waits for in-flight requests before the app's lifespan ends, and a held
operation GET (service/completion.py) would keep it waiting up to the hold limit; so the
server wakes every held GET first, and each answers the operation's current status.

Imports: api.app (through the app's state), uvicorn.
"""

from __future__ import annotations

import socket

import uvicorn
from fastapi import FastAPI


class Server(uvicorn.Server):
    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        services = getattr(self.config.app.state, "services", None)
        if services is not None:
            services.watch.close()
        await super().shutdown(sockets)


def serve(app: FastAPI, *, sock: socket.socket, log_level: str) -> None:
    """Serve `app` on `sock`, already listening (api/listen.py says why)."""
    Server(uvicorn.Config(app, log_level=log_level)).run(sockets=[sock])
