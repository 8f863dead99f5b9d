"""Durable LoRA sessions through the real services and engine in this process: what each kind
writes, and a restart in the window between an operation's state reaching the disk and its
COMPLETED record (the record is put back to RUNNING, as a crash there leaves it): the operation
completes from the state's record, and the session is RUNNING with that state."""

from __future__ import annotations

import dataclasses
import threading

from inprocess import USER, open_session, ready_resource

from posttrain.config import EngineConfig, ServerConfig
from posttrain.service import build_services
from posttrain.service.durability.durable_sessions import changed_parts
from posttrain.statuses import OperationStatus, SessionStatus
from posttrain.types import (
    AdamParams,
    ForwardBackwardRequest,
    LossConfig,
    LossType,
    OperationKind,
    OptimStepRequest,
    TrainingSample,
    WeightsSyncRequest,
)

SAMPLE = TrainingSample(
    (1, 40, 41, 42), {"target_tokens": (40.0, 41.0, 42.0, 50.0), "weights": (1.0,) * 4}
)
CE = LossConfig(LossType.CROSS_ENTROPY)


def test_each_kind_writes_what_it_changes():
    train = ForwardBackwardRequest((SAMPLE,), CE)
    score = ForwardBackwardRequest((SAMPLE,), CE, forward_only=True)
    assert changed_parts(OperationKind.FORWARD_BACKWARD, train) == ("gradients",)
    assert changed_parts(OperationKind.FORWARD_BACKWARD, score) == ()
    assert changed_parts(OperationKind.OPTIM_STEP, OptimStepRequest()) == (
        "trainer",
        "optimizer",
        "gradients",
    )
    assert changed_parts(OperationKind.WEIGHTS_SYNC, WeightsSyncRequest()) == ("generator",)
    assert changed_parts(OperationKind.SAMPLE, None) == ()


def run(services, session_id: str, kind: OperationKind, request) -> str:
    done = threading.Event()
    op = services.operations.submit(
        USER,
        services.sessions.get(USER, session_id),
        kind,
        idempotency_key=f"{kind}-{id(request)}",
        fingerprint="f",
        request=request,
    )
    while services.repo.get_operation(op.id).status not in (
        OperationStatus.COMPLETED,
        OperationStatus.FAILED,
    ):
        done.wait(0.01)
    return op.id


def test_an_operation_persisted_but_not_recorded_completes_after_a_restart(tmp_path):
    config = ServerConfig(data_dir=tmp_path, engine=EngineConfig(device="cpu"))
    services = build_services(config)
    resource = ready_resource(services)
    session = open_session(services, resource.id)
    run(services, session.id, OperationKind.FORWARD_BACKWARD, ForwardBackwardRequest((SAMPLE,), CE))
    step = run(
        services,
        session.id,
        OperationKind.OPTIM_STEP,
        OptimStepRequest(adam=AdamParams(learning_rate=1e-2)),
    )
    completed = services.repo.get_operation(step)
    assert completed.status == OperationStatus.COMPLETED
    scored_id = run(
        services,
        session.id,
        OperationKind.FORWARD_BACKWARD,
        ForwardBackwardRequest((SAMPLE,), CE, forward_only=True, return_loss_fn_outputs=True),
    )
    scores = services.repo.get_operation(scored_id).output.loss_fn_outputs
    services.close()
    # The crash window: the step's state is on disk, its COMPLETED record is not.
    services.repo.put_operation(
        dataclasses.replace(completed, status=OperationStatus.RUNNING, output=None)
    )

    restarted = build_services(config)
    try:
        recovered = restarted.repo.get_operation(step)
        assert recovered.status == OperationStatus.COMPLETED
        assert recovered.output == completed.output
        session_after = restarted.repo.get_session(session.id)
        assert session_after.status == SessionStatus.RUNNING and session_after.step == 1
        again = run(
            restarted,
            session.id,
            OperationKind.FORWARD_BACKWARD,
            ForwardBackwardRequest((SAMPLE,), CE, forward_only=True, return_loss_fn_outputs=True),
        )
        assert restarted.repo.get_operation(again).output.loss_fn_outputs == scores
    finally:
        restarted.close()
