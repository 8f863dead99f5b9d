"""The engine behind a process boundary: each model resource's weights, sessions and passes live
in a worker process of their own, and the API process sends it typed commands.

`ProcessEngine` implements the Engine protocol (interface.py). Calls that concern a base model,
not a resource (`model_info`, `check_tokens`, `device_name`, `export_merged`), run in the API
process on a LocalEngine that never loads a resource. Every other call names its resource first
and is sent to that resource's worker (`WorkerProcess`): a `spawn`ed process running a
LocalEngine, started by `load_resource` and stopped by `unload_resource` or `close`.

The wire is a pipe carrying pickled `(method, args, kwargs)` commands and `(ok, value)` answers;
requests and results are the frozen dataclasses of posttrain.types, so the same objects cross
it that the in-process engine takes. An exception raised in the worker comes back as itself
(posttrain's errors keep their class, message and `param`). A callable argument
(`sample_batch`'s `between_tokens`, which may publish weights mid-sample) stays in the API
process: the worker calls back through the pipe, the callback runs here, and the commands it
sends (a `publish`) are served by the worker while it waits.

A worker that dies (killed, crashed, out of memory) fails the call in flight and every later
one with WorkerDied (INTERNAL_ERROR naming the worker and how it ended); the API process lives
on, and `is_loaded` answers False so the service can load the resource again.

Imports: config, errors, types, engine (local, interface, placement); torch only inside the
workers and the catalog engine.
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
from typing import TYPE_CHECKING, Any

from posttrain.config import EngineConfig
from posttrain.engine.interface import ModelInfo
from posttrain.engine.local import LocalEngine
from posttrain.errors import EngineFailure, WorkerDied

if TYPE_CHECKING:
    from posttrain.engine.placement import Placement, WorkerHandle

# Served in the API process: they read a base model's files, never a resource's state.
CATALOG = ("device_name", "model_info", "check_tokens", "export_merged")
# Calls that only drop state: on a dead worker there is nothing left to drop.
FORGETTING = ("drop_session",)
# The role of a resource's trainer worker (engine/placement.py names the others).
TRAINER = "worker"
# A worker answers within this many seconds of being asked to stop, or is killed.
STOP_GRACE_S = 10.0


class _Callback:
    """Stands in the pipe for a callable argument; the worker calls it back by name."""

    def __init__(self, name: str) -> None:
        self.name = name


class WorkerProcess:
    """One resource's worker: a process, the API end of its pipe, and a lock that keeps one
    call (with its nested callbacks) on the pipe at a time."""

    def __init__(
        self,
        resource_id: str,
        config: EngineConfig,
        model_paths: dict[str, Path],
        *,
        role: str = TRAINER,
        label: str | None = None,
        engine: tuple = (),
    ):
        """The process serves commands on `engine` = (class, *args), built there as
        `class(config, model_paths, *args)` (default: a LocalEngine); `label` names it in
        errors."""
        self.resource_id = resource_id
        self.label = label or f"the worker process of model resource {resource_id}"
        context = multiprocessing.get_context("spawn")  # fork would copy torch's threads' locks
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_serve,
            args=(child, config, model_paths, *engine),
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

    def call(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        callbacks = {k: v for k, v in kwargs.items() if callable(v)}
        sent = {k: (_Callback(k) if k in callbacks else v) for k, v in kwargs.items()}
        with self._lock:
            self._send((method, args, sent))
            while True:
                kind, value = self._receive()
                if kind == "callback":
                    try:
                        callbacks[value]()
                        self._send(("resume", None, {}))
                    except BaseException as exc:
                        self._send(("raise", (exc,), {}))
                    continue
                if kind == "error":
                    raise value
                return value

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
                    self._send(("stop", (), {}))
                except WorkerDied:
                    pass
            self.process.join(STOP_GRACE_S)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
            self.conn.close()
            self.dead = self.dead or "stopped"

    def _send(self, message: tuple) -> None:
        self._check()
        try:
            self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self._died()

    def _receive(self) -> tuple[str, Any]:
        self._check()
        try:
            return pickle.loads(self.conn.recv_bytes())
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self._died()

    def _check(self) -> None:
        if self.dead is not None:
            raise WorkerDied(f"{self.label} {self.dead}")

    def _died(self) -> None:
        self.process.join(1.0)
        code = self.process.exitcode
        how = (
            "is gone"
            if code is None
            else (f"was killed by signal {-code}" if code < 0 else f"exited with status {code}")
        )
        self.dead = f"(pid {self.process.pid}) {how}"
        self._check()


class ProcessEngine:
    def __init__(
        self,
        config: EngineConfig,
        model_paths: dict[str, Path],
        placement: Placement | None = None,
    ) -> None:
        """`placement` starts the workers (engine/placement.py; default: local processes)."""
        from posttrain.engine.placement import LocalPlacement  # it imports WorkerProcess

        self.config = config
        self.model_paths = model_paths
        self.placement = placement or LocalPlacement(config, model_paths)
        self._catalog = LocalEngine(config, model_paths)  # never loads a resource
        self._workers: dict[str, WorkerHandle] = {}
        self._lock = threading.Lock()

    def load_resource(self, resource_id: str, base_model: str, **kwargs: Any) -> None:
        with self._lock:
            worker = self._workers.get(resource_id)
            if worker is not None and worker.dead is not None:
                worker.stop()  # reap it before its replacement starts
                worker = None
            if worker is None:
                self.placement.reserve(resource_id, kwargs.get("generator_replicas", 1))
                label = f"the worker process of model resource {resource_id}"
                worker = self.placement.start(resource_id, TRAINER, (), label=label)
                self._workers[resource_id] = worker
        worker.call("load_resource", (resource_id, base_model), kwargs)

    def unload_resource(self, resource_id: str) -> None:
        with self._lock:
            worker = self._workers.pop(resource_id, None)
        if worker is not None:
            worker.stop()
        self.placement.release(resource_id)

    def is_loaded(self, resource_id: str) -> bool:
        with self._lock:
            worker = self._workers.get(resource_id)
        return worker is not None and worker.dead is None

    def worker_pid(self, resource_id: str) -> int | None:
        """The resource's worker process id (for operators and the fault tests)."""
        with self._lock:
            worker = self._workers.get(resource_id)
        return None if worker is None else worker.pid

    def close(self) -> None:
        """Stop every worker (server shutdown)."""
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        for worker in workers:
            worker.stop()
        self.placement.close()

    def model_info(self, base_model: str) -> ModelInfo:
        return self._catalog.model_info(base_model)

    def generator_lanes(self, resource_id: str) -> int:
        return 0  # the worker's generator shares its trainer's process (replicas.py: apart)

    def generator_fence(self, resource_id: str) -> int:
        return 0

    def __getattr__(self, method: str) -> Callable[..., Any]:
        """Every other Engine method: the catalog's, or the named resource's worker's."""
        return forward_by_resource(
            self._catalog, method, self._worker, lambda worker: worker.dead is not None
        )

    def _worker(self, resource_id: str) -> Any:
        with self._lock:
            return self._workers.get(resource_id)


def forward_by_resource(
    catalog: LocalEngine,
    method: str,
    handle_of: Callable[[str], Any],
    gone: Callable[[Any], bool],
) -> Callable[..., Any]:
    """An Engine method of an engine whose resources live elsewhere (ProcessEngine's workers,
    trainer_group.py's rank groups), by name: the catalog's own for CATALOG methods; else sent
    to the resource's handle (`handle_of`, None where nothing holds it: the catalog then
    raises NotFound), and a FORGETTING call on a handle that is `gone` does nothing."""
    if method.startswith("_") or not callable(getattr(LocalEngine, method, None)):
        raise AttributeError(method)
    if method in CATALOG:
        return getattr(catalog, method)

    def forwarded(resource_id: str, *args: Any, **kwargs: Any) -> Any:
        handle = handle_of(resource_id)
        if handle is None:
            return getattr(catalog, method)(resource_id, *args, **kwargs)  # NotFound
        if gone(handle) and method in FORGETTING:
            return None  # what it would drop died with the handle's processes
        return handle.call(method, (resource_id, *args), kwargs)

    return forwarded


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
    engine_class: type = LocalEngine,
    *engine_args: Any,
) -> None:
    """A worker's loop: run each command on its engine and answer it, until told to stop."""
    _die_with_parent()
    engine = engine_class(config, model_paths, *engine_args)

    def receive() -> tuple[str, tuple, dict[str, Any]]:
        return pickle.loads(conn.recv_bytes())

    def answer(kind: str, value: Any) -> None:
        try:
            data = pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # an unpicklable result or exception: say what it was
            data = pickle.dumps(("error", EngineFailure(f"{type(value).__name__}: {exc}")))
        conn.send_bytes(data)

    def run(method: str, args: tuple, kwargs: dict[str, Any]) -> None:
        for key, value in kwargs.items():
            if isinstance(value, _Callback):
                kwargs[key] = called_back(value.name)
        try:
            result = getattr(engine, method)(*args, **kwargs)
        except BaseException as exc:
            answer("error", exc)
        else:
            answer("ok", result)

    def called_back(name: str) -> Callable[[], None]:
        def call() -> None:
            answer("callback", name)
            while True:  # the callback's own commands (a publish) run here until it returns
                method, args, kwargs = receive()
                if method == "resume":
                    return
                if method == "raise":
                    raise args[0]
                run(method, args, kwargs)

        return call

    try:
        while True:
            method, args, kwargs = receive()
            if method == "stop":
                return
            run(method, args, kwargs)
    except (EOFError, OSError):
        return  # the API process is gone
