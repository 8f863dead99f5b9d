"""The queue rule at a decode block boundary (ResourceWorker.between_blocks): which queued items
run between two blocks of a running sample stream, which samples join it, and what waits for
the stream's end. The worker is the real one, and drives the stream; its group runner plays the
stream (service/scheduling/sample_streams.py): a sample group yields one boundary."""

from __future__ import annotations

import threading
from collections.abc import Callable

from posttrain.service.scheduling.worker import (
    Boundary,
    Job,
    QueuedOperation,
    ResourceWorker,
    Stream,
)
from posttrain.types import OperationKind, SampleRequest

SAMPLE, FB, STEP, SYNC = (
    OperationKind.SAMPLE,
    OperationKind.FORWARD_BACKWARD,
    OperationKind.OPTIM_STEP,
    OperationKind.WEIGHTS_SYNC,
)


def queued(kind: OperationKind, session: str, name: str, rows: int = 1) -> QueuedOperation:
    request = SampleRequest(prompts=((1,),) * rows) if kind == SAMPLE else None
    return QueuedOperation(kind, session, name, request)  # type: ignore[arg-type]


def run_boundary(
    queue: list[QueuedOperation | Job], may_join: Callable[[QueuedOperation], bool]
) -> tuple[list[list[str]], list[str]]:
    """The first item (a sample) starts a stream; at its one boundary the worker goes through
    the rest. Returns every group run, in order (what ran between blocks comes before the
    stream's own entry, which lists its members and joins), and what joined."""
    ran: list[list[str]] = []
    joined: list[str] = []
    streams = 0

    def stream(group: list[QueuedOperation]) -> Stream:
        took = yield Boundary({op.session_id for op in group}, may_join)
        joined.extend(op.operation_id for op in took)
        ran.append(["stream", *(op.operation_id for op in group), *joined])

    def run_group(group: list[QueuedOperation]) -> Stream | None:
        nonlocal streams
        if group[0].kind != SAMPLE or streams:
            ran.append([op.operation_id for op in group])
            return None
        streams += 1
        return stream(group)

    def fail_group(group: list[QueuedOperation], exc: Exception) -> None:
        raise AssertionError(f"{[op.operation_id for op in group]} failed: {exc}")

    worker = ResourceWorker("boundary-worker", run_group, fail_group, max_sample_rows=8)
    started, release = threading.Event(), threading.Event()
    worker.submit(Job(lambda: (started.set(), release.wait(60))))
    assert started.wait(60)
    futures = [
        worker.submit(item) if isinstance(item, Job) else worker.submit_operation(item)
        for item in queue
    ]
    release.set()
    for future in futures:
        future.result(timeout=60)
    worker.close()
    return ran, joined


def test_other_sessions_training_runs_and_a_later_sample_joins_at_the_boundary():
    ran, joined = run_boundary(
        [
            queued(SAMPLE, "s", "long"),
            queued(STEP, "u", "u-step"),  # a barrier: nothing behind it shares the first pass
            queued(FB, "v", "v-fb"),
            queued(SAMPLE, "w", "w-sample"),
            queued(SYNC, "w", "w-sync"),  # w decodes once its sample joined: waits, a barrier
            queued(FB, "x", "x-fb"),  # behind the barrier: waits for the stream's end
        ],
        lambda op: True,
    )
    assert joined == ["w-sample"]
    assert ran == [["u-step"], ["v-fb"], ["stream", "long", "w-sample"], ["w-sync"], ["x-fb"]]


def test_a_decoding_sessions_own_operations_wait_for_the_stream():
    ran, joined = run_boundary(
        [
            queued(SAMPLE, "s", "long"),
            queued(STEP, "u", "u-step"),
            queued(FB, "s", "s-fb"),  # s decodes: waits, and nothing of s overtakes it
            queued(FB, "u", "u-fb"),  # not a batch mate of s-fb's session: runs alone
            queued(SAMPLE, "s", "s-sample"),  # behind s-fb: does not join
            queued(SAMPLE, "x", "x-sample"),
        ],
        lambda op: True,
    )
    assert joined == ["x-sample"]
    assert ran[:3] == [["u-step"], ["u-fb"], ["stream", "long", "x-sample"]]
    assert ran[3:] == [["s-fb"], ["s-sample"]]


def test_a_sample_that_cannot_join_keeps_every_later_sample_behind_it():
    ran, joined = run_boundary(
        [
            queued(SAMPLE, "s", "long"),
            queued(STEP, "u", "u-step"),
            queued(SAMPLE, "w", "large", rows=4),  # does not fit beside the running rows
            queued(SAMPLE, "x", "small"),  # would fit, but does not overtake the large one
            queued(FB, "y", "y-fb"),  # another session's training still runs
        ],
        lambda op: op.rows <= 2,
    )
    assert joined == []
    assert ran == [["u-step"], ["y-fb"], ["stream", "long"], ["large", "small"]]


def test_a_job_runs_between_blocks_only_when_it_says_so_and_is_a_barrier_otherwise():
    order: list[str] = []
    publish = Job(lambda: order.append("publish"), between_blocks=lambda d: "w" not in d)
    lifecycle = Job(lambda: order.append("teardown"))
    ran, joined = run_boundary(
        [
            queued(SAMPLE, "s", "long"),
            queued(STEP, "u", "u-step"),
            publish,
            queued(FB, "v", "v-fb"),
            lifecycle,  # no between_blocks: a barrier
            queued(SAMPLE, "x", "x-sample"),
        ],
        lambda op: True,
    )
    assert order == ["publish", "teardown"] and joined == []
    assert ran[:3] == [["u-step"], ["v-fb"], ["stream", "long"]]
