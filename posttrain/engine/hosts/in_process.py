"""The engine in this process, and the registry: loaded base models and their sessions, keyed
by model resource and session id, behind the Engine protocol (engine/interface.py).

Each method finds its resource and session here and hands them to the part that owns the work:
the trainer (train/trainer.py), the generator (generate/generator.py), the memory estimates
(memory/) or the checkpoint formats (checkpoint/). What a resource and a session hold is
engine/state.py. A resource's methods run on its one worker thread
(service/scheduling/scheduler.py), so per-resource state needs no lock; only the resource table,
changed from other threads, has one. Hosted in a worker process, it also keeps the decode streams
its caller opened, by id (hosts/remote_streams.py's StreamHost).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.config import EngineConfig
from posttrain.engine.checkpoint import durable, formats
from posttrain.engine.checkpoint.session_tensors import copy_into_trainer, trainer_tensors
from posttrain.engine.generate import generator
from posttrain.engine.generate.prefix_cache import PrefixCache
from posttrain.engine.generate.sample_stream import SessionSampleStream, open_stream
from posttrain.engine.hosts import full_weight_sessions
from posttrain.engine.hosts.messages import Measured
from posttrain.engine.hosts.remote_streams import StreamHost
from posttrain.engine.hosts.threads import use_intra_op_threads
from posttrain.engine.interface import Engine, Headroom, ModelInfo
from posttrain.engine.memory.footprint import (
    ResourceFootprint,
    SessionFootprint,
    resource_footprint,
    session_footprint,
)
from posttrain.engine.memory.headroom import headroom
from posttrain.engine.memory.operation_peak import layer_checkpointing, operation_peak_bytes
from posttrain.engine.optim.optimizer import SessionOptimizer
from posttrain.engine.state import ResourceState, SessionState
from posttrain.engine.train import trainer
from posttrain.errors import InvalidRequest, NotFound
from posttrain.model.context_length import context_length, text_config
from posttrain.model.loader import load_model, resolve_device, resolve_dtype, route_shape
from posttrain.model.lora import AdapterSpec, LoraModel
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

log = logging.getLogger("posttrain")


class LocalEngine(StreamHost, Engine, Measured):
    writes_files = True  # False on a trainer group's ranks but rank 0 (trainer_group.py)

    def __init__(self, config: EngineConfig, model_paths: dict[str, Path]) -> None:
        super().__init__()
        self.config = config
        self.model_paths = model_paths
        # engine/hosts/threads.py says how many and why.
        use_intra_op_threads(config.threads, model_dirs=model_paths.values())
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self._resources: dict[str, ResourceState] = {}
        self._lock = threading.Lock()
        self._info: dict[str, ModelInfo] = {}

    # ------------------------------------------------------------ models and resources

    def device_name(self) -> str:
        """What the weights run on: `cpu`, or the CUDA device's product name (`NVIDIA H200`)."""
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return self.device.type

    def model_info(self, base_model: str) -> ModelInfo:
        """Limits of a base model, read from its config.json without loading weights."""
        if base_model not in self._info:
            config = json.loads((self.model_paths[base_model] / "config.json").read_text())
            context = context_length(config)
            limit = self.config.max_seq_length
            if limit is not None and limit > context:  # a setting not honoured: said once
                log.warning(
                    "--max-seq-length %d is past %s's context of %d tokens: its training"
                    " samples are limited to %d",
                    limit,
                    base_model,
                    context,
                    context,
                )
            self._info[base_model] = ModelInfo(
                vocab_size=int(str(text_config(config)["vocab_size"])),
                context_length=context,
                max_seq_length=context if limit is None else min(limit, context),
                max_batch_size=self.config.max_batch_size,
                max_lora_rank=self.config.max_lora_rank,
                moe=route_shape(self.model_paths[base_model]),
            )
        return self._info[base_model]

    def load_resource(
        self,
        resource_id: str,
        base_model: str,
        *,
        muon_scaling: MuonScaling | None,
        generator_replicas: int = 1,
    ) -> None:
        """Load the base model for a resource. Its generator runs here, on the trainer's
        model and thread, whatever `generator_replicas` says (hosts/replicas/engine.py: apart)."""
        with self._lock:
            if resource_id in self._resources:
                return
        loaded = load_model(self.model_paths[base_model], self.device, self.dtype)
        state = ResourceState(
            loaded,
            LoraModel(loaded.model),
            muon_scaling,
            model_path=self.model_paths[base_model],
            prefix_cache=PrefixCache(self.config.prefix_cache_mib << 20),
        )
        with self._lock:
            self._resources.setdefault(resource_id, state)

    def unload_resource(self, resource_id: str) -> None:
        with self._lock:
            self._resources.pop(resource_id, None)

    def close(self) -> None:  # nothing to stop: the resources live and die with this process
        pass

    def is_loaded(self, resource_id: str) -> bool:
        with self._lock:
            return resource_id in self._resources

    def _resource(self, resource_id: str) -> ResourceState:
        with self._lock:
            state = self._resources.get(resource_id)
        if state is None:
            raise NotFound(f"model resource {resource_id} is not loaded")
        return state

    def _session(self, resource_id: str, session_id: str) -> tuple[ResourceState, SessionState]:
        resource = self._resource(resource_id)
        session = resource.sessions.get(session_id)
        if session is None:
            raise NotFound(f"session {session_id} has no state on resource {resource_id}")
        return resource, session

    def _find_session(self, resource_id: str, session_id: str) -> SessionState | NotFound:
        """The session's state, or the NotFound that _session would raise."""
        try:
            return self._session(resource_id, session_id)[1]
        except NotFound as exc:
            return exc

    # ------------------------------------------------------------ sessions

    def create_session(self, resource_id: str, session_id: str, lora: LoraConfig | None) -> None:
        """A LoRA session (its own adapter on the shared base), or with `lora` None the one
        full-weight session of the resource (train/full_weight.py)."""
        resource = self._resource(resource_id)
        assert not any(s.is_full_weight for s in resource.sessions.values()), (
            f"resource {resource_id} already hosts a full-weight session"
        )
        if lora is None:
            full_weight_sessions.create(self.config, resource, session_id)
            return
        spec = AdapterSpec(lora.rank, lora.alpha, lora.dropout, lora.seed, lora.train_unembed)
        named = resource.lora.add_adapter(session_id, spec)
        generator_key = generator.generator_key(session_id)
        resource.lora.copy_adapter(session_id, generator_key)
        optimizer = SessionOptimizer(named, muon_scaling=resource.muon_scaling)
        resource.sessions[session_id] = SessionState(session_id, generator_key, optimizer)

    def drop_session(self, resource_id: str, session_id: str) -> None:
        with self._lock:
            resource = self._resources.get(resource_id)
        if resource is None or session_id not in resource.sessions:
            return
        session = resource.sessions.pop(session_id)
        generator.forget(resource, session)
        if session.is_full_weight:
            full_weight_sessions.end(resource)
            return
        resource.lora.remove_adapter(session.trainer_key)
        resource.lora.remove_adapter(session.generator_key)

    # ------------------------------------------------------------ training (train/trainer.py)

    def forward_backward_batch(
        self, resource_id: str, items: list[tuple[str, ForwardBackwardRequest]]
    ) -> list[ForwardBackwardResult | Exception]:
        """Forward-backward of several sessions' requests in one shared pass (train/trainer.py); an
        item whose session has no state here fails alone with NotFound."""
        resource = self._resource(resource_id)
        sessions = [self._find_session(resource_id, session_id) for session_id, _ in items]
        found = [
            (session, request)
            for session, (_, request) in zip(sessions, items, strict=True)
            if isinstance(session, SessionState)
        ]
        checkpointed = self._checkpointed(
            resource, OperationKind.FORWARD_BACKWARD, [(s, r) for s, r in found]
        )
        outcomes = iter(
            trainer.forward_backward_batch(
                self.config, resource, found, checkpointed=checkpointed
            )
        )
        return [s if isinstance(s, NotFound) else next(outcomes) for s in sessions]

    def custom_forward_backward(
        self, resource_id: str, session_id: str, request: CustomForwardBackwardRequest
    ) -> None:
        resource, session = self._session(resource_id, session_id)
        kind = OperationKind.CUSTOM_FORWARD_BACKWARD
        checkpointed = self._checkpointed(resource, kind, [(session, request)])
        trainer.custom_forward_backward(
            self.config, resource, session, request, checkpointed=checkpointed
        )

    def _checkpointed(
        self,
        resource: ResourceState,
        kind: OperationKind,
        items: list[tuple[SessionState, OperationRequest]],
    ) -> bool:
        """Whether this training pass checkpoints its decoder layers (memory/operation_peak.py:
        the rule peak_bytes counts by)."""
        sessions: list[SessionState | NotFound] = [session for session, _ in items]
        requests = [request for _, request in items]
        itemsize = self.dtype.itemsize
        return layer_checkpointing(
            self.config, resource, kind, sessions, requests, itemsize=itemsize
        )

    def optim_step(self, resource_id: str, session_id: str, request: OptimStepRequest) -> None:
        trainer.optim_step(self._session(resource_id, session_id)[1], request)

    def discard_gradients(self, resource_id: str, session_id: str) -> None:
        """Drop the session's gradients without a step (benchmarks repeating a pass)."""
        self._session(resource_id, session_id)[1].optimizer.zero_grad()

    @contextmanager
    def trainer_model(self, resource_id: str, session_id: str) -> Iterator[nn.Module]:
        """The resource's model with the session's trainer weights applied to every row, for a
        caller's own forward and backward (a benchmark's baseline)."""
        resource, session = self._session(resource_id, session_id)
        with resource.lora.route([(session.trainer_key, None)]):
            yield resource.loaded.model

    # ------------------------------------------------------------ sampling (generate/generator.py)

    def publish(
        self, resource_id: str, session_id: str, *, version: int, mid_generation: bool = False
    ) -> None:
        """weights-sync: the generator serves a copy of the trainer's weights (policy version
        `version`). Safe between decode blocks (PIPELINE); `mid_generation` concerns only
        generators apart (hosts/replicas/engine.py)."""
        generator.publish(*self._session(resource_id, session_id), version=version)

    def generator_lanes(self, resource_id: str) -> int:
        """How many generations may run beside the trainer: none here, where the generator
        shares the trainer's model and thread."""
        return 0

    def generator_fence(self, resource_id: str) -> int:
        """The generator state as of now, for a sample queued at this point (replicas.py)."""
        return 0

    def generator_state(self, resource_id: str, session_id: str) -> tuple[dict[str, Tensor], int]:
        """The session's generator tensors (detached) and policy version
        (hosts/replicas/engine.py)."""
        return generator.state(*self._session(resource_id, session_id))

    def install_generator(
        self, resource_id: str, session_id: str, tensors: dict[str, Tensor], *, version: int
    ) -> None:
        """The generator serves a trainer's generator_state as `version`; safe between blocks."""
        generator.install(*self._session(resource_id, session_id), tensors, version=version)

    def sample_batch(
        self,
        resource_id: str,
        items: list[tuple[str, SampleRequest]],
        *,
        between_tokens: Callable[[], None] | None = None,
    ) -> list[list[SampleResult]]:
        """Several sample operations of one resource (any sessions) in one generation.

        `between_tokens` runs between decode passes and may `publish` (PIPELINE): rows whose
        generator changed continue on the new weights, recorded in policy_segments. One list
        of results (one per prompt) per item. No lane or fence here (hosts/replicas/engine.py)."""
        resource = self._resource(resource_id)
        found = [(self._session(resource_id, sid)[1], request) for sid, request in items]
        return generator.sample_batch(self.config, resource, found, between_tokens=between_tokens)

    def sample_stream(self, resource_id: str, session_id: str) -> SessionSampleStream:
        """sample_batch block by block (generate/sample_stream.py): operations join and leave
        between blocks, and the caller may run other work there."""
        resource, session = self._session(resource_id, session_id)
        return open_stream(
            self.config, resource, session, lambda s: self._session(resource_id, s)[1]
        )

    # ------------------------------------------------------------ sizes (memory/footprint.py)

    def resource_footprint(self, resource_id: str) -> ResourceFootprint:
        """Parameters and exact tensor bytes of the resource: base model and everything."""
        return resource_footprint(self._resource(resource_id))

    def session_footprint(self, resource_id: str, session_id: str) -> SessionFootprint:
        """Exact tensor bytes one session holds: weights, generator, optimizer, gradients."""
        return session_footprint(*self._session(resource_id, session_id))

    # ------------------------------------------------------------ memory (memory/estimate.py)

    def peak_bytes(
        self, resource_id: str, kind: OperationKind, items: list[tuple[str, OperationRequest]]
    ) -> int:
        """Estimated peak bytes that running `items` of `kind` as one pass adds to what the
        resource holds now (a session without state here counts no trainable tensors). On a
        rank of a trainer group: a training pass's largest share of rows, and what sharded
        parameters gather (parallel/fsdp.py); the group is admitted on rank 0's numbers,
        and its ranks hold about the same."""
        resource = self._resource(resource_id)
        requests = [request for _, request in items]
        sessions = []
        if kind != OperationKind.SAMPLE:
            sessions = [self._find_session(resource_id, session_id) for session_id, _ in items]
        return operation_peak_bytes(
            self.config, resource, kind, sessions, requests, itemsize=self.dtype.itemsize
        )

    def headroom(self, resource_id: str, kind: OperationKind | None = None) -> Headroom:
        """What an operation on the resource's device may allocate now (memory/headroom.py)."""
        return headroom(self._resource(resource_id).loaded.device, self.config.memory_limit)

    # ------------------------------------------------------ live state (checkpoint/durable.py)

    def persist_session(
        self,
        resource_id: str,
        session_id: str,
        directory: Path,
        parts: Collection[str],
        record: dict[str, Any],
    ) -> None:
        """Write the named parts of a session's state, with `record`, atomically."""
        resource, session = self._session(resource_id, session_id)
        values: dict[str, Any] = {}
        for part in parts:
            if part == "trainer":
                values[part] = trainer_tensors(resource, session)
            elif part == "generator":
                values[part] = dict(generator.parameters(resource, session))
            elif part == "optimizer":
                values[part] = {
                    "optimizer": session.optimizer.full_state_dict(),
                    "rng": formats.rng_state(),
                }
            elif part == "gradients":
                values[part] = session.optimizer.full_gradients()
        if self.writes_files:
            durable.write(directory, values, record)

    def restore_session(
        self, resource_id: str, session_id: str, directory: Path, *, version: int
    ) -> dict[str, Any]:
        """A freshly created session takes the state persist_session wrote (its generator
        serving policy version `version`); returns the record written with it."""
        resource, session = self._session(resource_id, session_id)
        parts, record = durable.read(directory)
        copy_into_trainer(resource, session, parts["trainer"])
        session.optimizer.load_state_dict(parts["optimizer"]["optimizer"])
        formats.restore_rng(parts["optimizer"]["rng"])
        session.optimizer.load_gradients(parts.get("gradients", {}))
        self.install_generator(resource_id, session_id, parts["generator"], version=version)
        return record

    # ----------------------------------------------------- checkpoints (checkpoint/formats.py)

    def save_training_state(self, resource_id: str, session_id: str, directory: Path) -> None:
        """Trainable tensors, optimizer state and RNG state of a session into `directory`."""
        resource, session = self._session(resource_id, session_id)
        state = session.optimizer.full_state_dict()  # sharded: gathered onto rank 0
        tensors = trainer_tensors(resource, session)
        if self.writes_files:
            assert state is not None, "the optimizer state is gathered onto the rank that writes"
            formats.save_training_state(directory, tensors, state)

    def save_adapter(
        self,
        resource_id: str,
        session_id: str,
        directory: Path,
        *,
        lora: LoraConfig,
        base_model: str,
    ) -> None:
        """The trainer adapter of a LoRA session, in PEFT format, into `directory`."""
        resource, session = self._session(resource_id, session_id)
        tensors = resource.lora.adapter_state(session.trainer_key)
        modules = {name.rsplit(".", 1)[0] for name in tensors}
        targets = formats.peft_target_modules(resource.lora, modules)
        formats.save_peft_adapter(
            directory, tensors, lora=lora, base_model=base_model, target_modules=targets
        )

    def load_training_state(
        self, resource_id: str, session_id: str, directory: Path, *, load_optimizer: bool
    ) -> None:
        """Resume: the session's weights (and optimizer and RNG state) from a training
        checkpoint; the generator then serves the loaded weights."""
        resource, session = self._session(resource_id, session_id)
        state = formats.load_training_state(directory)
        copy_into_trainer(resource, session, state.tensors)
        if load_optimizer:
            session.optimizer.load_state_dict(state.optimizer)
            formats.restore_rng(state.rng)
        generator.refresh(resource, session)

    def load_adapter(self, resource_id: str, session_id: str, directory: Path) -> None:
        """Resume weights only, from an inference checkpoint's PEFT adapter."""
        resource, session = self._session(resource_id, session_id)
        tensors, _ = formats.load_peft_adapter(directory)
        formats.copy_into(session.optimizer.named_params, tensors)
        generator.refresh(resource, session)

    def save_full_model(
        self, resource_id: str, session_id: str, directory: Path, *, base_model: str
    ) -> None:
        """A full-weight session's weights as a complete model directory (its MERGED variant)."""
        resource, session = self._session(resource_id, session_id)
        tensors = trainer_tensors(resource, session)
        if self.writes_files:
            formats.export_full_weights(self.model_paths[base_model], tensors, directory)

    def export_merged(self, base_model: str, adapter_dir: Path, output_dir: Path) -> None:
        """A merged model directory from a PEFT adapter over `base_model`'s own files."""
        formats.export_merged(self.model_paths[base_model], adapter_dir, output_dir)

    def check_tokens(self, base_model: str, tokens: tuple[int, ...], param: str) -> None:
        vocab = self.model_info(base_model).vocab_size
        if not tokens or (min(tokens) >= 0 and max(tokens) < vocab):
            return  # min and max run in C: no Python work per token on the common path
        for index, token in enumerate(tokens):
            if not 0 <= token < vocab:
                raise InvalidRequest(
                    f"{param}[{index}] = {token} is outside the vocabulary [0, {vocab})",
                    param=param,
                )
