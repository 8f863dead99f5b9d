"""The resource worker is the one job boundary: a job's failure goes to its recorder or to its
future, a failing recorder does not stop the worker, and operations of a group that raises go
to fail_group. Real threads; every wait is on a future or an event, never on time."""

from __future__ import annotations

import threading

import pytest

from posttrain.service.scheduling.worker import Job, QueuedOperation, ResourceWorker
from posttrain.types import OperationKind, OptimStepRequest


class Recorder:
    def __init__(self) -> None:
        self.groups: list[list[str]] = []
        self.failed: list[tuple[list[str], str]] = []

    def run_group(self, group: list[QueuedOperation]) -> None:
        self.groups.append([op.operation_id for op in group])
        if any(op.operation_id.startswith("bad") for op in group):
            raise RuntimeError("pass failed")

    def fail_group(self, group: list[QueuedOperation], exc: Exception) -> None:
        self.failed.append(([op.operation_id for op in group], str(exc)))


def boom() -> None:
    raise RuntimeError("job failed")


@pytest.fixture
def worker():
    recorder = Recorder()
    w = ResourceWorker("worker-test", recorder.run_group, recorder.fail_group)
    yield w, recorder
    w.close()


def test_a_failed_job_goes_to_its_recorder_and_its_future_just_finishes(worker):
    w, _ = worker
    seen: list[str] = []
    future = w.submit(Job(boom, lambda exc: seen.append(str(exc))))
    assert future.result(timeout=30) is None
    assert seen == ["job failed"]


def test_a_failed_job_without_a_recorder_raises_through_its_future(worker):
    w, _ = worker
    with pytest.raises(RuntimeError, match="job failed"):
        w.submit(Job(boom)).result(timeout=30)
    assert w.submit(Job(lambda: 7)).result(timeout=30) == 7


def test_a_recorder_that_fails_hands_its_error_to_the_waiter_and_the_worker_goes_on(worker):
    w, _ = worker

    def broken_recorder(exc: Exception) -> None:
        raise OSError("store unavailable")

    with pytest.raises(OSError, match="store unavailable"):
        w.submit(Job(boom, broken_recorder)).result(timeout=30)
    assert w.submit(Job(lambda: "next")).result(timeout=30) == "next"


def test_a_group_that_raises_goes_to_fail_group_and_each_done_runs(worker):
    w, recorder = worker
    released = threading.Event()
    w.submit(Job(released.wait))  # hold the worker while both operations queue up
    done: list[str] = []
    ops = [
        QueuedOperation(
            OperationKind.OPTIM_STEP, "s1", name, OptimStepRequest(), lambda n=name: done.append(n)
        )
        for name in ("bad-1", "ok-2")
    ]
    futures = [w.submit_operation(op) for op in ops]
    released.set()
    for future in futures:
        assert future.result(timeout=30) is None
    # optim-steps never share a pass: two groups of one, the first failed through fail_group
    assert recorder.groups == [["bad-1"], ["ok-2"]]
    assert recorder.failed == [(["bad-1"], "pass failed")]
    assert done == ["bad-1", "ok-2"]
