"""Inactivity expiry on real services (SQLite in tmp_path, the tiny model on the CPU), driven by
ExpiryReaper.scan directly rather than by its timer."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from inprocess import USER, open_session, ready_resource, services_fixture  # noqa: F401

from posttrain.config import BUILTIN_MODEL_ID
from posttrain.errors import InvalidRequest
from posttrain.records import OperationRecord
from posttrain.service import Services
from posttrain.statuses import OperationStatus, ResourceStatus, SessionErrorCode, SessionStatus
from posttrain.types import OperationKind


def make_due(services: Services, resource_id: str) -> None:
    """Pretend the resource's inactivity window ended a second ago."""
    services.repo.update_resource(
        resource_id, lambda r: dataclasses.replace(r, expires_at=time.time() - 1)
    )


def drain(services: Services, resource_id: str) -> None:
    """Wait until every job queued on the resource's worker so far has run."""
    services.scheduler.run_job(resource_id, lambda: None).result(timeout=60)


def test_a_due_resource_stops_and_its_running_sessions_expire(services):
    resource = ready_resource(services)
    assert resource.status == ResourceStatus.READY
    assert resource.expires_at is not None
    assert resource.expires_at - resource.created_at == pytest.approx(300, abs=5)
    session = open_session(services, resource.id)
    assert session.status == SessionStatus.RUNNING
    # A session whose setup has not run yet never ran: it ends in ERROR, not EXPIRED.
    pending = dataclasses.replace(session, id="ts-pending", status=SessionStatus.CREATING)
    services.repo.put_session(pending)
    assert services.expiry.scan(time.time()) == []  # not due yet
    make_due(services, resource.id)
    assert services.expiry.scan(time.time()) == [resource.id]
    drain(services, resource.id)
    stopped = services.resources.get(USER, resource.id)
    assert stopped.status == ResourceStatus.STOPPED
    assert stopped.expires_at is None
    assert services.sessions.get(USER, session.id).status == SessionStatus.EXPIRED
    never_ran = services.sessions.get(USER, "ts-pending")
    assert never_ran.status == SessionStatus.ERROR
    assert never_ran.error.code == SessionErrorCode.RESOURCE_UNAVAILABLE
    assert not services.engine.is_loaded(resource.id)


def unfinished_operation(session_id: str) -> OperationRecord:
    return OperationRecord(
        id="op-waiting",
        session_id=session_id,
        kind=OperationKind.OPTIM_STEP,
        status=OperationStatus.PENDING,
        created_at=time.time(),
        updated_at=time.time(),
        idempotency_key="k",
        fingerprint="f",
        created_by=USER,
    )


def test_a_resource_with_an_unfinished_operation_is_kept_and_its_expiry_moves(services):
    resource = ready_resource(services)
    session = open_session(services, resource.id)
    services.repo.insert_operation(unfinished_operation(session.id))
    make_due(services, resource.id)
    before = time.time()
    assert services.expiry.scan(time.time()) == []
    kept = services.resources.get(USER, resource.id)
    assert kept.status == ResourceStatus.READY
    assert kept.expires_at >= before + kept.inactive_timeout
    assert services.sessions.get(USER, session.id).status == SessionStatus.RUNNING


def test_extend_expiry_after_the_scan_still_saves_the_resource(services):
    resource = ready_resource(services)
    session = open_session(services, resource.id)
    release = threading.Event()
    services.scheduler.run_job(resource.id, lambda: release.wait(60))  # worker busy
    make_due(services, resource.id)
    assert services.expiry.scan(time.time()) == [resource.id]
    assert services.expiry.scan(time.time()) == []  # one expiry job per resource at a time
    extended = services.resources.extend_expiry(USER, resource.id, 60)
    assert extended.expires_at >= time.time() + 55
    release.set()
    drain(services, resource.id)
    assert services.resources.get(USER, resource.id).status == ResourceStatus.READY
    assert services.sessions.get(USER, session.id).status == SessionStatus.RUNNING
    assert services.engine.is_loaded(resource.id)


def test_inactive_timeout_outside_the_configured_range_names_the_field(services):
    for seconds in (299, 86401):
        with pytest.raises(InvalidRequest) as info:
            services.resources.create(
                USER,
                base_model=BUILTIN_MODEL_ID,
                lora_enabled=True,
                num_generator_replicas=1,
                inactive_timeout=seconds,
                muon_scaling=None,
            )
        assert info.value.param == "inactive_timeout"
    assert services.resources.list(USER, None) == []
