"""The engine behind a process boundary: each model resource lives in processes of its own, and
the API process sends them messages (hosts/messages.py).

`RemoteEngine` implements the Engine protocol (engine/interface.py) once for every engine
whose resources live elsewhere, each method one message. Calls that concern a base model, not a
resource (`model_info`, `check_tokens`, `device_name`, `export_merged`), run in the API
process on a LocalEngine that never loads a resource (the catalog). Every other message names
its resource and goes to that resource's host: what `_start` started for it through a
Placement at `load_resource`, stopped by `unload_resource` or `close`. A host that is gone
makes `is_loaded` answer False, so the service can load the resource again, and a message
that only drops state (`_forget`: DropSession) does nothing there (what it would drop died
with it).

A sample pass streams here too (continuous batching): `sample_stream` opens a decode stream in
the host and drives it step by step (hosts/remote_streams.py).

Two engines differ only in the host: `ProcessEngine` (here, `--workers process`) runs each
resource in one worker process (hosts/process/worker.py); `TrainerGroupEngine`
(hosts/ranks/trainer_group.py, `--trainer-ranks N`) in a group of N rank processes.

Imports: config, errors, types, engine (interface, memory.footprint, hosts: in_process,
local_placement, messages, placement, remote_streams).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from torch import Tensor

from posttrain.config import EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.hosts.messages import (
    CreateSession,
    CustomForwardBackward,
    DiscardGradients,
    DropSession,
    ForwardBackwardBatch,
    GeneratorState,
    LoadAdapter,
    LoadResource,
    LoadTrainingState,
    MeasureHeadroom,
    MeasureResourceFootprint,
    MeasureSessionFootprint,
    Message,
    OpenStream,
    OptimStep,
    PeakBytes,
    PersistSession,
    Publish,
    ResourceMessage,
    RestoreSession,
    SampleBatch,
    SaveAdapter,
    SaveFullModel,
    SaveTrainingState,
)
from posttrain.engine.hosts.placement import TRAINER, Hosted, Placement, WorkerHandle
from posttrain.engine.hosts.process.local_placement import LocalPlacement
from posttrain.engine.hosts.remote_streams import RemoteStream
from posttrain.engine.interface import DecodeStream, Engine, Headroom, ModelInfo
from posttrain.engine.memory.footprint import ResourceFootprint, SessionFootprint
from posttrain.errors import NotFound
from posttrain.types import (
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoraConfig,
    MuonScaling,
    OperationKind,
    OperationRequest,
    OptimStepRequest,
    SampleRequest,
    SampleResult,
)

R = TypeVar("R")


class Host(Protocol):
    """What runs one resource elsewhere: answers the messages a LocalEngine answers (a
    trainer group's RankEngine is one), and stops."""

    def call(self, message: Message[LocalEngine, R]) -> R: ...

    def stop(self) -> None: ...


H = TypeVar("H", bound=Host)


class RemoteEngine(Engine, Generic[H]):
    """The Engine protocol over resources hosted elsewhere: a table of hosts by resource, and
    the catalog for what concerns a base model alone."""

    def __init__(
        self,
        config: EngineConfig,
        model_paths: dict[str, Path],
        placement: Placement | None = None,
    ) -> None:
        """`placement` starts the hosts' processes (hosts/placement.py; default: local)."""
        self.config = config
        self.model_paths = model_paths
        self.placement = placement or LocalPlacement(config, model_paths)
        self._catalog = LocalEngine(config, model_paths)  # never loads a resource
        self._hosts: dict[str, H] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ what a subclass decides

    def _start(self, resource_id: str) -> H:
        """Start the processes that host the resource (its placement is reserved)."""
        raise NotImplementedError

    def _is_gone(self, host: H) -> bool:
        """Whether a process of the host died."""
        raise NotImplementedError

    # ------------------------------------------------------------ resources

    def load_resource(
        self,
        resource_id: str,
        base_model: str,
        *,
        muon_scaling: MuonScaling | None,
        generator_replicas: int = 1,
    ) -> None:
        with self._lock:
            host = self._hosts.get(resource_id)
            if host is not None and self._is_gone(host):
                host.stop()  # reap it before its replacement starts
                host = None
            if host is None:
                self.placement.reserve(resource_id, generator_replicas)
                host = self._start(resource_id)
                self._hosts[resource_id] = host
        host.call(LoadResource(resource_id, base_model, muon_scaling, generator_replicas))

    def unload_resource(self, resource_id: str) -> None:
        with self._lock:
            host = self._hosts.pop(resource_id, None)
        if host is not None:
            host.stop()
        self.placement.release(resource_id)

    def is_loaded(self, resource_id: str) -> bool:
        host = self._host(resource_id)
        return host is not None and not self._is_gone(host)

    def close(self) -> None:
        """Stop every host (server shutdown)."""
        with self._lock:
            hosts, self._hosts = list(self._hosts.values()), {}
        for host in hosts:
            host.stop()
        self.placement.close()

    def _host(self, resource_id: str) -> H | None:
        with self._lock:
            return self._hosts.get(resource_id)

    def _send(self, message: ResourceMessage[LocalEngine, R]) -> R:
        """The message, for its resource's host; its answer."""
        host = self._host(message.resource_id)
        if host is None:
            raise NotFound(f"model resource {message.resource_id} is not loaded")
        return host.call(message)

    def _forget(self, message: ResourceMessage[LocalEngine, None]) -> None:
        """A message that only drops state: nothing to drop where the resource's host is gone
        (what it would drop died with the host's processes)."""
        host = self._host(message.resource_id)
        if host is not None and not self._is_gone(host):
            host.call(message)

    # ------------------------------------------------------------ the catalog's

    def device_name(self) -> str:
        return self._catalog.device_name()

    def model_info(self, base_model: str) -> ModelInfo:
        return self._catalog.model_info(base_model)

    def check_tokens(self, base_model: str, tokens: tuple[int, ...], param: str) -> None:
        self._catalog.check_tokens(base_model, tokens, param)

    def export_merged(self, base_model: str, adapter_dir: Path, output_dir: Path) -> None:
        self._catalog.export_merged(base_model, adapter_dir, output_dir)

    # ------------------------------------------------------------ sessions and passes

    def create_session(self, resource_id: str, session_id: str, lora: LoraConfig | None) -> None:
        self._send(CreateSession(resource_id, session_id, lora))

    def drop_session(self, resource_id: str, session_id: str) -> None:
        self._forget(DropSession(resource_id, session_id))

    def forward_backward_batch(
        self, resource_id: str, items: list[tuple[str, ForwardBackwardRequest]]
    ) -> list[ForwardBackwardResult | Exception]:
        return self._send(ForwardBackwardBatch(resource_id, items))

    def custom_forward_backward(
        self, resource_id: str, session_id: str, request: CustomForwardBackwardRequest
    ) -> None:
        self._send(CustomForwardBackward(resource_id, session_id, request))

    def optim_step(self, resource_id: str, session_id: str, request: OptimStepRequest) -> None:
        self._send(OptimStep(resource_id, session_id, request))

    def discard_gradients(self, resource_id: str, session_id: str) -> None:
        self._send(DiscardGradients(resource_id, session_id))

    # ------------------------------------------------------------ generators

    def publish(
        self, resource_id: str, session_id: str, *, version: int, mid_generation: bool = False
    ) -> None:
        self._send(Publish(resource_id, session_id, version, mid_generation))

    def generator_lanes(self, resource_id: str) -> int:
        return 0  # the host's generator shares its trainer's process (replicas.py: apart)

    def generator_fence(self, resource_id: str) -> int:
        return 0

    def generator_state(self, resource_id: str, session_id: str) -> tuple[dict[str, Tensor], int]:
        return self._send(GeneratorState(resource_id, session_id))

    def sample_batch(
        self,
        resource_id: str,
        items: list[tuple[str, SampleRequest]],
        *,
        between_tokens: Callable[[], None] | None = None,
    ) -> list[list[SampleResult]]:
        return self._send(SampleBatch(resource_id, items, between_tokens))

    def sample_stream(self, resource_id: str, session_id: str) -> DecodeStream | None:
        """A stream open in the resource's host, driven step by step (hosts/remote_streams.py):
        samples join running generations and other sessions' training runs between blocks,
        as in process. Bound to this host: if it dies, the stream's operations fail with its
        WorkerDied. On Ray actors (`--ray`) too: the stream's messages are plain ones (a
        PIPELINE publish between blocks is a message of its own; nothing calls back)."""
        host = self._host(resource_id)
        if host is None:
            raise NotFound(f"model resource {resource_id} is not loaded")
        stream_id = host.call(OpenStream(resource_id, session_id))
        return RemoteStream(host.call, resource_id, stream_id)

    # ------------------------------------------------------------ memory and sizes

    def peak_bytes(
        self, resource_id: str, kind: OperationKind, items: list[tuple[str, OperationRequest]]
    ) -> int:
        return self._send(PeakBytes(resource_id, kind, items))

    def headroom(self, resource_id: str, kind: OperationKind | None = None) -> Headroom:
        return self._send(MeasureHeadroom(resource_id, kind))

    def resource_footprint(self, resource_id: str) -> ResourceFootprint:
        return self._send(MeasureResourceFootprint(resource_id))

    def session_footprint(self, resource_id: str, session_id: str) -> SessionFootprint:
        return self._send(MeasureSessionFootprint(resource_id, session_id))

    # ------------------------------------------------------------ live state and checkpoints

    def persist_session(
        self,
        resource_id: str,
        session_id: str,
        directory: Path,
        parts: Collection[str],
        record: dict[str, Any],
    ) -> None:
        self._send(PersistSession(resource_id, session_id, directory, parts, record))

    def restore_session(
        self, resource_id: str, session_id: str, directory: Path, *, version: int
    ) -> dict[str, Any]:
        return self._send(RestoreSession(resource_id, session_id, directory, version))

    def save_training_state(self, resource_id: str, session_id: str, directory: Path) -> None:
        self._send(SaveTrainingState(resource_id, session_id, directory))

    def save_adapter(
        self,
        resource_id: str,
        session_id: str,
        directory: Path,
        *,
        lora: LoraConfig,
        base_model: str,
    ) -> None:
        self._send(SaveAdapter(resource_id, session_id, directory, lora, base_model))

    def load_training_state(
        self, resource_id: str, session_id: str, directory: Path, *, load_optimizer: bool
    ) -> None:
        self._send(LoadTrainingState(resource_id, session_id, directory, load_optimizer))

    def load_adapter(self, resource_id: str, session_id: str, directory: Path) -> None:
        self._send(LoadAdapter(resource_id, session_id, directory))

    def save_full_model(
        self, resource_id: str, session_id: str, directory: Path, *, base_model: str
    ) -> None:
        self._send(SaveFullModel(resource_id, session_id, directory, base_model))


class ProcessEngine(RemoteEngine[WorkerHandle[LocalEngine]]):
    """`--workers process`: each resource in one worker process running a LocalEngine."""

    def _start(self, resource_id: str) -> WorkerHandle[LocalEngine]:
        label = f"the worker process of model resource {resource_id}"
        return self.placement.start(resource_id, TRAINER, Hosted(LocalEngine), label=label)

    def _is_gone(self, host: WorkerHandle[LocalEngine]) -> bool:
        return host.dead is not None

    def worker_pid(self, resource_id: str) -> int | None:
        """The resource's worker process id (for operators and the fault tests)."""
        worker = self._host(resource_id)
        return None if worker is None else worker.pid
