"""A small deterministic engine for the service tests, and the real services wired over it.

FakeEngine implements the Engine protocol's methods the service calls and records each call as
(method, resource id, session ids), so a test reads which operations shared a pass and in which
order they ran. Its numbers are simple functions of the request and the session's state:
a forward-backward's loss is the number of input tokens plus the session's trainer version; a
sampled sequence is the prompt followed by the served version. A sample whose first prompt
token is POISON, or a forward-backward whose first token is, fails that one item; a
forward-backward whose first token is CRASH makes the whole pass raise.

The services are the real ones (store/repo.py over SQLite in tmp_path, Scheduler,
ResourceService, SessionService, OperationService); only the engine is fake. To make
operations queue up, a test holds the resource's worker with a job that waits on an Event.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from posttrain.config import SchedulerConfig, ServerConfig
from posttrain.engine.interface import Headroom, ModelInfo
from posttrain.errors import NonFiniteLoss
from posttrain.records import OperationRecord
from posttrain.service.lifecycle.resources import ResourceService
from posttrain.service.lifecycle.sessions import SessionService
from posttrain.service.operations.submit import OperationService
from posttrain.service.scheduling.scheduler import Scheduler
from posttrain.store.db import connect
from posttrain.store.repo import Repo
from posttrain.types import (
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoraConfig,
    LossConfig,
    LossType,
    MuonScaling,
    OperationKind,
    OperationRequest,
    OptimStepRequest,
    PolicySegment,
    SampledSequence,
    SampleRequest,
    SampleResult,
    StopReason,
    TrainingSample,
)

USER = "user_local"
MODEL = "fake-model"
POISON = 13
CRASH = 66


@dataclass
class FakeEngine:
    calls: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list)
    trainer: dict[str, int] = field(default_factory=dict)  # session -> trainer version
    served: dict[str, int] = field(default_factory=dict)  # session -> version the generator has
    fail_load: bool = False
    fail_setup: bool = False
    # Called once in the middle of every sample pass, before its one between_tokens.
    mid_sample: Callable[[], None] = lambda: None
    # Memory admission: a forward-backward's "peak" is its tokens, a sample's its sequences.
    free_bytes: int = 1 << 62
    # Generators apart (engine/hosts/replicas/engine.py): lanes beside the trainer's, and the fence
    # each publish advances; every sample pass records the (fence, lane) it ran with.
    lanes: int = 0
    fence: int = 0
    sampled_at: list[tuple[int, int]] = field(default_factory=list)

    def _call(self, method: str, resource_id: str, *session_ids: str) -> None:
        self.calls.append((method, resource_id, session_ids))

    def passes(self, method: str) -> list[tuple[str, ...]]:
        return [sessions for name, _, sessions in self.calls if name == method]

    def device_name(self) -> str:
        return "cpu"

    def model_info(self, base_model: str) -> ModelInfo:
        return ModelInfo(
            vocab_size=100,
            context_length=1024,
            max_seq_length=64,
            max_batch_size=8,
            max_lora_rank=16,
        )

    def load_resource(
        self,
        resource_id: str,
        base_model: str,
        *,
        muon_scaling: MuonScaling | None,
        generator_replicas: int = 1,
    ) -> None:
        self._call("load_resource", resource_id)
        if self.fail_load:
            raise RuntimeError("no such weights")

    def unload_resource(self, resource_id: str) -> None:
        self._call("unload_resource", resource_id)

    def is_loaded(self, resource_id: str) -> bool:
        return True

    def create_session(self, resource_id: str, session_id: str, lora: LoraConfig | None) -> None:
        self._call("create_session", resource_id, session_id)
        if self.fail_setup:
            raise RuntimeError("out of adapter slots")
        self.trainer[session_id] = 0
        self.served[session_id] = 0

    def drop_session(self, resource_id: str, session_id: str) -> None:
        self._call("drop_session", resource_id, session_id)

    def check_tokens(self, base_model: str, tokens: tuple[int, ...], param: str) -> None:
        pass

    def peak_bytes(
        self, resource_id: str, kind: OperationKind, items: list[tuple[str, OperationRequest]]
    ) -> int:
        """A sample's sequences, a forward-backward's tokens; 0 for the other kinds."""
        peak = 0
        for _, request in items:
            if isinstance(request, SampleRequest):
                peak += len(request.prompts) * request.num_samples
            elif isinstance(request, ForwardBackwardRequest):
                peak += sum(len(sample.tokens) for sample in request.samples)
        return peak

    def headroom(self, resource_id: str, kind: OperationKind | None = None) -> Headroom:
        return Headroom(self.free_bytes, "the fake engine's free_bytes")

    def forward_backward_batch(
        self, resource_id: str, items: list[tuple[str, ForwardBackwardRequest]]
    ) -> list[ForwardBackwardResult | Exception]:
        self._call("forward_backward_batch", resource_id, *(sid for sid, _ in items))
        if any(request.samples[0].tokens[0] == CRASH for _, request in items):
            raise RuntimeError("the device fell over")
        results: list[ForwardBackwardResult | Exception] = []
        for session_id, request in items:
            if request.samples[0].tokens[0] == POISON:
                results.append(NonFiniteLoss("the loss was NaN; the gradient was discarded"))
                continue
            tokens = sum(len(sample.tokens) for sample in request.samples)
            results.append(ForwardBackwardResult(float(tokens + self.trainer[session_id]), {}))
        return results

    def custom_forward_backward(
        self, resource_id: str, session_id: str, request: CustomForwardBackwardRequest
    ) -> None:
        self._call("custom_forward_backward", resource_id, session_id)

    def optim_step(self, resource_id: str, session_id: str, request: OptimStepRequest) -> None:
        self._call("optim_step", resource_id, session_id)
        self.trainer[session_id] += 1

    def publish(
        self, resource_id: str, session_id: str, *, version: int, mid_generation: bool = False
    ) -> None:
        self._call("publish", resource_id, session_id)
        self.served[session_id] = version
        self.fence += 1

    def generator_lanes(self, resource_id: str) -> int:
        return self.lanes

    def generator_fence(self, resource_id: str) -> int:
        return self.fence

    def sample_stream(self, resource_id: str, session_id: str) -> None:
        """No decode stream: samples run as whole batches through sample_batch."""
        return None

    def lane_stream(self, resource_id: str, session_id: str, *, fence: int, lane: int) -> None:
        """Nor on a generator lane."""
        return None

    def changed_sessions(self, resource_id: str, after: int, upto: int) -> None:
        return None

    def wake_lanes(self, resource_id: str) -> None:
        pass

    def sample_batch(
        self,
        resource_id: str,
        items: list[tuple[str, SampleRequest]],
        *,
        between_tokens: Callable[[], None] | None = None,
        fence: int = 0,
        lane: int = 0,
    ) -> list[list[SampleResult]]:
        self._call("sample_batch", resource_id, *(sid for sid, _ in items))
        self.sampled_at.append((fence, lane))
        first = {sid: self.served[sid] for sid, _ in items}
        self.mid_sample()
        if between_tokens is not None:
            between_tokens()  # one token boundary, after the first token
        out = []
        for session_id, request in items:
            segments = [PolicySegment(0, first[session_id])]
            if self.served[session_id] != first[session_id]:
                segments.append(PolicySegment(1, self.served[session_id]))
            sequence = SampledSequence(
                [first[session_id], self.served[session_id]], [-0.5, -0.25], StopReason.LENGTH
            )
            out.append(
                [SampleResult([sequence] * request.num_samples, segments) for _ in request.prompts]
            )
        return out


@dataclass
class Wired:
    repo: Repo
    engine: FakeEngine
    scheduler: Scheduler
    resources: ResourceService
    sessions: SessionService
    operations: OperationService

    def resource(self) -> str:
        return self.resources.create(
            USER,
            base_model=MODEL,
            lora_enabled=True,
            num_generator_replicas=1,
            inactive_timeout=300,
            muon_scaling=None,
        ).id

    def session(self, resource_id: str) -> str:
        return self.sessions.create(
            USER,
            resource_id=resource_id,
            lora=LoraConfig(rank=4),
            display_name=None,
            metadata={},
            resume_from_checkpoint_id=None,
        ).id

    def submit(
        self, session_id: str, kind: OperationKind, request: OperationRequest, key: str
    ) -> str:
        return self.submit_op(session_id, kind, request, key).id

    def submit_op(
        self, session_id: str, kind: OperationKind, request: OperationRequest, key: str
    ) -> OperationRecord:
        session = self.sessions.get(USER, session_id)
        return self.operations.submit(
            USER, session, kind, idempotency_key=key, fingerprint=key, request=request
        )

    def hold(self, resource_id: str) -> threading.Event:
        """Occupy the resource's worker until the returned Event is set."""
        release, started = threading.Event(), threading.Event()
        self.scheduler.run_job(resource_id, lambda: (started.set(), release.wait(60)))
        assert started.wait(60)
        return release

    def drain(self, resource_id: str) -> None:
        self.scheduler.run_job(resource_id, lambda: None).result(timeout=60)

    def op(self, operation_id: str) -> OperationRecord:
        record = self.repo.get_operation(operation_id)
        assert record is not None
        return record


def wire(directory: Path, engine: FakeEngine, limits: SchedulerConfig | None = None) -> Wired:
    config = ServerConfig(data_dir=directory, models=({"id": MODEL, "path": directory},))
    repo = Repo(connect(directory))
    scheduler = Scheduler(repo, engine, limits=limits or config.scheduler)
    resources = ResourceService(config, repo, engine, scheduler)
    sessions = SessionService(repo, engine, scheduler, resources)
    operations = OperationService(repo, scheduler, sessions, resources)
    return Wired(repo, engine, scheduler, resources, sessions, operations)


@pytest.fixture(name="wired")
def wired_fixture(tmp_path: Path) -> Iterator[Wired]:
    built = wire(tmp_path, FakeEngine())
    yield built
    built.scheduler.close()


def fb(first_token: int = 3, length: int = 4) -> ForwardBackwardRequest:
    tokens = tuple([first_token] + [5] * (length - 1))
    sample = TrainingSample(tokens, {"target_tokens": tokens, "weights": (1.0,) * length})
    return ForwardBackwardRequest((sample,), LossConfig(LossType.CROSS_ENTROPY))


def sample(prompts: int = 1, num_samples: int = 1) -> SampleRequest:
    return SampleRequest(prompts=((1, 2),) * prompts, num_samples=num_samples)
