"""The one message vocabulary between an engine and the processes it runs: every command a
worker process, a trainer rank or a generator replica answers is a `Message`, a frozen
dataclass of typed fields whose `run` is its one handler, on the engine hosted there.

`Message[E, R]`: the handler takes the hosted engine as E, the small protocol it needs (the
Trainer, Generator or Engine protocol of engine/interface.py, or one below: `Measured`,
`StreamHosting`, `ReplicaHosting`), and answers R. A handle on a process hosting an engine of
class C (hosts/placement.py's WorkerHandle[C]) takes a Message[E, R] only where C implements E,
and gives its caller R: so the checker sees that the engine there has each method a message calls
(hosts/in_process.py's LocalEngine, hosts/ranks/trainer_group.py's RankEngine,
hosts/replicas/worker.py's ReplicaEngine), and what each call answers, with no method named in a
string. The remote engines (hosts/process/remote.py, hosts/replicas/engine.py) build messages in
typed methods, one per Engine method, so their callers see the Engine protocol alone.

A message and its answer cross a pipe (hosts/process/worker.py) or a Ray actor call
(hosts/ray/placement.py) pickled. A callable field (SampleBatch's `between_tokens`) cannot: a
pipe calls it back where the message was made, a Ray actor call leaves it out (`callables`).

Imports: types, engine (interface, generate.sample_stream, memory.footprint); torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, cast

from torch import Tensor

from posttrain.engine.generate.sample_stream import JoinRoom
from posttrain.engine.interface import DecodeStream, Engine, Generator, Headroom, Trainer
from posttrain.engine.memory.footprint import ResourceFootprint, SessionFootprint
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

E = TypeVar("E", contravariant=True)  # what a handler needs of the hosted engine
R = TypeVar("R", covariant=True)  # what it answers
T = TypeVar("T")
M = TypeVar("M", bound="Message[Any, Any]")


@dataclass(frozen=True)
class Message(ABC, Generic[E, R]):
    """One command for the engine hosted in another process."""

    @abstractmethod
    def run(self, engine: E) -> R:
        """The command's one handler, run where the engine lives."""


@dataclass(frozen=True)
class ResourceMessage(Message[E, R]):
    """A command concerning one resource: it goes to the process that hosts it."""

    resource_id: str


def callables(message: Message[Any, Any]) -> dict[str, Callable[[], None]]:
    """The message's callable fields by name (SampleBatch's `between_tokens`): no pipe
    carries them."""
    found = {f.name: getattr(message, f.name) for f in fields(message)}
    return {
        name: cast(Callable[[], None], value) for name, value in found.items() if callable(value)
    }


def replaced(message: M, values: Mapping[str, object]) -> M:
    """The message with the named fields replaced (a callable's stand-in in a pipe)."""
    return replace(message, **values)


# ---------------------------------------------------------------- what handlers need


class Measured(Protocol):
    """Sizes and gradients, for operators, benchmarks and tests (hosts/in_process.py)."""

    def resource_footprint(self, resource_id: str) -> ResourceFootprint: ...

    def session_footprint(self, resource_id: str, session_id: str) -> SessionFootprint: ...

    def discard_gradients(self, resource_id: str, session_id: str) -> None: ...


class HostedStream(DecodeStream, Protocol):
    """A stream as its host keeps it: a DecodeStream that also says what a join finds now
    (generate/sample_stream.py's SessionSampleStream; a replica's FencedStream)."""

    def room(self) -> JoinRoom: ...


class StreamHosting(Protocol):
    """The decode streams a host keeps for its caller, by id (hosts/remote_streams.py)."""

    def open_stream(self, resource_id: str, session_id: str) -> int: ...

    # The open stream; EngineFailure where none of that id is open on the resource.
    def stream(self, resource_id: str, stream_id: int) -> HostedStream: ...

    def close_stream(self, resource_id: str, stream_id: int) -> None: ...


class ReplicaHosting(Protocol):
    """A generator replica's own (hosts/replicas/worker.py): what it serves, fed by staged
    changes, and its samples at their fence."""

    def install_generator(
        self, resource_id: str, session_id: str, tensors: dict[str, Tensor], *, version: int
    ) -> None: ...

    def received(self, fence: int) -> None: ...

    def rebuilt(self, fence: int) -> None: ...

    def sample_batch(
        self, resource_id: str, items: list[tuple[str, SampleRequest]], *, fence: int = 0
    ) -> list[list[SampleResult]]: ...

    def open_stream(self, resource_id: str, session_id: str, fence: int = 0) -> int: ...


# ---------------------------------------------------------------- the Engine protocol's
# (its Trainer's, its Generator's, and memory admission's)


@dataclass(frozen=True)
class LoadResource(ResourceMessage[Trainer, None]):
    base_model: str
    muon_scaling: MuonScaling | None
    generator_replicas: int = 1

    def run(self, engine: Trainer) -> None:
        engine.load_resource(
            self.resource_id,
            self.base_model,
            muon_scaling=self.muon_scaling,
            generator_replicas=self.generator_replicas,
        )


@dataclass(frozen=True)
class CreateSession(ResourceMessage[Trainer, None]):
    session_id: str
    lora: LoraConfig | None

    def run(self, engine: Trainer) -> None:
        engine.create_session(self.resource_id, self.session_id, self.lora)


@dataclass(frozen=True)
class DropSession(ResourceMessage[Trainer, None]):
    """It only drops state: where the host is gone there is nothing left to drop
    (hosts/process/remote.py sends it with `_forget`)."""

    session_id: str

    def run(self, engine: Trainer) -> None:
        engine.drop_session(self.resource_id, self.session_id)


@dataclass(frozen=True)
class ForwardBackwardBatch(ResourceMessage[Trainer, list[ForwardBackwardResult | Exception]]):
    items: list[tuple[str, ForwardBackwardRequest]]

    def run(self, engine: Trainer) -> list[ForwardBackwardResult | Exception]:
        return engine.forward_backward_batch(self.resource_id, self.items)


@dataclass(frozen=True)
class CustomForwardBackward(ResourceMessage[Trainer, None]):
    session_id: str
    request: CustomForwardBackwardRequest

    def run(self, engine: Trainer) -> None:
        engine.custom_forward_backward(self.resource_id, self.session_id, self.request)


@dataclass(frozen=True)
class OptimStep(ResourceMessage[Trainer, None]):
    session_id: str
    request: OptimStepRequest

    def run(self, engine: Trainer) -> None:
        engine.optim_step(self.resource_id, self.session_id, self.request)


@dataclass(frozen=True)
class Publish(ResourceMessage[Generator, None]):
    session_id: str
    version: int
    mid_generation: bool = False

    def run(self, engine: Generator) -> None:
        engine.publish(
            self.resource_id,
            self.session_id,
            version=self.version,
            mid_generation=self.mid_generation,
        )


@dataclass(frozen=True)
class GeneratorState(ResourceMessage[Trainer, tuple[dict[str, Tensor], int]]):
    session_id: str

    def run(self, engine: Trainer) -> tuple[dict[str, Tensor], int]:
        return engine.generator_state(self.resource_id, self.session_id)


@dataclass(frozen=True)
class SampleBatch(ResourceMessage[Generator, list[list[SampleResult]]]):
    """`between_tokens` (it may publish, PIPELINE) is called back across a pipe, and left out
    on a Ray actor (hosts/ray/placement.py)."""

    items: list[tuple[str, SampleRequest]]
    between_tokens: Callable[[], None] | None = None

    def run(self, engine: Generator) -> list[list[SampleResult]]:
        return engine.sample_batch(self.resource_id, self.items, between_tokens=self.between_tokens)


@dataclass(frozen=True)
class PeakBytes(ResourceMessage[Engine, int]):
    kind: OperationKind
    items: list[tuple[str, OperationRequest]]

    def run(self, engine: Engine) -> int:
        return engine.peak_bytes(self.resource_id, self.kind, self.items)


@dataclass(frozen=True)
class MeasureHeadroom(ResourceMessage[Engine, Headroom]):
    kind: OperationKind | None = None

    def run(self, engine: Engine) -> Headroom:
        return engine.headroom(self.resource_id, self.kind)


@dataclass(frozen=True)
class PersistSession(ResourceMessage[Trainer, None]):
    session_id: str
    directory: Path
    parts: Collection[str]
    record: dict[str, Any]

    def run(self, engine: Trainer) -> None:
        engine.persist_session(
            self.resource_id, self.session_id, self.directory, self.parts, self.record
        )


@dataclass(frozen=True)
class RestoreSession(ResourceMessage[Trainer, dict[str, Any]]):
    session_id: str
    directory: Path
    version: int

    def run(self, engine: Trainer) -> dict[str, Any]:
        return engine.restore_session(
            self.resource_id, self.session_id, self.directory, version=self.version
        )


@dataclass(frozen=True)
class SaveTrainingState(ResourceMessage[Trainer, None]):
    session_id: str
    directory: Path

    def run(self, engine: Trainer) -> None:
        engine.save_training_state(self.resource_id, self.session_id, self.directory)


@dataclass(frozen=True)
class SaveAdapter(ResourceMessage[Trainer, None]):
    session_id: str
    directory: Path
    lora: LoraConfig
    base_model: str

    def run(self, engine: Trainer) -> None:
        engine.save_adapter(
            self.resource_id,
            self.session_id,
            self.directory,
            lora=self.lora,
            base_model=self.base_model,
        )


@dataclass(frozen=True)
class LoadTrainingState(ResourceMessage[Trainer, None]):
    session_id: str
    directory: Path
    load_optimizer: bool

    def run(self, engine: Trainer) -> None:
        engine.load_training_state(
            self.resource_id, self.session_id, self.directory, load_optimizer=self.load_optimizer
        )


@dataclass(frozen=True)
class LoadAdapter(ResourceMessage[Trainer, None]):
    session_id: str
    directory: Path

    def run(self, engine: Trainer) -> None:
        engine.load_adapter(self.resource_id, self.session_id, self.directory)


@dataclass(frozen=True)
class SaveFullModel(ResourceMessage[Trainer, None]):
    session_id: str
    directory: Path
    base_model: str

    def run(self, engine: Trainer) -> None:
        engine.save_full_model(
            self.resource_id, self.session_id, self.directory, base_model=self.base_model
        )


# ---------------------------------------------------------------- sizes and gradients


@dataclass(frozen=True)
class MeasureResourceFootprint(ResourceMessage[Measured, ResourceFootprint]):
    def run(self, engine: Measured) -> ResourceFootprint:
        return engine.resource_footprint(self.resource_id)


@dataclass(frozen=True)
class MeasureSessionFootprint(ResourceMessage[Measured, SessionFootprint]):
    session_id: str

    def run(self, engine: Measured) -> SessionFootprint:
        return engine.session_footprint(self.resource_id, self.session_id)


@dataclass(frozen=True)
class DiscardGradients(ResourceMessage[Measured, None]):
    session_id: str

    def run(self, engine: Measured) -> None:
        engine.discard_gradients(self.resource_id, self.session_id)


# ---------------------------------------------------------------- decode streams
# A stream driven step by step from the API process (hosts/remote_streams.py): one message per
# DecodeStream method, but `take_finished`, `take_progress` and `running_rows`, which each step
# brings back (Stepped), `follow`, whose set each step carries, and `close`, which is
# CloseStream.


@dataclass(frozen=True)
class OpenStream(ResourceMessage[StreamHosting, int]):
    session_id: str

    def run(self, engine: StreamHosting) -> int:
        return engine.open_stream(self.resource_id, self.session_id)


@dataclass(frozen=True)
class StreamMessage(ResourceMessage[StreamHosting, R]):
    """A command for one open stream of the resource."""

    stream_id: int


@dataclass(frozen=True)
class Stepped(Generic[T]):
    """A step's answer, and what its caller asks after each step, in the same round trip: the
    operations finished since the last step, the tokens the followed ones drew since
    (DecodeStream.take_progress), the rows running now, and what a join finds now
    (sample_stream.JoinRoom)."""

    answer: T
    finished: list[tuple[int, list[SampleResult]]]
    progress: list[tuple[int, list[list[int]]]]
    running_rows: int
    room: JoinRoom


def _stepped(stream: HostedStream, answer: T) -> Stepped[T]:
    progress = stream.take_progress()  # first, as the caller takes them (StreamPass)
    finished = stream.take_finished()
    return Stepped(answer, finished, progress, stream.running_rows(), stream.room())


@dataclass(frozen=True)
class StreamAdmit(StreamMessage[Stepped[list[int]]]):
    items: list[tuple[str, SampleRequest]]
    fence: int = 0
    row_limit: int = 0
    spare_bytes: int = 0
    followed: tuple[int, ...] = ()  # DecodeStream.follow's set, as of this step

    def run(self, engine: StreamHosting) -> Stepped[list[int]]:
        stream = engine.stream(self.resource_id, self.stream_id)
        stream.follow(self.followed)
        answer = stream.admit(
            self.items, self.fence, row_limit=self.row_limit, spare_bytes=self.spare_bytes
        )
        return _stepped(stream, answer)


@dataclass(frozen=True)
class StreamBlock(StreamMessage[Stepped[None]]):
    most: int = 1
    followed: tuple[int, ...] = ()  # DecodeStream.follow's set, as of this step

    def run(self, engine: StreamHosting) -> Stepped[None]:
        stream = engine.stream(self.resource_id, self.stream_id)
        stream.follow(self.followed)
        stream.block(self.most)
        return _stepped(stream, None)


@dataclass(frozen=True)
class StreamCanJoin(StreamMessage[bool]):
    session_id: str

    def run(self, engine: StreamHosting) -> bool:
        return engine.stream(self.resource_id, self.stream_id).can_join(self.session_id)


@dataclass(frozen=True)
class StreamRunningRows(StreamMessage[int]):
    """The rows running, asked alone (operators and tests: the steps bring it back)."""

    def run(self, engine: StreamHosting) -> int:
        return engine.stream(self.resource_id, self.stream_id).running_rows()


@dataclass(frozen=True)
class StreamFits(StreamMessage[bool]):
    """Whether a join fits, asked before the stream's first step (after one, the room the step
    brought answers it in the caller's process)."""

    items: list[tuple[str, SampleRequest]]
    spare_bytes: int

    def run(self, engine: StreamHosting) -> bool:
        return engine.stream(self.resource_id, self.stream_id).fits(self.items, self.spare_bytes)


@dataclass(frozen=True)
class CloseStream(StreamMessage[None]):
    def run(self, engine: StreamHosting) -> None:
        engine.close_stream(self.resource_id, self.stream_id)


# ---------------------------------------------------------------- a generator replica's


@dataclass(frozen=True)
class InstallGenerator(ResourceMessage[ReplicaHosting, None]):
    session_id: str
    tensors: dict[str, Tensor]
    version: int

    def run(self, engine: ReplicaHosting) -> None:
        engine.install_generator(
            self.resource_id, self.session_id, self.tensors, version=self.version
        )


@dataclass(frozen=True)
class Received(Message[ReplicaHosting, None]):
    fence: int

    def run(self, engine: ReplicaHosting) -> None:
        engine.received(self.fence)


@dataclass(frozen=True)
class Rebuilt(Message[ReplicaHosting, None]):
    fence: int

    def run(self, engine: ReplicaHosting) -> None:
        engine.rebuilt(self.fence)


@dataclass(frozen=True)
class SampleAtFence(ResourceMessage[ReplicaHosting, list[list[SampleResult]]]):
    """A generator lane's whole batch, on its replica as of `fence`."""

    items: list[tuple[str, SampleRequest]]
    fence: int

    def run(self, engine: ReplicaHosting) -> list[list[SampleResult]]:
        return engine.sample_batch(self.resource_id, self.items, fence=self.fence)


@dataclass(frozen=True)
class OpenStreamAtFence(ResourceMessage[ReplicaHosting, int]):
    """A generator lane's stream, its replica's generator as of `fence`."""

    session_id: str
    fence: int

    def run(self, engine: ReplicaHosting) -> int:
        return engine.open_stream(self.resource_id, self.session_id, self.fence)
