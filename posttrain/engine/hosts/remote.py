"""The engine behind a process boundary: each model resource's weights, sessions and passes live
in a worker process of their own (hosts/worker_process.py), and the API process sends it
commands.

`ProcessEngine` implements the Engine protocol (engine/interface.py). Calls that concern a base
model, not a resource (`model_info`, `check_tokens`, `device_name`, `export_merged`), run in
the API process on a LocalEngine that never loads a resource. Every other call names its
resource first and is sent to that resource's worker, started through a Placement by
`load_resource` and stopped by `unload_resource` or `close`. A dead worker makes `is_loaded`
answer False, so the service can load the resource again.

Imports: config, engine (interface, hosts: in_process, local_placement, placement).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.config import EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.hosts.local_placement import LocalPlacement
from posttrain.engine.hosts.placement import TRAINER, Placement, WorkerHandle
from posttrain.engine.interface import ModelInfo

# Served in the API process: they read a base model's files, never a resource's state.
CATALOG = ("device_name", "model_info", "check_tokens", "export_merged")
# Calls that only drop state: on a dead worker there is nothing left to drop.
FORGETTING = ("drop_session",)


class ProcessEngine:
    def __init__(
        self,
        config: EngineConfig,
        model_paths: dict[str, Path],
        placement: Placement | None = None,
    ) -> None:
        """`placement` starts the workers (engine/placement.py; default: local processes)."""
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
