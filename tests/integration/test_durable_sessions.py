"""Durable LoRA sessions: after `kill -9` and a restart, a live session is RUNNING again with
the state of its last completed operation (adapter, optimizer moments, accumulated gradients,
step, policy versions, the generator's weights), and carries on exactly as a session that never
saw the crash. Through the SDK against a real server."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import ServerProcess
from helpers import open_session, running, sft_sample
from together.post_training import SessionClient

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
FAST = 0.05
LORA = {"rank": 4, "seed": 7}
ADAM = {"learning_rate": 2e-2}
TOKENS = [1, 40, 41, 42, 50, 60, 70, 80, 33, 34]
PROMPT = {"chunks": [{"encoded_text": {"tokens": TOKENS[:4]}}]}
GREEDY = {"max_tokens": 6, "temperature": 0.0}


def scored(session: SessionClient) -> list[float]:
    result = session.trainer.forward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
    return result.loss_fn_outputs[0].tensors["logprobs"].data


def train(session: SessionClient, steps: int) -> None:
    for _ in range(steps):
        session.trainer.forward_backward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
        session.trainer.optim_step(adam_params=ADAM, interval=FAST)


def before_the_crash(session: SessionClient) -> None:
    """Two steps, a weights-sync, then gradients accumulated and not yet applied."""
    train(session, 2)
    session.trainer.weights_sync(interval=FAST)
    session.trainer.forward_backward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)


def after_the_crash(session: SessionClient) -> tuple[list[float], list[int]]:
    session.trainer.optim_step(adam_params=ADAM, interval=FAST)  # applies the kept gradients
    train(session, 1)
    sample = session.generator.sample(PROMPT, num_samples=1, sampling_params=GREEDY, interval=FAST)
    return scored(session), list(sample.sequences[0].tokens)


@pytest.fixture
def restarted(tmp_path):
    proc = ServerProcess.started(tmp_path, "--poll-hold-seconds", "0")
    yield proc
    proc.stop()


def test_a_live_session_survives_kill_9_and_carries_on_exactly(restarted):
    server = restarted
    _, session = open_session(server.base_url, lora_config=LORA)
    before_the_crash(session)
    scores = scored(session)
    record = session.retrieve()

    server.stop(kill=True)
    server.start(keep_port=True)  # the same SDK client, as a user's loop would hold it

    after = session.retrieve()
    assert after.status == "TRAINING_SESSION_STATUS_RUNNING"
    assert after.step == record.step
    assert scored(session) == scores  # the adapter, bit for bit
    crashed = after_the_crash(session)

    # A session that never saw the crash, on the same server, with the same operations.
    _, twin = open_session(server.base_url, lora_config=LORA)
    before_the_crash(twin)
    assert after_the_crash(twin) == crashed  # moments, gradients and generator included
    assert twin.retrieve().step == session.retrieve().step


def test_an_sdk_call_in_flight_across_kill_9_returns_its_result(restarted):
    """The user's loop is inside `sample` (polling) when the server dies: the SDK retries
    through the restart, the operation runs again, and the call returns its result."""
    server = restarted
    _, session = open_session(server.base_url, lora_config=LORA)
    params = {"max_tokens": 200, "temperature": 0.0, "stop": []}
    result = {}

    def call() -> None:
        result["sample"] = session.generator.sample(
            PROMPT, num_samples=32, sampling_params=params, interval=FAST
        )

    thread = threading.Thread(target=call)
    thread.start()
    while running(server.base_url, "sample") < 1:
        assert thread.is_alive(), "the sample finished before the server could be killed"
        time.sleep(0.02)
    server.stop(kill=True)
    server.start(keep_port=True)
    thread.join(timeout=600)
    assert not thread.is_alive() and "sample" in result
    again = session.generator.sample(PROMPT, num_samples=32, sampling_params=params, interval=FAST)
    assert [s.tokens for s in result["sample"].sequences] == [s.tokens for s in again.sequences]
