"""Generator lanes (service/scheduling/worker.py): where the engine runs generators apart from the
trainer (engine/hosts/replicas/engine.py), samples leave the resource's FIFO at their place for
lanes of their own,
with the fence of that place. Against a fake engine over a real SQLite store."""

from __future__ import annotations

import threading
import time

from fake_engine import FakeEngine, fb, sample, wire

from posttrain.statuses import OperationStatus
from posttrain.types import OperationKind, OptimStepRequest, WeightsSyncRequest, WeightSyncType

FB, STEP, SYNC, SAMPLE = (
    OperationKind.FORWARD_BACKWARD,
    OperationKind.OPTIM_STEP,
    OperationKind.WEIGHTS_SYNC,
    OperationKind.SAMPLE,
)
FINISHED = (OperationStatus.COMPLETED, OperationStatus.FAILED)


def finished(wired, *op_ids: str) -> None:
    """Wait for the operations to end (a bound for a hung test, not a timing assertion)."""
    for _ in range(6000):
        if all(wired.op(op_id).status in FINISHED for op_id in op_ids):
            return
        time.sleep(0.01)
    raise AssertionError(f"operations {op_ids} did not finish")


def lanes_wired(tmp_path, lanes: int):
    return wire(tmp_path, FakeEngine(lanes=lanes))


def test_a_forward_backward_runs_while_another_sessions_sample_generates(tmp_path):
    wired = lanes_wired(tmp_path, 1)
    try:
        rid = wired.resource()
        a, b = wired.session(rid), wired.session(rid)
        in_sample, go = threading.Event(), threading.Event()
        wired.engine.mid_sample = lambda: (in_sample.set(), go.wait(60))
        generating = wired.submit(a, SAMPLE, sample(), "sample")
        assert in_sample.wait(60)
        trained = wired.submit(b, FB, fb(), "fb")
        stepped = wired.submit(b, STEP, OptimStepRequest(), "step")
        finished(wired, trained, stepped)
        assert wired.op(generating).status == OperationStatus.RUNNING  # still generating
        assert wired.op(stepped).status == OperationStatus.COMPLETED
        go.set()
        finished(wired, generating)
        assert wired.op(generating).status == OperationStatus.COMPLETED
    finally:
        go.set()
        wired.scheduler.close()


def test_without_lanes_the_forward_backward_waits_for_the_sample(tmp_path):
    wired = lanes_wired(tmp_path, 0)
    try:
        rid = wired.resource()
        a, b = wired.session(rid), wired.session(rid)
        in_sample, go = threading.Event(), threading.Event()
        order: list[str] = []
        wired.engine.mid_sample = lambda: (in_sample.set(), go.wait(60), order.append("sample"))
        generating = wired.submit(a, SAMPLE, sample(), "sample")
        assert in_sample.wait(60)
        trained = wired.submit(b, FB, fb(), "fb")
        assert wired.op(trained).status == OperationStatus.PENDING
        go.set()
        finished(wired, generating, trained)
        assert wired.engine.passes("forward_backward_batch") == [(b,)]
        assert order == ["sample"] and wired.engine.sampled_at == [(0, 0)]
    finally:
        go.set()
        wired.scheduler.close()


def test_a_sample_carries_the_fence_of_its_place_in_the_fifo(tmp_path):
    wired = lanes_wired(tmp_path, 1)
    try:
        rid = wired.resource()
        sid = wired.session(rid)
        in_sample, go = threading.Event(), threading.Event()
        wired.engine.mid_sample = lambda: (in_sample.set(), go.wait(60))
        first = wired.submit(sid, SAMPLE, sample(), "first")
        assert in_sample.wait(60)
        before = wired.submit(sid, SAMPLE, sample(), "before")  # queued on the lane
        wired.submit(sid, STEP, OptimStepRequest(), "step")
        sync = wired.submit(sid, SYNC, WeightsSyncRequest(WeightSyncType.SYNCHRONOUS), "sync")
        finished(wired, sync)  # the trainer's lane went on: the publish ran, fence 1
        after = wired.submit(sid, SAMPLE, sample(), "after")
        go.set()
        finished(wired, first, before, after)
        # `before` and `after` never share a pass: they must see different weights.
        assert wired.engine.sampled_at == [(0, 0), (0, 0), (1, 0)]
        assert wired.engine.passes("sample_batch") == [(sid,), (sid,), (sid,)]
    finally:
        go.set()
        wired.scheduler.close()


def test_two_lanes_generate_at_the_same_time(tmp_path):
    wired = lanes_wired(tmp_path, 2)
    try:
        rid = wired.resource()
        a, b = wired.session(rid), wired.session(rid)
        both, go, started = threading.Barrier(2), threading.Event(), threading.Event()
        # Each pass waits until the other is generating too: it passes only with two lanes.
        wired.engine.mid_sample = lambda: (started.set(), both.wait(60), go.wait(60))
        first = wired.submit(a, SAMPLE, sample(), "a")
        # The second arrives once the first is generating, so the first lane cannot take both
        # into one pass (submitted together, one lane may batch them before the other wakes).
        assert started.wait(60)
        second = wired.submit(b, SAMPLE, sample(), "b")
        go.set()
        finished(wired, first, second)
        assert {lane for _, lane in wired.engine.sampled_at} == {0, 1}
        assert all(wired.op(o).status == OperationStatus.COMPLETED for o in (first, second))
    finally:
        go.set()
        wired.scheduler.close()
