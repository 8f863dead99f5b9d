"""One engine process and the pipe to it: `WorkerProcess` (the API end) and `_serve` (the
worker's loop). A remote engine (hosts/process/remote.py) or a replica set
(hosts/replicas/engine.py) holds one per process it runs, through a Placement (hosts/placement.py).

The worker is a `spawn`ed process that builds its engine object (`Hosted`: a LocalEngine, a
RankEngine or a ReplicaEngine) and runs each message it is sent (hosts/messages.py: the
message's `run` on that engine). The wire is a pipe carrying pickled messages and `(ok,
value)` answers; requests and results are the frozen dataclasses of posttrain.types, so the
same objects cross it that the in-process engine takes. An exception raised in the worker
comes back as itself (posttrain's errors keep their class, message and `param`). A callable
field (SampleBatch's `between_tokens`, which may publish weights mid-sample) stays in the API
process: the worker calls back through the pipe, the callback runs here, and the messages it
sends (a Publish) are served by the worker while it waits.

A worker that dies (killed, crashed, out of memory) fails the call in flight and every later
one with WorkerDied (INTERNAL_ERROR naming the worker and how it ended); the API process lives
on, and its engine reports the resource unloaded so the service can load it again.

Imports: config, errors, engine.hosts (messages, placement).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar, cast

from posttrain.config import EngineConfig
from posttrain.engine.hosts.messages import Message, callables, replaced
from posttrain.engine.hosts.placement import TRAINER, Hosted, WorkerHandle
from posttrain.errors import EngineFailure, WorkerDied

C = TypeVar("C")  # the class of the engine the process hosts
R = TypeVar("R")

# A worker answers within this many seconds of being asked to stop, or is killed.
STOP_GRACE_S = 10.0
# The pipe's own messages, beside the engine's: end the worker; a callback returned or raised.
_STOP = ("stop",)
_RESUME = ("resume",)
_RAISE = "raise"
# What crosses the pipe to the worker.
_Sent = Message[Any, Any] | tuple[Any, ...]


class _Callback:
    """Stands in the pipe for a callable field; the worker calls it back by name."""

    def __init__(self, name: str) -> None:
        self.name = name


class WorkerProcess(WorkerHandle[C], Generic[C]):
    """One resource's worker: a process, the API end of its pipe, and a lock that keeps one
    call (with its nested callbacks) on the pipe at a time."""

    def __init__(
        self,
        resource_id: str,
        config: EngineConfig,
        model_paths: dict[str, Path],
        engine: Hosted[C],
        *,
        role: str = TRAINER,
        label: str | None = None,
        extra: tuple[object, ...] = (),
    ):
        """The process serves messages on `engine`, built there with `extra` (a replica's
        staging channel) as `engine.build(config, model_paths, *extra)`; `label` names it in
        errors."""
        self.resource_id = resource_id
        self.label = label or f"the worker process of model resource {resource_id}"
        context = multiprocessing.get_context("spawn")  # fork would copy torch's threads' locks
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_serve,
            args=(child, config, model_paths, engine, *extra),
            name=f"posttrain-{role}-{resource_id}",
            daemon=True,  # stopped at the API process's normal exit; kill -9: _die_with_parent
        )
        self.process.start()
        child.close()
        self._lock = threading.RLock()
        self.dead: str | None = None  # why it died, once it has

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.dead is None and self.process.is_alive()

    def call(self, message: Message[C, R]) -> R:
        callbacks = callables(message)
        sent = replaced(message, {name: _Callback(name) for name in callbacks})
        with self._lock:
            self._send(sent)
            while True:
                kind, value = self._receive()
                if kind == "callback":
                    try:
                        callbacks[value]()
                        self._send(_RESUME)
                    except BaseException as exc:
                        self._send((_RAISE, exc))
                    continue
                if kind == "error":
                    raise value
                return cast(R, value)  # what the message's `run` answered there

    def kill(self) -> None:
        """End it now, without waiting for the call in flight (a rank in a collective whose
        peer is gone would wait for it)."""
        if self.process.is_alive():
            self.process.kill()

    def stop(self) -> None:
        """Ask the worker to end; kill it if it does not within STOP_GRACE_S."""
        with self._lock:
            if self.dead is None:
                try:
                    self._send(_STOP)
                except WorkerDied:
                    pass
            self.process.join(STOP_GRACE_S)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
            self.conn.close()
            self.dead = self.dead or "stopped"

    def _send(self, message: _Sent) -> None:
        self._check()
        try:
            self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self._died()

    def _receive(self) -> tuple[str, Any]:
        self._check()
        try:
            answer: tuple[str, Any] = pickle.loads(self.conn.recv_bytes())
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self._died()
        return answer

    def _check(self) -> None:
        if self.dead is not None:
            raise WorkerDied(f"{self.label} {self.dead}")

    def _died(self) -> NoReturn:
        self.process.join(1.0)
        code = self.process.exitcode
        how = (
            "is gone"
            if code is None
            else (f"was killed by signal {-code}" if code < 0 else f"exited with status {code}")
        )
        self.dead = f"(pid {self.process.pid}) {how}"
        raise WorkerDied(f"{self.label} {self.dead}")


def _die_with_parent() -> None:
    """A worker must not outlive a killed API process: idle, it would see its pipe close, but
    in the middle of a long sample it would hold its memory (a GPU's) while the restarted
    server loads the model again. On Linux the kernel kills it when its parent does
    (PR_SET_PDEATHSIG; the parent is the thread that started it, the resource's worker thread,
    which lives as long as the resource). Elsewhere the closed pipe ends it at its next call."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the call took effect
        os._exit(1)


def _serve(
    conn: Connection,
    config: EngineConfig,
    model_paths: dict[str, Path],
    hosted: Hosted[C],
    *extra: object,
) -> None:
    """A worker's loop: run each message on its engine and answer it, until told to stop."""
    _die_with_parent()
    engine = hosted.build(config, model_paths, *extra)

    def receive() -> _Sent:
        message: _Sent = pickle.loads(conn.recv_bytes())
        return message

    def answer(kind: str, value: Any) -> None:
        try:
            data = pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # an unpicklable result or exception: say what it was
            data = pickle.dumps(("error", EngineFailure(f"{type(value).__name__}: {exc}")))
        conn.send_bytes(data)

    def run(message: Message[C, object]) -> None:
        stand_ins = {
            name: called_back(value.name)
            for name, value in vars(message).items()
            if isinstance(value, _Callback)
        }
        try:
            result = replaced(message, stand_ins).run(engine)
        except BaseException as exc:
            answer("error", exc)
        else:
            answer("ok", result)

    def called_back(name: str) -> Callable[[], None]:
        def call() -> None:
            answer("callback", name)
            while True:  # the callback's own commands (a publish) run here until it returns
                message = receive()
                if message == _RESUME:
                    return
                if isinstance(message, tuple):
                    raise message[1]  # (_RAISE, the callback's exception)
                run(message)

        return call

    try:
        while True:
            message = receive()
            if message == _STOP:
                return
            assert isinstance(message, Message), f"unexpected message {message!r}"
            run(message)
    except (EOFError, OSError):
        return  # the API process is gone
