"""Inactivity expiry through the SDK (api.md 1.2, 2.1): an idle resource stops and its sessions
expire; queued work and extend-expiry keep it alive.

The server here accepts inactive_timeout down to 1 s and checks every 0.2 s (hidden dev flags),
so expiry takes seconds instead of api.md's 300 s minimum.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator

import pytest
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL, low_level, sft_sample
from together.post_training import ModelResourcesClient
from together.post_training._operations import OperationFailedError

CHECK_INTERVAL_S = 0.2
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
# A guard against a hung test, not a performance bound.
HANG_GUARD_S = 120
# Seconds of queued work after the last submit: several inactive_timeouts (1 s) and checks.
QUEUED_WORK_S = 6.0


@pytest.fixture(scope="module")
def expiring_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("expiry")
    flags = ("--min-inactive-timeout-s", "1", "--expiry-check-interval-s", str(CHECK_INTERVAL_S))
    proc = ServerProcess.started(directory, *flags)
    yield proc
    proc.stop()


def create_resources(server: ServerProcess, inactive_timeout: int) -> ModelResourcesClient:
    return ModelResourcesClient.create(
        base_url=server.base_url,
        api_key=API_KEY,
        base_model=BASE_MODEL,
        inactive_timeout=inactive_timeout,
        interval=0.2,
    )


def wait_for_status(server: ServerProcess, resource_id: str, status: str) -> None:
    client = low_level(server.base_url).post_training
    deadline = time.monotonic() + HANG_GUARD_S
    while client.model_resources.retrieve(resource_id).status != status:
        assert time.monotonic() < deadline, f"{resource_id} never reached {status}"
        time.sleep(CHECK_INTERVAL_S)


def test_an_idle_resource_stops_and_its_sessions_expire(expiring_server):
    resources = create_resources(expiring_server, inactive_timeout=2)
    record = resources.retrieve()
    assert record.inactive_timeout == 2
    assert record.expires_at is not None
    session = resources.create_session(interval=0.2)
    session.trainer.forward_backward(samples=[sft_sample([5, 6, 7, 8], 1)], loss=CE)
    wait_for_status(expiring_server, resources.model_resources_id, "MODEL_RESOURCES_STATUS_STOPPED")
    stopped = resources.retrieve()
    assert stopped.expires_at is None
    assert session.retrieve().status == "TRAINING_SESSION_STATUS_EXPIRED"
    with pytest.raises(OperationFailedError, match="SESSION_NOT_ACTIVE"):
        session.trainer.forward_backward(samples=[sft_sample([5, 6, 7, 8], 1)], loss=CE)
    client = low_level(expiring_server.base_url).post_training
    listed = client.sessions.list(model_resources_id=resources.model_resources_id).data
    assert [s.status for s in listed] == ["TRAINING_SESSION_STATUS_EXPIRED"]
    # The SDK's teardown accepts both: stop is idempotent and the resource is already stopped.
    assert session.stop().status == "TRAINING_SESSION_STATUS_EXPIRED"
    resources.stop()


def test_a_resource_is_not_expired_while_its_operations_are_queued_or_running(expiring_server):
    resources = create_resources(expiring_server, inactive_timeout=1)
    session = resources.create_session(interval=0.2)
    client = low_level(expiring_server.base_url).post_training
    # Enough work to keep the worker busy for several inactive_timeouts on this CPU.
    tokens = [(7 * i) % 90 + 5 for i in range(128)]
    batch = [sft_sample(tokens[i:] + tokens[:i], 1) for i in range(8)]
    # How many operations make QUEUED_WORK_S depends on this machine's speed: time one first.
    started = time.monotonic()
    session.trainer.forward_backward(samples=batch, loss=CE, interval=0.02)
    num_operations = max(8, math.ceil(QUEUED_WORK_S / (time.monotonic() - started)))
    operation_ids = [
        client.operations.forward_backward(
            session.session_id, idempotency_key=str(uuid.uuid4()), loss=CE, samples=batch
        ).id
        for _ in range(num_operations)
    ]
    last_submit = time.monotonic()
    statuses = []
    for operation_id in operation_ids:
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            op = client.operations.retrieve_forward_backward(
                operation_id, session_id=session.session_id
            )
            if op.status.endswith(("COMPLETED", "FAILED")):
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        statuses.append((op.status, op.error))
    busy_s = time.monotonic() - last_submit
    # Precondition: without the busy rule the resource would have expired meanwhile.
    assert busy_s > 1 + 3 * CHECK_INTERVAL_S, f"only {busy_s:.2f}s of work; raise QUEUED_WORK_S"
    assert statuses == [("TRAINING_OPERATION_STATUS_COMPLETED", None)] * num_operations, statuses
    # Once idle, it expires as usual.
    wait_for_status(expiring_server, resources.model_resources_id, "MODEL_RESOURCES_STATUS_STOPPED")
    assert session.retrieve().status == "TRAINING_SESSION_STATUS_EXPIRED"
    session.stop()
    resources.stop()


def test_extend_expiry_keeps_an_idle_resource_ready(expiring_server):
    resources = create_resources(expiring_server, inactive_timeout=1)
    session = resources.create_session(interval=0.2)
    before = time.time()
    extended = resources.extend_expiry(seconds=60)
    assert extended.expires_at.timestamp() >= before + 59
    # Idle for several timeouts and checks: still READY, expiry unchanged.
    time.sleep(1 + 10 * CHECK_INTERVAL_S)
    current = resources.retrieve()
    assert current.status == "MODEL_RESOURCES_STATUS_READY"
    assert current.expires_at == extended.expires_at
    assert session.retrieve().status == "TRAINING_SESSION_STATUS_RUNNING"
    session.stop()
    resources.stop()
