"""Deferred weights-syncs (BACKGROUND_PUBLISH, PIPELINE) against a fake engine over a real
SQLite store: when they complete, when they publish, and that they finish through the
scheduler's finish path, so the operation metrics count them."""

from __future__ import annotations

import dataclasses
import threading

from fake_engine import USER, fb, sample, wired_fixture  # noqa: F401

from posttrain.records import PolicyState
from posttrain.statuses import OperationErrorCode, OperationStatus, SessionStatus
from posttrain.types import (
    OperationKind,
    OptimStepRequest,
    PolicySegment,
    WeightsSyncOutput,
    WeightsSyncRequest,
    WeightSyncType,
)

STEP, SYNC, SAMPLE = OperationKind.OPTIM_STEP, OperationKind.WEIGHTS_SYNC, OperationKind.SAMPLE
BACKGROUND = WeightsSyncRequest(WeightSyncType.BACKGROUND_PUBLISH)
PIPELINE = WeightsSyncRequest(WeightSyncType.PIPELINE)


def finished_syncs(wired) -> dict[str, int]:
    finished, _, _ = wired.scheduler.metrics.snapshot()
    return {status: n for (kind, status), n in finished.items() if kind == SYNC.value}


def test_a_ready_background_sync_completes_at_submit_and_publishes_at_its_place(wired):
    rid = wired.resource()
    sid = wired.session(rid)
    wired.submit(sid, STEP, OptimStepRequest(), "step")
    wired.drain(rid)
    release = wired.hold(rid)
    sync = wired.submit(sid, SYNC, BACKGROUND, "sync")
    assert wired.op(sync).status == OperationStatus.COMPLETED  # before the worker is free
    assert wired.op(sync).output == WeightsSyncOutput(weights_version=1)
    assert wired.sessions.get(USER, sid).policy_state == PolicyState(1, 1, 0, True)
    assert finished_syncs(wired) == {OperationStatus.COMPLETED.value: 1}
    release.set()
    wired.drain(rid)
    assert wired.engine.served[sid] == 1
    assert wired.sessions.get(USER, sid).policy_state == PolicyState(1, 1, 1, False)
    assert finished_syncs(wired) == {OperationStatus.COMPLETED.value: 1}  # counted once


def test_a_deferred_sync_waits_for_the_operations_before_it_that_change_the_trainer(wired):
    rid = wired.resource()
    sid = wired.session(rid)
    release = wired.hold(rid)
    wired.submit(sid, STEP, OptimStepRequest(), "step")
    sync = wired.submit(sid, SYNC, BACKGROUND, "sync")
    assert wired.op(sync).status == OperationStatus.PENDING
    assert finished_syncs(wired) == {}
    release.set()
    wired.drain(rid)
    assert wired.op(sync).output == WeightsSyncOutput(weights_version=1)
    assert finished_syncs(wired) == {OperationStatus.COMPLETED.value: 1}


def test_a_pipeline_sync_publishes_inside_a_running_sample(wired):
    rid = wired.resource()
    sid = wired.session(rid)
    wired.submit(sid, STEP, OptimStepRequest(), "step")
    wired.drain(rid)
    in_sample, go = threading.Event(), threading.Event()
    wired.engine.mid_sample = lambda: (in_sample.set(), go.wait(60))
    generating = wired.submit(sid, SAMPLE, sample(), "sample")
    assert in_sample.wait(60)
    sync = wired.submit(sid, SYNC, PIPELINE, "sync")
    assert wired.op(sync).output == WeightsSyncOutput(weights_version=1)
    go.set()
    wired.drain(rid)
    result = wired.op(generating).output.results[0]  # type: ignore[union-attr]
    assert result.policy_segments == [PolicySegment(0, 0), PolicySegment(1, 1)]
    assert wired.engine.passes("publish") == [(sid,)]  # in flight, not again at its place
    assert wired.sessions.get(USER, sid).policy_state == PolicyState(1, 1, 1, False)
    assert finished_syncs(wired) == {OperationStatus.COMPLETED.value: 1}


def test_a_deferred_sync_of_a_stopped_session_fails_through_the_finish_path(wired):
    rid = wired.resource()
    sid = wired.session(rid)
    release = wired.hold(rid)
    step = wired.submit(sid, STEP, OptimStepRequest(), "step")
    sync = wired.submit(sid, SYNC, BACKGROUND, "sync")
    stopping = SessionStatus.STOPPING
    wired.repo.update_session(sid, lambda s: dataclasses.replace(s, status=stopping))
    release.set()
    wired.drain(rid)
    for op_id in (step, sync):
        assert wired.op(op_id).error_code == OperationErrorCode.SESSION_NOT_ACTIVE
    assert wired.engine.passes("publish") == []
    assert finished_syncs(wired) == {OperationStatus.FAILED.value: 1}
