"""The seam the service depends on: the Trainer and Generator protocols, the Engine that
composes them, the LanedEngine whose generators run apart, the DecodeStream a sample pass
steps, and the limits an engine reports per base model.

Each engine implements Engine explicitly: hosts/in_process.py's LocalEngine (the reference:
everything in this process), hosts/process/remote.py's RemoteEngine (resources in worker
processes or trainer groups), hosts/replicas/engine.py's ReplicatedEngine and
hosts/vllm/engine.py's VllmEngine (a Trainer engine with generators apart); engine/build.py
picks one. The last two are LanedEngines: only they take a sample's lane and fence; the others
answer that they have no lanes. Imports: types (torch for type checking only).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from posttrain.types import (
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoraConfig,
    MoeShape,
    MuonScaling,
    OperationKind,
    OperationRequest,
    OptimStepRequest,
    SampleRequest,
    SampleResult,
)

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    context_length: int  # prompt + completion tokens a sample request may span
    max_seq_length: int  # tokens of one training sample (N + 1)
    max_batch_size: int
    max_lora_rank: int
    moe: MoeShape | None = None  # expert routes of an MoE model; None: dense
    # The local directory the model and its tokenizer load from (AutoTokenizer, offline), so a
    # client on this machine can load the same tokenizer. The service fills it in from the
    # served ModelSpec (service/lifecycle/resources.py); an engine leaves it None.
    tokenizer_dir: Path | None = None
    # Sample fields (SampleRequest attributes, named as on the wire) this engine's generators
    # cannot honour, each with why: a request that sets one is refused with a 400 naming it,
    # never served without it (hosts/vllm/engine.py fills it in).
    refused_sample_fields: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Headroom:
    """What an operation may allocate now (memory/headroom.py): the tightest bound, named."""

    free_bytes: int
    bound: str  # which limit it is, for a refusal's message


class DecodeStream(Protocol):
    """Sample operations of one resource decoding block by block on the trainer's lane
    (generate/sample_stream.py): operations join a running generation at a block boundary and
    each is handed back as soon as its every sequence ended, so the caller may run other work
    (another session's training) between two blocks. A weights change published between blocks
    (PIPELINE) reaches the running rows at the next `admit` or `block`."""

    # Whether the session samples the model this stream decodes (one model per generation).
    def can_join(self, session_id: str) -> bool: ...

    # Operations joining at this block boundary: prefilled (prefix cache first) and drawn their
    # first token; returns their ids in this stream, as take_finished names them. `fence`: on a
    # generator lane (LanedEngine.lane_stream), the changes staged up to it are applied first
    # (the scheduler admits only what changes no decoding session); 0 on the trainer's lane,
    # whose generators serve what was published, with nothing staged. At a start (no row
    # running) the stream sizes its decode cache itself: a pool for up to `row_limit` rows,
    # as many as a share of `spare_bytes` (what is free beside the items' own estimate) holds,
    # so later joins within it copy none of the running rows' KV.
    def admit(
        self,
        items: list[tuple[str, SampleRequest]],
        fence: int = 0,
        *,
        row_limit: int = 0,
        spare_bytes: int = 0,
    ) -> list[int]: ...

    # Whether `items` joining now allocate at most `spare_bytes` beyond their own estimate
    # (nothing within the pool; past it, a copy of the running cache): the caller's memory
    # admission of a join, with no pool sizes in the caller.
    def fits(self, items: list[tuple[str, SampleRequest]], spare_bytes: int) -> bool: ...

    # Up to `most` decode blocks of every running sequence: fewer where a sequence ended in one
    # (its operation may have finished), or a generator lane's stream was woken
    # (LanedEngine.wake_lanes: a sample waits to join). The trainer's lane runs one at a time.
    # A vLLM server steps on its own: its stream's `block` waits until a request answered or
    # a wake arrived (hosts/vllm/stream.py).
    def block(self, most: int = 1) -> None: ...

    # (id, one result per prompt) of the operations completed since the last call.
    def take_finished(self) -> list[tuple[int, list[SampleResult]]]: ...

    # The operations (ids in this stream) whose tokens take_progress reports from now on, the
    # set replacing the last one: only operations someone watches (a streamed OpenAI reply)
    # pay for reporting. A stream in another process sends the set with its next step.
    def follow(self, ids: Collection[int]) -> None: ...

    # (id, per sequence: prompt-major, then sample order, the tokens drawn since the last
    # report) of the followed operations still running that drew any since: an operation
    # followed for the first time reports every token drawn so far, so a watch that starts
    # late misses none. A stream in another process reports what its last step brought; a
    # vLLM lane's reports nothing (its requests answer whole: hosts/vllm/stream.py).
    def take_progress(self) -> list[tuple[int, list[list[int]]]]: ...

    # Sequences still decoding (0: the stream is idle).
    def running_rows(self) -> int: ...

    # The pass ended (finished or failed): free the decode state (the pool) now; nothing is
    # called on the stream after it. A stream in another process (hosts/remote_streams.py)
    # lives there until closed.
    def close(self) -> None: ...


class Trainer(Protocol):
    """What trains: a model resource and its sessions (LoRA adapters or the full weights),
    forward-backward and optimizer steps, checkpoints and a session's durable state; and, for
    generators apart from it, the weights a session's generator serves (`generator_state`)."""

    # The resolved device, never the `auto` of the config: `cpu`, or a CUDA product name.
    def device_name(self) -> str: ...

    def model_info(self, base_model: str) -> ModelInfo: ...

    def check_tokens(self, base_model: str, tokens: tuple[int, ...], param: str) -> None: ...

    # `generator_replicas`: the resource's compute_config.num_generator_replicas, which an
    # engine with generators apart (hosts/replicas/engine.py) starts; the others serve from the
    # trainer.
    def load_resource(
        self,
        resource_id: str,
        base_model: str,
        *,
        muon_scaling: MuonScaling | None,
        generator_replicas: int = 1,
    ) -> None: ...

    def unload_resource(self, resource_id: str) -> None: ...

    def is_loaded(self, resource_id: str) -> bool: ...

    # `lora` None: the resource's one full-weight session (it trains every base weight).
    def create_session(
        self, resource_id: str, session_id: str, lora: LoraConfig | None
    ) -> None: ...

    def drop_session(self, resource_id: str, session_id: str) -> None: ...

    # Forward-backwards of several sessions (at most one item each) in one shared pass: one
    # result or exception per item, in order; an item fails alone.
    def forward_backward_batch(
        self, resource_id: str, items: list[tuple[str, ForwardBackwardRequest]]
    ) -> list[ForwardBackwardResult | Exception]: ...

    def custom_forward_backward(
        self, resource_id: str, session_id: str, request: CustomForwardBackwardRequest
    ) -> None: ...

    def optim_step(self, resource_id: str, session_id: str, request: OptimStepRequest) -> None: ...

    # What the session's generator serves (its tensors, detached) and their policy version:
    # what a generator replica installs (hosts/replicas/engine.py asks its trainer engine).
    def generator_state(
        self, resource_id: str, session_id: str
    ) -> tuple[dict[str, Tensor], int]: ...

    # A session's live state (checkpoint/durable.py): the named parts, with the service's
    # record, written atomically into a directory the service chose; and read back into a
    # freshly created session after a restart (its generator serving policy version `version`).
    def persist_session(
        self,
        resource_id: str,
        session_id: str,
        directory: Path,
        parts: Collection[str],
        record: dict[str, Any],
    ) -> None: ...

    def restore_session(
        self, resource_id: str, session_id: str, directory: Path, *, version: int
    ) -> dict[str, Any]: ...

    # Checkpoints: files go into a directory the service chose (checkpoint/formats.py).
    def save_training_state(self, resource_id: str, session_id: str, directory: Path) -> None: ...

    def save_adapter(
        self,
        resource_id: str,
        session_id: str,
        directory: Path,
        *,
        lora: LoraConfig,
        base_model: str,
    ) -> None: ...

    def load_training_state(
        self, resource_id: str, session_id: str, directory: Path, *, load_optimizer: bool
    ) -> None: ...

    def load_adapter(self, resource_id: str, session_id: str, directory: Path) -> None: ...

    def save_full_model(
        self, resource_id: str, session_id: str, directory: Path, *, base_model: str
    ) -> None: ...

    def export_merged(self, base_model: str, adapter_dir: Path, output_dir: Path) -> None: ...


class Generator(Protocol):
    """What generates: the weights a session's generator serves (`publish`) and sampling with
    them, on the trainer's lane (`sample_batch`, `sample_stream`) or on generator lanes apart
    (LanedEngine)."""

    # The generator serves a copy of the trainer's weights, which are policy version `version`.
    # May be called from inside `between_tokens` of a running sample (PIPELINE weights-sync).
    # `mid_generation` (PIPELINE): a generator apart may switch a running generation's rows to
    # these weights at its next token boundary.
    def publish(
        self, resource_id: str, session_id: str, *, version: int, mid_generation: bool = False
    ) -> None: ...

    # Generators apart from the trainer (LanedEngine below): how many generations may run
    # beside it (0: samples run on the trainer's lane, the only answer of an engine whose
    # generator shares the trainer), and the fence of what the generators must serve for a
    # sample queued now.
    def generator_lanes(self, resource_id: str) -> int: ...

    def generator_fence(self, resource_id: str) -> int: ...

    # Several sample operations (any sessions of the resource) in one generation, on the
    # trainer's lane: one result list per item, in order. The generator serves what the
    # trainer published; policy_segments come from the engine, which knows what each
    # generator serves; `between_tokens` runs between decode passes and may publish, and rows
    # of a session whose generator is republished there switch at that boundary.
    def sample_batch(
        self,
        resource_id: str,
        items: list[tuple[str, SampleRequest]],
        *,
        between_tokens: Callable[[], None] | None = None,
    ) -> list[list[SampleResult]]: ...

    # The step-wise form of sample_batch on the trainer's lane, for operations of sessions
    # sampling what `session_id` samples (a worker process or trainer group keeps it there and
    # is driven by commands: hosts/remote_streams.py); None where the engine cannot hand one
    # out (generators apart from the trainer: LanedEngine.lane_stream instead): the scheduler
    # then runs sample_batch over whole batches.
    def sample_stream(self, resource_id: str, session_id: str) -> DecodeStream | None: ...


class Engine(Trainer, Generator, Protocol):
    """The seam the service depends on: a trainer and its generators, composed by
    engine/build.py (in one process, behind a process boundary, on ranks, or with generators
    apart), plus what spans both: memory admission of an operation of any kind, and shutdown."""

    # Memory admission (service/scheduling/admission.py): the estimated peak bytes that running
    # these operations of one kind as one pass adds to what is resident (memory/estimate.py),
    # and what the resource's device has free now (memory/headroom.py).
    def peak_bytes(
        self, resource_id: str, kind: OperationKind, items: list[tuple[str, OperationRequest]]
    ) -> int: ...

    def headroom(self, resource_id: str, kind: OperationKind | None = None) -> Headroom: ...

    # Server shutdown: stop whatever processes the engine started (none in process).
    def close(self) -> None: ...


class LanedEngine(Engine, Protocol):
    """An engine whose generators run apart from the trainer (hosts/replicas/engine.py): once a
    resource is loaded, generator_lanes() > 0 and the scheduler hands its samples to generator
    lanes (service/scheduling/worker.py), each with the fence of its place in the resource's
    FIFO."""

    # On generator lane `lane` (0 up to generator_lanes()): that lane's generator applies what
    # was staged up to `fence`, and no later change, then generates; the defaults are the
    # first lane as of nothing staged. Still Engine.sample_batch, so it accepts
    # `between_tokens`, and never calls it: publishes reach a lane as staged changes (PIPELINE
    # ones between decode passes), so the scheduler passes none on a lane.
    def sample_batch(
        self,
        resource_id: str,
        items: list[tuple[str, SampleRequest]],
        *,
        between_tokens: Callable[[], None] | None = None,
        fence: int = 0,
        lane: int = 0,
    ) -> list[list[SampleResult]]: ...

    # The step-wise form on generator lane `lane`, its generator as of `fence` when it starts
    # (later operations bring theirs to `admit`): a replica process's stream, or a vLLM
    # server's (each operation sent as it joins; the server batches continuously); None where
    # the lane's generator cannot hand one out: the lane runs whole batches.
    def lane_stream(
        self, resource_id: str, session_id: str, *, fence: int, lane: int
    ) -> DecodeStream | None: ...

    # A sample was handed to the lanes: a lane stream running several blocks in one call
    # (DecodeStream.block's `most`) stops at its next block boundary, so the sample may join.
    def wake_lanes(self, resource_id: str) -> None: ...

    # Sessions whose served weights (or existence) a change staged after fence `after` up to
    # `upto` alters, PIPELINE installs excepted (those may land between decode blocks anyway);
    # None where that is no longer known. A sample may join a lane's stream only where no
    # session decoding there is among them (service/scheduling/sample_streams.py).
    def changed_sessions(
        self, resource_id: str, after: int, upto: int
    ) -> frozenset[str] | None: ...
