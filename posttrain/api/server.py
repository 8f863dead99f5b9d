"""Serving the app with uvicorn: the server's log lines, its introduction, and a clean stop.

uvicorn's shutdown waits for in-flight requests before the app's lifespan ends, and a held
operation GET (service/operations/completion.py) would keep it waiting up to the hold limit; so the
server wakes every held GET first, and each answers the operation's current status.

A signal stops the server once: uvicorn would re-raise it after its shutdown (a SIGINT as a
KeyboardInterrupt traceback), so the signal is kept and becomes the exit status instead. The
process then ends without Python's finalization (`leave`): a resource's worker thread may
still be inside a torch pass, and finalization ends such a daemon thread with pthread_exit,
which aborts the process in torch's C++ frames ("terminate called without an active
exception"). The store is crash-safe, so what that pass had not recorded runs again at the
next start. Log records are one line each; a traceback is shown at log level debug only.

Imports: config, service (the Services the app's state holds), uvicorn.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Generator
from pathlib import Path
from types import FrameType
from typing import NoReturn

import uvicorn
from fastapi import FastAPI

from posttrain.config import ServerConfig
from posttrain.service import Services

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The exit status of a stop by each signal: Ctrl-C reports 130 as a shell expects of an
# interrupted command; SIGTERM is how service managers ask for a stop, which then succeeded.
EXIT_STATUS: dict[int, int] = {signal.SIGINT: 130, signal.SIGTERM: 0}


class OneLineFormatter(logging.Formatter):
    """`time LEVEL logger: message`, an exception appended as `(Type: message)` on the same
    line; with `tracebacks`, the full traceback below it as usual."""

    def __init__(self, *, tracebacks: bool) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        if self.tracebacks:
            return super().format(record)
        message = record.getMessage()
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        if lines and lines[0].startswith("Traceback"):
            lines = lines[-1:]  # a traceback passed as text (starlette's lifespan failure)
        message = " ".join(lines)
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            message += f" ({type(exc).__name__}: {exc})".replace("\n", " ")
        return f"{self.formatTime(record)} {record.levelname} {record.name}: {message}"


def configure_logging(level: str, *, access_log: bool) -> None:
    """One handler on stderr for every logger. uvicorn's own start and stop lines show with
    the access log or at debug; its warnings and errors always."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(tracebacks=level == "debug"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    chatty = access_log or level == "debug"
    logging.getLogger("uvicorn.error").setLevel(level.upper() if chatty else "WARNING")
    logging.getLogger("uvicorn.access").setLevel("INFO" if access_log else "WARNING")


def shown_path(path: Path) -> str:
    return str(path) if path.is_absolute() else f"./{path}"


def introduction(config: ServerConfig, port: int) -> str:
    """The line a started server prints: what it serves, where, and where its data lives."""
    host = f"[{config.host}]" if ":" in config.host else config.host
    url = f"http://{host}:{port}"
    models = ", ".join(spec.id for spec in config.models)
    return (
        f"posttrain: serving {models} at {url} (the SDK's base_url; dashboard {url}/;"
        f" data in {shown_path(config.data_dir)})"
    )


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, *, app: FastAPI, intro: str) -> None:
        super().__init__(config)
        self.served_app = app
        self.intro = intro
        self.stop_signal: int | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.intro, file=sys.stderr, flush=True)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        services: Services | None = getattr(self.served_app.state, "services", None)
        if services is not None:
            services.watch.close()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.stop_signal is None:
            self.stop_signal = sig
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's, without raising the signal again once the server has stopped."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(app: FastAPI, *, sock: socket.socket, config: ServerConfig) -> int:
    """Serve `app` on `sock`, already listening (api/listen.py says why), until a signal
    stops it; the exit status: 0 or 130 after a stop by SIGTERM or SIGINT, 1 when the app
    failed to start (its log line says why)."""
    configure_logging(config.log_level, access_log=config.access_log)
    intro = introduction(config, sock.getsockname()[1])
    uvicorn_config = uvicorn.Config(app, log_config=None, access_log=config.access_log)
    server = Server(uvicorn_config, app=app, intro=intro)
    server.run(sockets=[sock])
    if not server.started:
        return 1
    stop = server.stop_signal
    name = signal.Signals(stop).name if stop is not None else "shutdown"
    print(f"posttrain: stopped ({name})", file=sys.stderr, flush=True)
    return EXIT_STATUS.get(stop, 0) if stop is not None else 0


def leave(status: int) -> NoReturn:
    """End the process with `status` after the server stopped: the atexit handlers (worker
    processes, Ray) and the flushes of a normal exit, without the finalization that would
    abort on a worker thread still inside torch (the module docstring says why)."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
