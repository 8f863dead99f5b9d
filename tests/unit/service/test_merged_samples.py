"""Sample operations of one session queued together run in one shared pass, and each returns
exactly what it returns alone; barriers and other kinds keep the session's order. Real services
(SQLite in tmp_path, the tiny model on the CPU); the worker is held by a plain job until
everything is queued, so what merges is decided by the queue, not by timing."""

from __future__ import annotations

import threading

import pytest
from inprocess import USER, open_session, ready_resource, services_fixture  # noqa: F401

from posttrain.service import Services
from posttrain.service.scheduling.worker import Job, QueuedOperation, ResourceWorker
from posttrain.statuses import OperationStatus
from posttrain.types import (
    OperationKind,
    OptimStepRequest,
    SampleOutput,
    SampleRequest,
    SamplingParams,
)


def session_on_new_resource(services: Services) -> tuple[str, str]:
    resource = ready_resource(services)
    session = open_session(services, resource.id)
    services.scheduler.run_job(resource.id, lambda: None).result(timeout=60)
    return resource.id, session.id


def requests() -> list[SampleRequest]:
    """Different prompts, sample counts, seeds and settings; one unseeded greedy request."""
    return [
        SampleRequest(
            prompts=((3, 4, 5),),
            num_samples=1,
            sampling_params=SamplingParams(max_tokens=12, temperature=1.0, seed=11),
        ),
        SampleRequest(
            prompts=((3, 4, 5), (9, 8)),
            num_samples=3,
            sampling_params=SamplingParams(max_tokens=7, temperature=0.8, top_k=20, seed=5),
        ),
        SampleRequest(
            prompts=((3, 4, 5),),
            num_samples=1,
            sampling_params=SamplingParams(max_tokens=12, temperature=1.0, seed=12),
        ),
        SampleRequest(
            prompts=((20, 21, 22, 23),),
            num_samples=2,
            sampling_params=SamplingParams(max_tokens=9, temperature=0.0),
        ),
    ]


def submit(services: Services, session_id: str, kind: OperationKind, request, key: str) -> str:
    op = services.operations.submit(
        USER,
        services.sessions.get(USER, session_id),
        kind,
        idempotency_key=key,
        fingerprint=key,
        request=request,
    )
    return op.id


def hold_worker(services: Services, resource_id: str) -> threading.Event:
    release = threading.Event()
    services.scheduler.run_job(resource_id, lambda: release.wait(60))
    return release


def outputs(services: Services, op_ids: list[str]) -> list[SampleOutput]:
    result = []
    for op_id in op_ids:
        op = services.repo.get_operation(op_id)
        assert op is not None and op.status == OperationStatus.COMPLETED, op
        result.append(op.output)
    return result


def tokens_of(outs: list[SampleOutput]) -> list:
    return [
        [
            (result.policy_segments, [(s.tokens, s.stop_reason) for s in result.sequences])
            for result in out.results
        ]
        for out in outs
    ]


def logprobs_of(outs: list[SampleOutput]) -> list[float]:
    return [
        value
        for out in outs
        for result in out.results
        for sequence in result.sequences
        for value in sequence.logprobs
    ]


def drain(services: Services, resource_id: str) -> None:
    services.scheduler.run_job(resource_id, lambda: None).result(timeout=120)


def test_queued_samples_of_one_session_share_one_pass_and_equal_running_alone(services):
    resource_id, session_id = session_on_new_resource(services)
    alone = []
    for i, request in enumerate(requests()):
        alone.append(submit(services, session_id, OperationKind.SAMPLE, request, f"alone-{i}"))
        drain(services, resource_id)
    assert services.scheduler.metrics.shared_passes == 0

    release = hold_worker(services, resource_id)
    merged = [
        submit(services, session_id, OperationKind.SAMPLE, request, f"merged-{i}")
        for i, request in enumerate(requests())
    ]
    release.set()
    drain(services, resource_id)
    assert services.scheduler.metrics.shared_passes == 1
    assert services.scheduler.metrics.shared_pass_operations == len(merged)

    expected, got = outputs(services, alone), outputs(services, merged)
    # The same tokens, stop reasons and policy segments (seeded requests and the greedy one);
    # logprobs to float32 rounding (other rows in the pass change the matmul shapes). The
    # prefix-cache hit counts differ by design: the first run filled the cache.
    assert tokens_of(got) == tokens_of(expected)
    for mine, theirs in zip(logprobs_of(got), logprobs_of(expected), strict=True):
        assert mine == pytest.approx(theirs, abs=1e-5)
    first = got[0].results[0].sequences[0]
    assert len(first.tokens) > 0 and len(first.tokens) == len(first.logprobs)


def test_a_barrier_splits_merged_samples_and_keeps_the_order(services):
    resource_id, session_id = session_on_new_resource(services)
    release = hold_worker(services, resource_id)
    sample = requests()[0]
    before = [submit(services, session_id, OperationKind.SAMPLE, sample, f"a{i}") for i in range(3)]
    step = submit(services, session_id, OperationKind.OPTIM_STEP, OptimStepRequest(), "step")
    after = [submit(services, session_id, OperationKind.SAMPLE, sample, f"b{i}") for i in range(2)]
    release.set()
    drain(services, resource_id)
    # Two passes: the three samples before the optim-step, and the two after it.
    assert services.scheduler.metrics.shared_passes == 2
    assert services.scheduler.metrics.shared_pass_operations == 5
    records = [services.repo.get_operation(i) for i in [*before, step, *after]]
    assert all(r is not None and r.status == OperationStatus.COMPLETED for r in records)
    finished = [r.updated_at for r in records]  # type: ignore[union-attr]
    assert max(finished[:3]) <= finished[3] <= min(finished[4:])


def _batchable(kind: OperationKind, session: str, name: str, rows: int = 1) -> QueuedOperation:
    request = SampleRequest(prompts=((1,),) * rows) if kind == OperationKind.SAMPLE else None
    return QueuedOperation(kind, session, name, request)  # type: ignore[arg-type]


def _never_fails(group: list[QueuedOperation], exc: Exception) -> None:
    raise AssertionError(f"the pass of {[o.operation_id for o in group]} failed: {exc}")


def test_batch_mates_follow_each_sessions_order_and_the_row_limit():
    """The queue rule itself: which queued items join the head's pass."""
    passes: list[list[str]] = []
    started, release = threading.Event(), threading.Event()
    worker = ResourceWorker(
        "test-worker",
        lambda group: passes.append([b.operation_id for b in group]),
        _never_fails,
        max_sample_rows=8,
    )
    worker.submit(Job(lambda: (started.set(), release.wait(60))))
    started.wait(60)
    sample, fb = OperationKind.SAMPLE, OperationKind.FORWARD_BACKWARD
    queue = [
        _batchable(sample, "A", "a1", rows=4),
        _batchable(sample, "A", "a2", rows=2),
        _batchable(fb, "B", "b1"),
        _batchable(sample, "B", "b2"),  # behind B's forward-backward: stays
        _batchable(sample, "C", "c1", rows=4),  # 4 + 2 + 4 > 8 rows: stays
        _batchable(sample, "C", "c2"),  # behind c1: stays
        _batchable(sample, "A", "a3", rows=2),  # nothing of A stays queued before it: joins
    ]
    futures = [worker.submit_operation(b) for b in queue]
    release.set()
    for future in futures:
        future.result(timeout=60)
    worker.close()
    assert passes[0] == ["a1", "a2", "a3"]
    assert ["b1"] not in passes[:1]
    # What stayed runs later in queue order: b1 (its own kind), then b2 with c1 and c2.
    flat = [op for group in passes for op in group]
    assert flat.index("b2") < flat.index("c1") < flat.index("c2")


def test_a_sample_pass_waits_for_arriving_submissions_and_not_past_the_limit():
    passes: list[list[str]] = []
    queued: list = []
    calls = {"n": 0}

    def arriving() -> int:
        # Called by the worker while it waits (under its re-entrant lock): the first call lets
        # one more sample "arrive" and reports it in flight; later calls report none.
        calls["n"] += 1
        if calls["n"] == 1:
            queued.append(worker.submit_operation(_batchable(OperationKind.SAMPLE, "B", "b")))
            return 1
        return 0

    worker = ResourceWorker(
        "test-worker",
        lambda group: passes.append([b.operation_id for b in group]),
        _never_fails,
        arriving=arriving,
        gather_s=60.0,
    )
    worker.submit_operation(_batchable(OperationKind.SAMPLE, "A", "a")).result(timeout=60)
    for future in queued:
        future.result(timeout=60)
    assert passes == [["a", "b"]]

    # Submissions that never finish arriving delay a pass by gather_s at most.
    stuck = ResourceWorker(
        "test-worker-2",
        lambda group: passes.append([b.operation_id for b in group]),
        _never_fails,
        arriving=lambda: 1,
        gather_s=0.05,
    )
    stuck.submit_operation(_batchable(OperationKind.SAMPLE, "C", "c")).result(timeout=60)
    stuck.close()
    worker.close()
