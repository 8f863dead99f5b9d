"""Forward-backwards of different sessions queued together run in one shared pass, and each
session's results equal those of the same session run alone; samples of several sessions
queued together share a pass and produce the same tokens. Real services (SQLite in tmp_path,
the tiny model on the CPU). The worker is held by a job until everything is queued, so what
shares a pass is decided by the queue, never by how long another operation takes (this
replaces tests/integration/test_shared_passes.py, which queued behind a long sample)."""

from __future__ import annotations

import threading

import pytest
from inprocess import USER, ready_resource, services_fixture  # noqa: F401

from posttrain.service import Services
from posttrain.statuses import OperationStatus
from posttrain.types import (
    AdamParams,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoraConfig,
    LossConfig,
    LossType,
    OperationKind,
    OptimStepRequest,
    SampleOutput,
    SampleRequest,
    SamplingParams,
    TrainingSample,
)

CE = LossConfig(LossType.CROSS_ENTROPY)
# Adam's first step is lr * sign(g): with the default eps a gradient entry that is pure float32
# rounding noise would move a full learning rate either way; eps=1e-3 keeps such entries still.
ADAM = OptimStepRequest(adam=AdamParams(learning_rate=1e-2, eps=1e-3))


def sft_sample(tokens: list[int], prompt_len: int) -> TrainingSample:
    """Predict tokens[1:] from tokens[:-1], weights 0 on the prompt."""
    n = len(tokens) - 1
    weights = (0.0,) * (prompt_len - 1) + (1.0,) * (n - prompt_len + 1)
    inputs = {"target_tokens": tuple(tokens[1:]), "weights": weights}
    return TrainingSample(tuple(tokens[:-1]), inputs)  # type: ignore[arg-type]


DATA = {
    f"task{i}": (sft_sample([(7 * i + j) % 90 + 3 for j in range(6 + 2 * i)], 3),) for i in range(4)
}


class Runner:
    def __init__(self, services: Services) -> None:
        self.services = services
        self.keys = 0

    def sessions(self) -> tuple[str, dict[str, str]]:
        resource = ready_resource(self.services).id
        by_task = {
            task: self.services.sessions.create(
                USER,
                resource_id=resource,
                lora=LoraConfig(rank=4 + i, seed=i),
                display_name=None,
                metadata={},
                resume_from_checkpoint_id=None,
            ).id
            for i, task in enumerate(DATA)
        }
        self.drain(resource)
        return resource, by_task

    def submit(self, session_id: str, kind: OperationKind, request) -> str:
        self.keys += 1
        key = f"key-{self.keys}"
        return self.services.operations.submit(
            USER,
            self.services.sessions.get(USER, session_id),
            kind,
            idempotency_key=key,
            fingerprint=key,
            request=request,
        ).id

    def drain(self, resource_id: str) -> None:
        self.services.scheduler.run_job(resource_id, lambda: None).result(timeout=120)

    def hold(self, resource_id: str) -> threading.Event:
        release = threading.Event()
        self.services.scheduler.run_job(resource_id, lambda: release.wait(60))
        return release

    def output(self, operation_id: str):
        op = self.services.repo.get_operation(operation_id)
        assert op is not None and op.status == OperationStatus.COMPLETED, op
        return op.output

    def run(self, resource_id: str, session_id: str, kind: OperationKind, request):
        operation_id = self.submit(session_id, kind, request)
        self.drain(resource_id)
        return self.output(operation_id)

    def forward(self, resource_id: str, session_id: str, task: str) -> ForwardBackwardResult:
        request = ForwardBackwardRequest(DATA[task], CE, forward_only=True)
        return self.run(resource_id, session_id, OperationKind.FORWARD_BACKWARD, request)


def metric(services: Services, name: str) -> float:
    """A value of the /metrics text, as the integration test read it over HTTP."""
    for line in services.metrics.render().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing from /metrics")


def test_queued_sessions_share_a_pass_and_match_running_alone(services):
    runner, metrics = Runner(services), services.scheduler.metrics
    resource, alone = runner.sessions()
    expected = {}
    for task, session in alone.items():
        runner.run(
            resource,
            session,
            OperationKind.FORWARD_BACKWARD,
            ForwardBackwardRequest(DATA[task], CE),
        )
        runner.run(resource, session, OperationKind.OPTIM_STEP, ADAM)
        expected[task] = runner.forward(resource, session, task)
    assert metrics.shared_passes == 0

    resource, shared = runner.sessions()
    release = runner.hold(resource)
    submitted = {
        task: runner.submit(
            session, OperationKind.FORWARD_BACKWARD, ForwardBackwardRequest(DATA[task], CE)
        )
        for task, session in shared.items()
    }
    release.set()
    runner.drain(resource)
    assert (metrics.shared_passes, metrics.shared_pass_operations) == (1, len(DATA))
    assert metric(services, "posttrain_shared_pass_operations_total") == len(DATA)
    for task, session in shared.items():
        assert isinstance(runner.output(submitted[task]), ForwardBackwardResult)
        runner.run(resource, session, OperationKind.OPTIM_STEP, ADAM)
        got = runner.forward(resource, session, task)
        # Equal up to float32 summation order in the shared pass.
        assert got.loss == pytest.approx(expected[task].loss, rel=1e-4, abs=1e-4), task


def test_queued_samples_of_several_sessions_share_a_pass_with_the_same_tokens(services):
    runner, metrics = Runner(services), services.scheduler.metrics
    resource, by_task = runner.sessions()
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11, stop=())
    requests = {
        task: SampleRequest(prompts=((1, 5 + i, 6 + i),), num_samples=2, sampling_params=params)
        for i, task in enumerate(by_task)
    }

    def tokens(output: SampleOutput) -> list[list[int]]:
        return [s.tokens for s in output.results[0].sequences]

    alone = {
        task: tokens(runner.run(resource, session, OperationKind.SAMPLE, requests[task]))
        for task, session in by_task.items()
    }
    assert metrics.shared_passes == 0
    release = runner.hold(resource)
    submitted = {
        task: runner.submit(session, OperationKind.SAMPLE, requests[task])
        for task, session in by_task.items()
    }
    release.set()
    runner.drain(resource)
    assert (metrics.shared_passes, metrics.shared_pass_operations) == (1, len(by_task))
    assert metric(services, "posttrain_shared_pass_operations_total") == len(by_task)
    for task in by_task:
        assert tokens(runner.output(submitted[task])) == alone[task], task
