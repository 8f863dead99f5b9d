"""OperationService, ResourceService and SessionService against a fake engine over a real
SQLite store: idempotent submission, operations on a session that is not RUNNING, and the
failure recorders of the lifecycle jobs (the worker's one job boundary)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_engine import USER, FakeEngine, fb, wire, wired_fixture  # noqa: F401

from posttrain.errors import Conflict
from posttrain.statuses import (
    OperationErrorCode,
    OperationStatus,
    ResourceErrorCode,
    ResourceStatus,
    SessionErrorCode,
    SessionStatus,
)
from posttrain.types import ForwardBackwardResult, OperationKind

FB = OperationKind.FORWARD_BACKWARD


def test_a_replayed_key_returns_the_first_operation_and_never_runs_twice(wired):
    rid = wired.resource()
    sid = wired.session(rid)
    first = wired.submit(sid, FB, fb(), "key")
    wired.drain(rid)
    replay = wired.submit_op(sid, FB, fb(), "key")
    wired.drain(rid)
    assert replay.id == first
    assert replay.output == ForwardBackwardResult(4.0, {})
    assert wired.engine.passes("forward_backward_batch") == [(sid,)]
    with pytest.raises(Conflict):
        wired.operations.replay(sid, FB, "key", "another body")


def test_an_operation_on_a_stopped_session_is_recorded_failed_at_once(wired):
    rid = wired.resource()
    sid = wired.session(rid)
    wired.sessions.stop(USER, sid)
    op = wired.submit_op(sid, FB, fb(), "late")
    assert op.status == OperationStatus.FAILED
    assert op.error_code == OperationErrorCode.SESSION_NOT_ACTIVE
    assert wired.engine.passes("forward_backward_batch") == []


def test_stop_after_queued_lets_the_queued_operations_run_then_stops(wired):
    rid = wired.resource()
    sid, other = wired.session(rid), wired.session(rid)
    release = wired.hold(rid)
    queued = wired.submit(sid, FB, fb(), "queued")
    also_queued = wired.submit(other, FB, fb(), "also-queued")
    stopping = wired.sessions.stop_after_queued(USER, sid)
    wired.sessions.stop(USER, other)  # a plain stop fails what is queued: the contrast
    assert wired.sessions.get(USER, sid).status == SessionStatus.RUNNING
    release.set()
    stopping.result(timeout=60)
    assert wired.op(queued).status == OperationStatus.COMPLETED
    assert wired.sessions.get(USER, sid).status == SessionStatus.STOPPED
    assert wired.op(also_queued).error_code == OperationErrorCode.SESSION_NOT_ACTIVE


def test_a_failed_model_load_is_recorded_on_the_resource(tmp_path: Path):
    wired = wire(tmp_path, FakeEngine(fail_load=True))
    record = wired.resources.get(USER, wired.resource())  # create itself does not raise
    assert record.status == ResourceStatus.ERROR
    assert record.error is not None
    assert record.error.code == ResourceErrorCode.PROVISIONING_FAILED
    assert record.error.code == "MODEL_RESOURCES_ERROR_CODE_PROVISIONING_FAILED"
    assert record.error.message == "no such weights"
    wired.scheduler.close()


def test_a_failed_session_setup_is_recorded_on_the_session_and_dropped(tmp_path: Path):
    engine = FakeEngine()
    wired = wire(tmp_path, engine)
    rid = wired.resource()
    engine.fail_setup = True
    session = wired.sessions.get(USER, wired.session(rid))  # create itself does not raise
    assert session.status == SessionStatus.ERROR
    assert session.error is not None
    assert (session.error.code, session.error.message) == (
        SessionErrorCode.SESSION_FAILED.value,
        "out of adapter slots",
    )
    assert engine.passes("drop_session") == [(session.id,)]
    wired.scheduler.close()
