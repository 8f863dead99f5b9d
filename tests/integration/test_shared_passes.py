"""Forward-backward operations of different sessions queued together run in one shared pass,
and each session's results equal those of the same session run alone."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from helpers import API_KEY, BASE_MODEL, low_level, sft_sample
from together.post_training import ModelResourcesClient

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
DATA = {
    f"task{i}": [sft_sample([(7 * i + j) % 90 + 3 for j in range(6 + 2 * i)], 3)] for i in range(4)
}


# Adam's first step is lr * sign(g): with the default eps a gradient entry that is pure float32
# rounding noise would move a full learning rate either way; eps=1e-3 keeps such entries still.
ADAM = {"learning_rate": 1e-2, "eps": 1e-3}


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing from /metrics")


def sessions(base_url: str) -> tuple[ModelResourcesClient, dict]:
    resources = ModelResourcesClient.create(
        base_url=base_url, api_key=API_KEY, base_model=BASE_MODEL, interval=0.2
    )
    by_task = {
        task: resources.create_session(lora_config={"rank": 4 + i, "seed": i}, interval=0.2)
        for i, task in enumerate(DATA)
    }
    return resources, by_task


def test_queued_sessions_share_a_pass_and_match_running_alone(shared_server):
    base_url = shared_server.base_url
    resources, alone = sessions(base_url)
    expected = {}
    for task, session in alone.items():
        session.trainer.forward_backward(samples=DATA[task], loss=CE)
        session.trainer.optim_step(adam_params=ADAM)
        expected[task] = session.trainer.forward(samples=DATA[task], loss=CE)
    resources.stop(force=True)

    resources, shared = sessions(base_url)
    ops = low_level(base_url).post_training.operations
    before = metric(base_url, "posttrain_shared_pass_operations_total")
    # A long sample occupies the worker, so the four forward-backwards queue up behind it.
    first = next(iter(shared.values())).session_id
    ops.sample(
        first,
        idempotency_key=str(uuid.uuid4()),
        model_inputs=[{"chunks": [{"encoded_text": {"tokens": [1, 5]}}]}],
        num_samples=16,
        sampling_params={"max_tokens": 200, "stop": []},
    )
    submitted = {
        task: ops.forward_backward(
            session.session_id, idempotency_key=str(uuid.uuid4()), loss=CE, samples=DATA[task]
        )
        for task, session in shared.items()
    }
    for task, session in shared.items():
        session.trainer.optim_step(adam_params=ADAM)
        got = session.trainer.forward(samples=DATA[task], loss=CE)
        # Equal up to float32 summation order in the shared pass.
        assert got.loss == pytest.approx(expected[task].loss, rel=1e-4, abs=1e-4), task
        result = ops.retrieve_forward_backward(submitted[task].id, session_id=session.session_id)
        assert result.status == "TRAINING_OPERATION_STATUS_COMPLETED"
    assert metric(base_url, "posttrain_shared_pass_operations_total") >= before + 2
    resources.stop(force=True)


def test_queued_samples_of_several_sessions_share_a_pass_with_the_same_tokens(shared_server):
    base_url = shared_server.base_url
    resources, by_task = sessions(base_url)
    ops = low_level(base_url).post_training.operations
    prompts = {task: [1, 5 + i, 6 + i] for i, task in enumerate(by_task)}
    params = {"max_tokens": 12, "temperature": 1.0, "seed": 11, "stop": []}

    def model_input(task: str) -> dict:
        return {"chunks": [{"encoded_text": {"tokens": prompts[task]}}]}

    alone = {
        task: session.generator.sample(model_input(task), num_samples=2, sampling_params=params)
        for task, session in by_task.items()
    }
    before = metric(base_url, "posttrain_shared_pass_operations_total")
    first = next(iter(by_task.values())).session_id
    ops.forward_backward(  # occupies the worker while the samples queue up
        first,
        idempotency_key=str(uuid.uuid4()),
        loss=CE,
        samples=[sft_sample([(3 + j) % 90 + 3 for j in range(400)], 3)] * 16,
    )
    submitted = {
        task: ops.sample(
            session.session_id,
            idempotency_key=str(uuid.uuid4()),
            model_inputs=[model_input(task)],
            num_samples=2,
            sampling_params=params,
        )
        for task, session in by_task.items()
    }
    for task, session in by_task.items():
        op = submitted[task]
        while op.status not in (
            "TRAINING_OPERATION_STATUS_COMPLETED",
            "TRAINING_OPERATION_STATUS_FAILED",
        ):
            time.sleep(0.05)
            op = ops.retrieve_sample(op.id, session_id=session.session_id)
        assert op.status == "TRAINING_OPERATION_STATUS_COMPLETED", op.error
        got = [s.tokens for s in op.output.results[0].sequences]
        assert got == [s.tokens for s in alone[task].sequences], task
    assert metric(base_url, "posttrain_shared_pass_operations_total") >= before + 2
    resources.stop(force=True)
