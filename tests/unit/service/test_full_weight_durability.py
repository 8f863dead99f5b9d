"""Durable full-weight sessions through the real services and engine in this process: a
snapshot every persist_every optimizer steps, the typed requests of the state-changing
operations completed since kept as a journal (and dropped once a snapshot covers them), and a
restart that loads the snapshot and replays the journal, so the session carries on exactly as
a twin that never restarted."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
from inprocess import USER, open_session

from posttrain.api.routes.operations import keep_wire_bodies_as_requests, parsed
from posttrain.config import BUILTIN_MODEL_ID, EngineConfig, ServerConfig
from posttrain.engine.checkpoint import durable
from posttrain.records import OperationRecord
from posttrain.service import Services, build_services, wire_services
from posttrain.service.durability.full_weight import is_snapshot_due
from posttrain.statuses import OperationStatus, SessionStatus
from posttrain.types import OperationKind

TOKENS = [1, 40, 41, 42, 50, 60, 70, 80]
SAMPLE = {
    "model_input": {"chunks": [{"encoded_text": {"tokens": TOKENS[:-1]}}]},
    "loss_fn_inputs": {
        "target_tokens": {"data": TOKENS[1:], "dtype": "int64"},
        "weights": {"data": [1.0] * (len(TOKENS) - 1), "dtype": "float32"},
    },
}
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
TRAIN = {"samples": [SAMPLE], "loss": CE}
SCORE = {**TRAIN, "forward_only": True, "return_loss_fn_outputs": True}
STEP = {"adam_params": {"learning_rate": 1e-2}}
SYNC = {"weight_sync_type": "WEIGHT_SYNC_TYPE_SYNCHRONOUS"}
BACKGROUND = {"weight_sync_type": "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH"}
GREEDY = {
    "prompts": [{"chunks": [{"encoded_text": {"tokens": TOKENS[:3]}}]}],
    "num_samples": 1,
    "sampling_params": {"max_tokens": 5, "temperature": 0.0},
}
FB, OPTIM, WSYNC = (
    OperationKind.FORWARD_BACKWARD,
    OperationKind.OPTIM_STEP,
    OperationKind.WEIGHTS_SYNC,
)
KEYS = itertools.count()


def config_for(data_dir: Path) -> ServerConfig:
    return ServerConfig(data_dir=data_dir, engine=EngineConfig(device="cpu"), persist_every=2)


def start(data_dir: Path) -> Services:
    return build_services(config_for(data_dir))


def full_weight_session(services: Services) -> str:
    resource = services.resources.create(
        USER,
        base_model=BUILTIN_MODEL_ID,
        lora_enabled=False,
        num_generator_replicas=1,
        inactive_timeout=300,
        muon_scaling=None,
    )
    return open_session(services, resource.id).id


def run(services: Services, session_id: str, kind: OperationKind, body: dict[str, Any]) -> str:
    """Submit `body` as the api layer does (its typed request) and wait for it."""
    op = services.operations.submit(
        USER,
        services.sessions.get(USER, session_id),
        kind,
        idempotency_key=f"key-{next(KEYS)}",
        fingerprint="f",
        request=parsed(services, session_id, kind, body),
    )
    while services.repo.get_operation(op.id).status not in (
        OperationStatus.COMPLETED,
        OperationStatus.FAILED,
    ):
        threading.Event().wait(0.01)
    finished = services.repo.get_operation(op.id)
    assert finished.status == OperationStatus.COMPLETED, finished.error_message
    return op.id


def observed(services: Services, session_id: str) -> tuple[Any, ...]:
    """The trainer's logprobs of TOKENS and the generator's greedy continuation."""
    score = services.repo.get_operation(run(services, session_id, FB, SCORE))
    sample = services.repo.get_operation(run(services, session_id, OperationKind.SAMPLE, GREEDY))
    (sequence,) = sample.output.results[0].sequences
    return score.output.loss_fn_outputs, sequence.tokens, sequence.logprobs


def before_the_crash(services: Services, session_id: str) -> dict[str, str]:
    """persist_every 2: steps 1 and 2 (a snapshot), step 3, a deferred weights-sync and
    gradients accumulated after them (the journal)."""
    ops = {}
    for index in range(3):
        ops[f"fb{index + 1}"] = run(services, session_id, FB, TRAIN)
        ops[f"step{index + 1}"] = run(services, session_id, OPTIM, STEP)
    ops["sync"] = run(services, session_id, WSYNC, BACKGROUND)
    ops["fb"] = run(services, session_id, FB, TRAIN)
    return ops


def after_the_crash(services: Services, session_id: str) -> tuple[Any, ...]:
    run(services, session_id, OPTIM, STEP)  # applies the journaled gradients: step 4, snapshot
    run(services, session_id, FB, TRAIN)
    run(services, session_id, OPTIM, STEP)
    run(services, session_id, WSYNC, SYNC)
    session = services.repo.get_session(session_id)
    return (*observed(services, session_id), session.step, session.policy_state)


def test_a_snapshot_is_due_after_every_persist_every_th_step():
    assert [is_snapshot_due(OPTIM, step, 3) for step in range(1, 7)] == [
        False,
        False,
        True,
        False,
        False,
        True,
    ]
    assert not is_snapshot_due(FB, 3, 3) and not is_snapshot_due(WSYNC, 3, 3)
    assert all(is_snapshot_due(OPTIM, step, 1) for step in range(1, 4))


def test_the_journal_keeps_what_the_last_snapshot_does_not_cover(tmp_path):
    services = start(tmp_path)
    try:
        session_id = full_weight_session(services)
        ops = before_the_crash(services, session_id)
        record = durable.read_manifest(services.scheduler.durability.directory(session_id))
        assert record["record"]["operation"] == ops["step2"] and record["record"]["step"] == 2
        journal = services.repo.journal(session_id, after=None)
        assert [op.id for op, _ in journal] == [ops["fb3"], ops["step3"], ops["sync"], ops["fb"]]
        kept = [(FB, TRAIN), (OPTIM, STEP), (WSYNC, BACKGROUND), (FB, TRAIN)]
        assert [request for _, request in journal] == [
            parsed(services, session_id, kind, body) for kind, body in kept
        ]
        observed(services, session_id)  # scoring and sampling change nothing: not journaled
        assert len(services.repo.journal(session_id, after=None)) == 4
        run(services, session_id, OPTIM, STEP)  # step 4: a snapshot covers them all
        assert services.repo.journal(session_id, after=None) == []
    finally:
        services.close()


@pytest.mark.slow
def test_a_restart_replays_the_journal_on_the_snapshot_exactly(tmp_path):
    services = start(tmp_path / "crashed")
    session_id = full_weight_session(services)
    before_the_crash(services, session_id)
    seen = observed(services, session_id)
    record = services.repo.get_session(session_id)
    services.close()  # the engine's state goes with it, as with kill -9

    restarted = start(tmp_path / "crashed")
    try:
        after = restarted.repo.get_session(session_id)
        assert after.status == SessionStatus.RUNNING
        assert (after.step, after.policy_state) == (record.step, record.policy_state)
        assert observed(restarted, session_id) == seen  # weights and generator, bit for bit
        crashed = after_the_crash(restarted, session_id)
    finally:
        restarted.close()

    # The last forward-backward was running when the process died: its gradients were in
    # memory only, so it runs again after the journal (its request kept, as any unfinished
    # one's).
    again = start(tmp_path / "again")
    try:
        again_id = full_weight_session(again)
        last = before_the_crash(again, again_id)["fb"]
        observed(again, again_id)
        running = again.repo.get_operation(last)
        again.close()
        again.repo.put_operation(
            dataclasses.replace(running, status=OperationStatus.RUNNING, output=None)
        )
        again = start(tmp_path / "again")
        assert after_the_crash(again, again_id) == crashed
        assert again.repo.get_operation(last).output == running.output
    finally:
        again.close()

    twin = start(tmp_path / "twin")
    try:
        twin_id = full_weight_session(twin)
        before_the_crash(twin, twin_id)
        observed(twin, twin_id)
        # Moments, accumulated gradients and the generator included.
        assert after_the_crash(twin, twin_id) == crashed
    finally:
        twin.close()


def test_a_step_snapshotted_but_not_recorded_completes_after_a_restart(tmp_path):
    services = start(tmp_path)
    session_id = full_weight_session(services)
    run(services, session_id, FB, TRAIN)
    run(services, session_id, OPTIM, STEP)
    run(services, session_id, FB, TRAIN)
    step2 = run(services, session_id, OPTIM, STEP)
    completed = services.repo.get_operation(step2)
    services.close()
    # The crash window: the snapshot is on disk, the step's COMPLETED record is not.
    services.repo.put_operation(
        dataclasses.replace(completed, status=OperationStatus.RUNNING, output=None)
    )
    restarted = start(tmp_path)
    try:
        assert restarted.repo.get_operation(step2).output == completed.output
        session = restarted.repo.get_session(session_id)
        assert session.status == SessionStatus.RUNNING and session.step == 2
        assert restarted.repo.journal(session_id, after=None) == []
        run(restarted, session_id, OPTIM, STEP)  # the session's restore ran before it
        assert restarted.repo.get_session(session_id).step == 3
    finally:
        restarted.close()


def test_a_restart_before_the_first_periodic_snapshot_replays_the_whole_journal(tmp_path):
    """Only the setup snapshot is on disk (no operation): the journal since it is the whole
    journal, and survives the restart's reconcile (it once cleared it)."""
    services = start(tmp_path)
    session_id = full_weight_session(services)
    run(services, session_id, FB, TRAIN)
    run(services, session_id, OPTIM, STEP)  # step 1 of persist_every 2: journaled
    run(services, session_id, WSYNC, SYNC)
    run(services, session_id, FB, TRAIN)
    seen = observed(services, session_id)
    record = services.repo.get_session(session_id)
    assert (
        durable.read_manifest(services.scheduler.durability.directory(session_id))["record"][
            "operation"
        ]
        is None
    )
    services.close()

    restarted = start(tmp_path)
    try:
        after = restarted.repo.get_session(session_id)
        assert (after.step, after.policy_state) == (record.step, record.policy_state)
        assert observed(restarted, session_id) == seen
    finally:
        restarted.close()


@pytest.mark.slow
def test_wire_bodies_an_older_server_kept_run_again_after_a_restart(tmp_path):
    """An older server kept the HTTP bodies of journaled and unfinished operations instead of
    their typed requests: at startup the api layer parses each once, as at submit, and the
    restart runs them as it runs typed ones."""
    services = start(tmp_path)
    session_id = full_weight_session(services)
    sent = [(FB, TRAIN), (OPTIM, STEP), (WSYNC, SYNC), (FB, TRAIN)]  # journaled: no snapshot
    journaled = {run(services, session_id, kind, body): (kind, body) for kind, body in sent}
    seen = observed(services, session_id)
    record = services.repo.get_session(session_id)
    now = 1.0
    pending = OperationRecord(
        "op-pending", session_id, FB, OperationStatus.PENDING, now, now, None,
        "f", USER,
    )  # fmt: skip
    services.repo.insert_operation(pending)
    services.close()
    store = sqlite3.connect(tmp_path / "posttrain.sqlite3")
    for op_id, (_, body) in {**journaled, pending.id: (FB, SCORE)}.items():
        store.execute(
            "UPDATE operations SET body = ?, request = NULL WHERE id = ?",
            (json.dumps(body).encode(), op_id),
        )
    store.commit()
    store.close()

    restarted = wire_services(config_for(tmp_path))  # as api/app.py starts
    keep_wire_bodies_as_requests(restarted)
    restarted.recover_after_restart()
    try:
        assert restarted.repo.wire_bodies() == []
        assert [request for _, request in restarted.repo.journal(session_id, after=None)] == [
            parsed(restarted, session_id, kind, body) for kind, body in journaled.values()
        ]
        after = restarted.repo.get_session(session_id)
        assert (after.step, after.policy_state) == (record.step, record.policy_state)
        assert observed(restarted, session_id) == seen
        scored = restarted.repo.get_operation(pending.id)  # ran before observed's operations
        assert scored.status == OperationStatus.COMPLETED, scored.error_message
        assert scored.output.loss_fn_outputs == seen[0]
    finally:
        restarted.close()
