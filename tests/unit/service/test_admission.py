"""Memory admission in the scheduler (service/scheduling/admission.py) over the fake engine, whose
peak is a forward-backward's tokens or a sample's sequences and whose free memory a test sets."""

from __future__ import annotations

from pathlib import Path

from fake_engine import FakeEngine, fb, sample, wire

from posttrain.statuses import OperationErrorCode, OperationStatus
from posttrain.types import ForwardBackwardResult, OperationKind, OptimStepOutput, OptimStepRequest

FB, SAMPLE, STEP = OperationKind.FORWARD_BACKWARD, OperationKind.SAMPLE, OperationKind.OPTIM_STEP


def test_an_operation_that_does_not_fit_alone_fails_resource_exhausted_and_the_rest_run(
    tmp_path: Path,
):
    wired = wire(tmp_path, FakeEngine(free_bytes=5))
    rid = wired.resource()
    sid = wired.session(rid)
    release = wired.hold(rid)
    ops = [
        wired.submit(sid, SAMPLE, sample(prompts=2, num_samples=2), "fits"),  # 4
        wired.submit(sid, SAMPLE, sample(prompts=2, num_samples=4), "too-big"),  # 8 > 5
        wired.submit(sid, SAMPLE, sample(), "fits-beside"),  # 4 + 1 = 5
    ]
    release.set()
    wired.drain(rid)
    assert wired.engine.passes("sample_batch") == [(sid, sid)]
    first, refused, last = (wired.op(o) for o in ops)
    assert first.status == last.status == OperationStatus.COMPLETED
    assert refused.status == OperationStatus.FAILED
    assert refused.error_code == OperationErrorCode.RESOURCE_EXHAUSTED
    assert "would need an estimated 8 bytes" in refused.error_message
    assert "5 bytes (0.0 MiB) are free (the fake engine's free_bytes)" in refused.error_message
    wired.scheduler.close()


def test_members_that_fit_alone_but_not_together_run_in_consecutive_passes(tmp_path: Path):
    wired = wire(tmp_path, FakeEngine(free_bytes=8))
    rid = wired.resource()
    a, b, c = (wired.session(rid) for _ in range(3))
    release = wired.hold(rid)
    ops = [wired.submit(s, FB, fb(length=4), s) for s in (a, b, c)]
    release.set()
    wired.drain(rid)
    assert wired.engine.passes("forward_backward_batch") == [(a, b), (c,)]
    assert [wired.op(o).output for o in ops] == [ForwardBackwardResult(4.0, {})] * 3
    wired.scheduler.close()


def test_a_refused_forward_backward_changes_nothing_and_the_session_carries_on(tmp_path: Path):
    wired = wire(tmp_path, FakeEngine(free_bytes=10))
    rid = wired.resource()
    sid = wired.session(rid)
    refused = wired.submit(sid, FB, fb(length=11), "big")
    kept = wired.submit(sid, FB, fb(length=4), "small")
    step = wired.submit(sid, STEP, OptimStepRequest(), "step")
    wired.drain(rid)
    assert wired.op(refused).error_code == OperationErrorCode.RESOURCE_EXHAUSTED
    assert wired.engine.passes("forward_backward_batch") == [(sid,)]
    assert wired.op(kept).output == ForwardBackwardResult(4.0, {})
    assert wired.op(step).output == OptimStepOutput(step=1)
    wired.scheduler.close()
