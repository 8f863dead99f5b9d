"""`--generators vllm`: each generator replica of a model resource is a vLLM server process
(hosts/vllm/server.py); the trainer stays in posttrain (any trainer engine, wrapped).

`VllmEngine` is a LanedEngine (engine/interface.py): one generator lane per server, so the
scheduler sends samples to the servers at their place in the resource's FIFO while the trainer
goes on. A lane's generation is a stream (hosts/vllm/stream.py): a sample handed to a busy lane
goes to its server as it comes (vLLM batches its requests continuously), after the server
applied the changes staged up to the sample's fence, where none of them alters a session
decoding there (the lanes' join rule, hosts/staged_changes.py).

The lanes themselves (fences, staging under the resource's lock, a dead server's restart, the
join rule's record) are hosts/lanes.py's GeneratorLanes, which ReplicatedEngine shares; this
module is what differs for vLLM servers: how a server starts and is reached, how a change's
weights get there, and how a lane samples.

What each session's generator serves reaches the servers as staged changes (hosts/vllm/replica.py's
Install and Drop), numbered by fence, exactly as for process replicas
(hosts/replicas/engine.py): a change is written once, to
files in shared memory, the moment the trainer makes it; a sample applies every change up to its
fence, and none after it, before it generates. So SYNCHRONOUS and BACKGROUND_PUBLISH land
before the samples submitted after them, whichever server runs them.

- A LoRA session is a vLLM adapter named by its session id (PEFT format,
  checkpoint/formats.py), loaded through a link per server (hosts/vllm/replica.py); dropping
  the session unloads it.
- A full-weight session's weights go to a safetensors file that each server reloads through
  its worker extension (hosts/vllm/worker_extension.py, vLLM's `reload_weights`).
- After each set of changes the server's weight-version label moves on (posttrain keeps what
  every session served under each label), and each install gives its session a new prefix
  cache salt, so no prompt KV of old weights is read again (hosts/vllm/replica.py).
- PIPELINE (`mid_generation`): a server that is generating pauses at a token boundary
  (`/pause?mode=keep`), takes the install, moves its label and resumes; each choice's
  `weight_versions` spans then give the sample's policy_segments.

A server that dies fails the sample running on it with GeneratorReplicaDied (INTERNAL_ERROR,
naming it); the next sample on its lane starts a new server, given what every session's
generator serves on the trainer. Servers stop with their resource.

Imports: config, types, engine (interface, model.loader; hosts: lanes; vllm: replica, requests,
scoring, server, stream).
"""

from __future__ import annotations

import random
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from posttrain.config import EngineConfig
from posttrain.engine.hosts.lanes import GeneratorLanes
from posttrain.engine.hosts.vllm.replica import Drop, Install, Replica, Resource, write_install
from posttrain.engine.hosts.vllm.requests import generate_body, result_of
from posttrain.engine.hosts.vllm.scoring import scored
from posttrain.engine.hosts.vllm.server import MAX_NUM_SEQS, SERVED_NAME, ServerSpec, VllmServer
from posttrain.engine.hosts.vllm.stream import VllmStream
from posttrain.engine.interface import Engine, Headroom, ModelInfo
from posttrain.model.loader import resolve_device, resolve_dtype
from posttrain.types import (
    LoraConfig,
    OperationKind,
    OperationRequest,
    SampleRequest,
    SampleResult,
)

# Sample fields no vLLM server honours here, and why (a 400 naming the field).
REFUSED = (("return_routed_experts", "vLLM generators do not record MoE expert routes"),)
# vLLM 0.32's CPU backend fails prompt logprobs whenever LoRA is enabled (its LoRA logits
# processor indexes prompt rows with the sampled rows' adapter indices) and the engine dies.
REFUSED_ON_CPU = tuple(
    (name, "vLLM 0.32's CPU backend cannot score prompt tokens with LoRA enabled")
    for name in ("prompt_logprobs", "topk_prompt_logprobs")
)


class VllmEngine(GeneratorLanes[Resource, Replica]):
    """A LanedEngine: the trainer engine for everything but sampling, vLLM servers for that."""

    def __init__(self, trainer: Engine, config: EngineConfig, model_paths: dict[str, Path]):
        assert config.vllm_python is not None, "EngineConfig checks --vllm-python"
        # Held around every call into the trainer: mismatch scoring runs on generator lanes.
        super().__init__(trainer, threading.RLock())
        self.config = config
        self.model_paths = model_paths
        self.device = resolve_device(config.device)
        shm = Path("/dev/shm")  # installs are written to memory where the system has it
        root = tempfile.mkdtemp(prefix="posttrain-vllm-", dir=shm if shm.is_dir() else None)
        self._root = Path(root)
        # The servers' logs outlive them (a replica that died is read about afterwards).
        self._logs = Path(tempfile.gettempdir()) / "posttrain-vllm-logs"

    # ------------------------------------------------------------ servers

    def _trainer_replicas(self, generator_replicas: int) -> int:
        return 1  # the trainer's own generator is not a lane: the servers are

    def _new_lanes(self, resource_id: str, base_model: str) -> Resource:
        with self.trainer_lock:
            info = self.trainer.model_info(base_model)
        dtype = str(resolve_dtype(self.config.dtype, self.device)).removeprefix("torch.")
        spec = ServerSpec(
            python=Path(self.config.vllm_python),  # type: ignore[arg-type]
            model_path=self.model_paths[base_model],
            dtype=dtype,
            max_model_len=info.context_length,
            max_loras=self.config.max_sessions_per_resource,
            max_lora_rank=self.config.max_lora_rank,
            log_path=self._logs / f"{resource_id}.log",  # one per replica: _server
            gpu_memory_utilization=0.4 if self.device.type == "cuda" else None,
        )
        return Resource(base_model, spec, self._root / resource_id)

    def _start(self, resource_id: str, state: Resource, count: int) -> list[Replica]:
        started = [self._server(resource_id, state, i) for i in range(count)]
        try:
            for server in started:  # started together: their loads overlap
                server.wait_ready()
        except Exception:
            for server in started:
                server.stop()
            with self._lock:
                self._resources.pop(resource_id, None)
            raise
        return [Replica(server, state.files / f"served-{i}") for i, server in enumerate(started)]

    def _server(self, resource_id: str, state: Resource, index: int) -> VllmServer:
        spec = replace(state.spec, log_path=self._logs / f"{resource_id}-{index}.log")
        return VllmServer(spec, f"generator replica {index} of model resource {resource_id}")

    def _rebuilt(self, resource_id: str, state: Resource, lane: int) -> Replica:
        new = Replica(self._server(resource_id, state, lane), state.files / f"served-{lane}")
        try:
            new.server.wait_ready()
            for session_id in state.sessions:
                directory = state.files / f"rebuild-{lane}-{session_id}"
                path, version = self._written(resource_id, state, session_id, directory)
                lora = state.sessions[session_id] is not None
                new.apply([Install(state.fence, session_id, lora, version, path)])
            new.applied = state.fence
        except Exception:
            new.server.stop()
            raise
        return new

    def _stop_lanes(self, state: Resource) -> None:
        for replica in state.replicas:
            replica.server.stop()
        shutil.rmtree(state.files, ignore_errors=True)

    def _closed(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)

    def _alive(self, replica: Replica) -> bool:
        return replica.server.alive

    def _stop(self, replica: Replica) -> None:
        replica.server.stop()

    def _pid(self, replica: Replica) -> int | None:
        return replica.server.pid

    def model_info(self, base_model: str) -> ModelInfo:
        refused = REFUSED + (REFUSED_ON_CPU if self.device.type == "cpu" else ())
        with self.trainer_lock:
            info = self.trainer.model_info(base_model)
        return replace(info, refused_sample_fields=refused)

    # ------------------------------------------------------------ staged changes

    def _stage_create(
        self, resource_id: str, state: Resource, session_id: str, lora: LoraConfig | None
    ) -> None:
        self._stage_install(resource_id, state, session_id, mid_generation=False)

    def _stage_drop(
        self, resource_id: str, state: Resource, session_id: str, lora: LoraConfig | None
    ) -> None:
        self._stage(state, Drop(state.fence + 1, session_id, lora is not None))

    def _installed_mid_generation(self, state: Resource, replicas: list[Replica]) -> None:
        """PIPELINE: generating servers take the install at their next token."""
        for replica in replicas:
            self._apply_mid_generation(state, replica)

    def _stage_install(
        self, resource_id: str, state: Resource, session_id: str, *, mid_generation: bool
    ) -> None:
        """Stage what the session's generator serves on the trainer now, as files."""
        fence = state.fence + 1
        path, version = self._written(resource_id, state, session_id, state.files / f"{fence}")
        lora = state.sessions[session_id] is not None
        self._stage(state, Install(fence, session_id, lora, version, path, mid_generation))

    def _written(
        self, resource_id: str, state: Resource, session_id: str, directory: Path
    ) -> tuple[Path, int]:
        """The session's served weights as files a server loads: a directory holding a PEFT
        adapter, or one safetensors file of the whole model; and their policy version."""
        with self.trainer_lock:
            tensors, version = self.trainer.generator_state(resource_id, session_id)
        state.written.add(directory)
        write_install(directory, tensors, state.sessions[session_id], state.base_model)
        return directory, version

    def _stage(self, state: Resource, change: Install | Drop) -> None:
        self._record(state, change)
        state.last_change[change.session_id] = change.fence
        state.changes.append(change)

    # ------------------------------------------------------------ applying, per server

    def _apply_due(
        self, state: Resource, replica: Replica, fence: int, busy: frozenset[str]
    ) -> int:
        """Apply every staged change up to `fence` not yet applied, at a token boundary if
        requests run (`busy`: their sessions; the label then moves with the weights), then
        load afresh the in-place adapters of the sessions that are not busy; the fence the
        server serves now."""
        with replica.lock:
            with state.lock:
                due = [c for c in state.changes if replica.applied < c.fence <= fence]
            if due and busy:
                replica.apply_between_tokens(due)
            else:
                replica.apply(due)
            replica.settle(busy)
            applied = replica.applied
        self._collect(state)
        return applied

    def _apply_mid_generation(self, state: Resource, replica: Replica) -> None:
        """PIPELINE: a generating server takes the staged installs that are next in its order,
        all PIPELINE, between two tokens; otherwise they wait for its next sample."""
        with replica.lock:
            if not replica.generating or not replica.server.alive:
                return
            with state.lock:
                due = [c for c in state.changes if c.fence > replica.applied]
            if due and all(c.pipeline for c in due):
                replica.apply_between_tokens(due)

    def _collect(self, state: Resource) -> None:
        """Forget the changes every server has applied, and the files nothing refers to any
        more: vLLM reads an adapter's files when it first uses it, not when it is loaded, so
        an adapter's directory stays while a server serves it. A request names its session's
        link (Replica._link), never a directory, so whatever vLLM loads for it at a later
        step is the install the link points to, which stays."""
        with state.lock:
            done = min((r.applied for r in state.replicas), default=state.fence)
            state.changes = [c for c in state.changes if c.fence > done]
            in_use = {c.path for c in state.changes if isinstance(c, Install)} | {
                path for r in state.replicas for path in r.files.values()
            }
            for directory in state.written - in_use:
                shutil.rmtree(directory, ignore_errors=True)
            state.written &= in_use

    # ------------------------------------------------------------ sampling

    def lane_stream(
        self, resource_id: str, session_id: str, *, fence: int, lane: int
    ) -> VllmStream:
        """A stream on the lane's server (hosts/vllm/stream.py): each operation's requests go
        to the server as the operation comes, after the changes staged up to its fence; the
        server batches them continuously. Bound to that server: if it dies, the stream's
        operations fail with GeneratorReplicaDied, and the lane's next sample starts another."""
        state = self._required(resource_id)
        replica = self._lane_replica(state, resource_id, lane)

        def closed() -> None:
            replica.generating = False
            with state.lock:
                state.streams.discard(stream)

        stream = VllmStream(
            lambda session_id, prompt, request: self._generate(
                state, replica, session_id, prompt, request
            ),
            lambda fence, busy: self._apply_due(state, replica, fence, busy),
            lambda session_id, request, results, applied: self._finish(
                resource_id, state, session_id, request, results, applied
            ),
            closed,
            MAX_NUM_SEQS,
        )
        replica.generating = True  # PIPELINE installs land while it is open
        with state.lock:
            state.streams.add(stream)
        return stream

    def wake_lanes(self, resource_id: str) -> None:
        state = self._state(resource_id)
        if state is not None:
            with state.lock:
                streams = list(state.streams)
            for stream in streams:
                stream.wake()

    def sample_batch(
        self,
        resource_id: str,
        items: list[tuple[str, SampleRequest]],
        *,
        between_tokens: Callable[[], None] | None = None,
        fence: int = 0,
        lane: int = 0,
    ) -> list[list[SampleResult]]:
        """One lane's generation as of `fence`: a stream that admits every item at once and
        ends with the last of them."""
        stream = self.lane_stream(resource_id, items[0][0], fence=fence, lane=lane)
        try:
            ids = stream.admit(items, fence)
            done: dict[int, list[SampleResult]] = {}
            while len(done) < len(ids):
                stream.block()
                done.update(stream.take_finished())
            return [done[i] for i in ids]
        finally:
            stream.close()

    def _finish(
        self,
        resource_id: str,
        state: Resource,
        session_id: str,
        request: SampleRequest,
        results: list[SampleResult],
        applied: int,
    ) -> list[SampleResult]:
        """An operation's results as handed back: at the configured rate (vllm_mismatch_rate)
        with the trainer's scoring of their tokens, where the trainer's generator serves what
        vLLM sampled with (no change of the session staged after the generation began, none
        while scoring)."""
        if random.random() >= self.config.vllm_mismatch_rate:
            return results

        def current() -> bool:
            with state.lock:
                return state.last_change.get(session_id, 0) <= applied

        with self.trainer_lock:
            context = self.trainer.model_info(state.base_model).context_length
        return scored(
            self.trainer,
            self.trainer_lock,
            resource_id,
            session_id,
            request,
            results,
            context,
            current,
        )

    def _generate(
        self,
        state: Resource,
        replica: Replica,
        session_id: str,
        prompt: tuple[int, ...],
        request: SampleRequest,
    ) -> SampleResult:
        model = SERVED_NAME if state.sessions.get(session_id) is None else session_id
        body = generate_body(prompt, request, model, replica.salts.get(session_id))
        reply = replica.server.call("/inference/v1/generate", body)
        fallback = replica.serving.get(session_id, 0)
        return result_of(reply, replica.version_of(session_id), fallback)

    # ------------------------------------------------------------ memory

    def peak_bytes(
        self, resource_id: str, kind: OperationKind, items: list[tuple[str, OperationRequest]]
    ) -> int:
        """A sample's memory is the vLLM server's own (its KV cache is sized at start)."""
        if kind == OperationKind.SAMPLE:
            return 0
        with self.trainer_lock:
            return self.trainer.peak_bytes(resource_id, kind, items)

    def headroom(self, resource_id: str, kind: OperationKind | None = None) -> Headroom:
        if kind == OperationKind.SAMPLE:
            return Headroom(free_bytes=1 << 62, bound="the vLLM server's own KV cache")
        with self.trainer_lock:
            return self.trainer.headroom(resource_id, kind)
