"""The scheduler against a fake engine over a real SQLite store: each session's order, the
barriers, which operations share an engine pass and up to what limit, and a failing member of
a pass. The worker is held by a job until everything is queued, so what merges is decided by
the queue, never by timing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fake_engine import CRASH, POISON, FakeEngine, fb, sample, wire, wired_fixture  # noqa: F401

from posttrain.config import SchedulerConfig
from posttrain.statuses import OperationErrorCode, OperationStatus, SessionStatus
from posttrain.types import (
    CheckpointRequest,
    CheckpointType,
    ForwardBackwardResult,
    OperationKind,
    OptimStepOutput,
    OptimStepRequest,
    SampleOutput,
    WeightsSyncOutput,
    WeightsSyncRequest,
)

FB, SAMPLE = OperationKind.FORWARD_BACKWARD, OperationKind.SAMPLE
STEP, SYNC = OperationKind.OPTIM_STEP, OperationKind.WEIGHTS_SYNC


def test_a_sessions_operations_run_in_submission_order_with_typed_outputs(wired):
    rid = wired.resource()
    sid = wired.session(rid)
    release = wired.hold(rid)
    ops = [
        wired.submit(sid, FB, fb(length=4), "fb1"),
        wired.submit(sid, STEP, OptimStepRequest(), "step"),
        wired.submit(sid, FB, fb(length=4), "fb2"),
        wired.submit(sid, SYNC, WeightsSyncRequest(), "sync"),
        wired.submit(sid, SAMPLE, sample(), "sample"),
    ]
    assert all(wired.op(o).status == OperationStatus.PENDING for o in ops)
    release.set()
    wired.drain(rid)
    methods = [name for name, _, _ in wired.engine.calls if name != "load_resource"]
    assert methods == [
        "create_session",
        "forward_backward_batch",
        "optim_step",
        "forward_backward_batch",
        "publish",
        "sample_batch",
    ]
    outputs = [wired.op(o).output for o in ops]
    assert outputs[0] == ForwardBackwardResult(4.0, {})
    assert outputs[1] == OptimStepOutput(step=1)
    assert outputs[2] == ForwardBackwardResult(5.0, {})  # after the step: version 1
    assert outputs[3] == WeightsSyncOutput(weights_version=1)
    assert isinstance(outputs[4], SampleOutput)
    assert outputs[4].results[0].sequences[0].tokens == [1, 1]  # served version 1
    session = wired.sessions.get("user_local", sid)
    assert (session.step, session.policy_state.applied_weights_version) == (1, 1)
    finished, _, _ = wired.scheduler.metrics.snapshot()
    assert sum(finished.values()) == 5


def test_forward_backwards_of_several_sessions_share_a_pass_up_to_the_limit(tmp_path: Path):
    wired = wire(tmp_path, FakeEngine(), SchedulerConfig(max_batch=2))
    rid = wired.resource()
    sids = [wired.session(rid) for _ in range(3)]
    release = wired.hold(rid)
    ops = [wired.submit(s, FB, fb(), f"fb-{i}") for i, s in enumerate(sids)]
    release.set()
    wired.drain(rid)
    assert wired.engine.passes("forward_backward_batch") == [(sids[0], sids[1]), (sids[2],)]
    assert all(wired.op(o).status == OperationStatus.COMPLETED for o in ops)
    assert wired.scheduler.metrics.shared_passes == 1
    assert wired.scheduler.metrics.shared_pass_operations == 2
    wired.scheduler.close()


def test_a_sessions_own_forward_backwards_never_share_a_pass_and_barriers_split(wired):
    rid = wired.resource()
    a, b, c = (wired.session(rid) for _ in range(3))
    release = wired.hold(rid)
    wired.submit(a, FB, fb(), "a1")
    wired.submit(a, FB, fb(), "a2")  # a's own: stays behind a1
    wired.submit(b, FB, fb(), "b1")  # joins a1
    wired.submit(b, STEP, OptimStepRequest(), "b-step")  # a barrier for everything behind it
    wired.submit(c, FB, fb(), "c1")
    release.set()
    wired.drain(rid)
    assert wired.engine.passes("forward_backward_batch") == [(a, b), (a,), (c,)]
    assert [name for name, _, _ in wired.engine.calls][-4:] == [
        "forward_backward_batch",
        "forward_backward_batch",
        "optim_step",
        "forward_backward_batch",
    ]


def test_samples_of_one_session_merge_up_to_the_row_limit(tmp_path: Path):
    wired = wire(tmp_path, FakeEngine(), SchedulerConfig(max_sample_rows=6))
    rid = wired.resource()
    sid = wired.session(rid)
    release = wired.hold(rid)
    ops = [
        wired.submit(sid, SAMPLE, sample(prompts=2, num_samples=2), "s1"),  # 4 rows
        wired.submit(sid, SAMPLE, sample(prompts=1, num_samples=2), "s2"),  # 6 rows in all
        wired.submit(sid, SAMPLE, sample(), "s3"),  # would make 7: the next pass
    ]
    release.set()
    wired.drain(rid)
    assert wired.engine.passes("sample_batch") == [(sid, sid), (sid,)]
    counts = [
        [len(r.sequences) for r in wired.op(o).output.results]  # type: ignore[union-attr]
        for o in ops
    ]
    assert counts == [[2, 2], [2], [1]]
    wired.scheduler.close()


def test_a_failing_member_of_a_pass_fails_alone(wired):
    rid = wired.resource()
    a, b, c = (wired.session(rid) for _ in range(3))
    release = wired.hold(rid)
    ops = [
        wired.submit(a, FB, fb(), "a"),
        wired.submit(b, FB, fb(first_token=POISON), "b"),
        wired.submit(c, FB, fb(length=6), "c"),
    ]
    release.set()
    wired.drain(rid)
    assert wired.engine.passes("forward_backward_batch") == [(a, b, c)]
    first, poisoned, last = (wired.op(o) for o in ops)
    assert first.status == last.status == OperationStatus.COMPLETED
    assert (first.output, last.output) == (
        ForwardBackwardResult(4.0, {}),
        ForwardBackwardResult(6.0, {}),
    )
    assert poisoned.status == OperationStatus.FAILED
    assert poisoned.error_code == OperationErrorCode.NON_FINITE_LOSS
    finished, _, _ = wired.scheduler.metrics.snapshot()
    assert finished[(FB.value, OperationStatus.FAILED.value)] == 1
    assert finished[(FB.value, OperationStatus.COMPLETED.value)] == 2


def test_a_pass_that_raises_fails_its_members_and_the_worker_moves_on(wired):
    rid = wired.resource()
    a, b = wired.session(rid), wired.session(rid)
    release = wired.hold(rid)
    crashed = [wired.submit(a, FB, fb(first_token=CRASH), "a"), wired.submit(b, FB, fb(), "b")]
    after = wired.submit(a, STEP, OptimStepRequest(), "step")
    release.set()
    wired.drain(rid)
    for o in crashed:
        record = wired.op(o)
        assert record.status == OperationStatus.FAILED
        assert record.error_code == OperationErrorCode.INTERNAL_ERROR
        assert record.error_message == "RuntimeError: the device fell over"
    assert wired.op(after).output == OptimStepOutput(step=1)


def test_operations_queued_behind_a_stop_fail_as_session_not_active(wired):
    rid = wired.resource()
    sid = wired.session(rid)
    release = wired.hold(rid)
    queued = wired.submit(sid, FB, fb(), "fb")
    # What SessionService.stop writes first; its teardown job would queue behind.
    stopping = SessionStatus.STOPPING
    wired.repo.update_session(sid, lambda s: dataclasses.replace(s, status=stopping))
    release.set()
    wired.drain(rid)
    record = wired.op(queued)
    assert record.status == OperationStatus.FAILED
    assert record.error_code == OperationErrorCode.SESSION_NOT_ACTIVE
    assert wired.engine.passes("forward_backward_batch") == []


def test_a_checkpoint_without_a_checkpoint_service_fails_the_operation_only(wired):
    rid = wired.resource()
    sid = wired.session(rid)
    request = CheckpointRequest(CheckpointType.TRAINING)
    failed = wired.submit(sid, OperationKind.TRAINING_CHECKPOINT, request, "ckpt")
    step = wired.submit(sid, STEP, OptimStepRequest(), "step")
    wired.drain(rid)
    assert wired.op(failed).status == OperationStatus.FAILED
    assert wired.op(failed).error_code == OperationErrorCode.INTERNAL_ERROR
    assert wired.op(step).output == OptimStepOutput(step=1)


def test_a_synchronous_weights_sync_is_a_barrier_for_the_passes_around_it(wired):
    rid = wired.resource()
    a, b = wired.session(rid), wired.session(rid)
    release = wired.hold(rid)
    wired.submit(a, FB, fb(), "a-fb")
    wired.submit(a, SYNC, WeightsSyncRequest(), "a-sync")
    wired.submit(b, FB, fb(), "b-fb")  # behind the sync: does not join a's pass
    wired.submit(a, SAMPLE, sample(), "a-sample")
    wired.submit(b, SAMPLE, sample(), "b-sample")  # samples of any sessions share a pass
    release.set()
    wired.drain(rid)
    ran = [(name, sessions) for name, _, sessions in wired.engine.calls[-4:]]
    assert ran == [
        ("forward_backward_batch", (a,)),
        ("publish", (a,)),
        ("forward_backward_batch", (b,)),
        ("sample_batch", (a, b)),
    ]
