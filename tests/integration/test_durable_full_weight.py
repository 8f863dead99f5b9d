"""Durable full-weight sessions: after `kill -9` and a restart, a live full-weight session is
RUNNING again with the state of its last completed operation (its last snapshot, written every
--persist-every optimizer steps, plus the journal of operations completed since, replayed), and
carries on exactly as a session that never saw the crash. Through the SDK against a real
server."""

from __future__ import annotations

import pytest
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL, sft_sample
from together.post_training import ModelResourcesClient, SessionClient

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
FAST = 0.05
ADAM = {"learning_rate": 1e-2}
TOKENS = [1, 40, 41, 42, 50, 60, 70, 80, 33, 34]
PROMPT = {"chunks": [{"encoded_text": {"tokens": TOKENS[:4]}}]}
GREEDY = {"max_tokens": 6, "temperature": 0.0}


def full_weight_session(base_url: str) -> SessionClient:
    resources = ModelResourcesClient.create(
        base_url=base_url, api_key=API_KEY, base_model=BASE_MODEL, lora_enabled=False, interval=0.2
    )
    return resources.create_session(interval=0.2)


def observed(session: SessionClient) -> tuple[list[float], list[int], list[float]]:
    """The trainer's logprobs of TOKENS and the generator's greedy continuation."""
    result = session.trainer.forward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
    sample = session.generator.sample(PROMPT, num_samples=1, sampling_params=GREEDY, interval=FAST)
    sequence = sample.sequences[0]
    scores = result.loss_fn_outputs[0].tensors["logprobs"].data
    return scores, list(sequence.tokens), list(sequence.logprobs)


def train(session: SessionClient, steps: int) -> None:
    for _ in range(steps):
        session.trainer.forward_backward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
        session.trainer.optim_step(adam_params=ADAM, interval=FAST)


def first_leg(session: SessionClient) -> None:
    """--persist-every 2: steps 1-2 (a snapshot at 2), step 3, a weights-sync and gradients
    accumulated after them: the journal the first crash must replay."""
    train(session, 3)
    session.trainer.weights_sync(interval=FAST)
    session.trainer.forward_backward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)


def second_leg(session: SessionClient) -> None:
    """Step 4 applies the kept gradients (a snapshot), step 5 and a weights-sync are journaled."""
    session.trainer.optim_step(adam_params=ADAM, interval=FAST)
    train(session, 1)
    session.trainer.weights_sync(interval=FAST)


@pytest.fixture
def restarted(tmp_path):
    proc = ServerProcess.started(tmp_path, "--poll-hold-seconds", "0", "--persist-every", "2")
    yield proc
    proc.stop()


def crash_and_restart(server: ServerProcess) -> None:
    server.stop(kill=True)
    server.start(keep_port=True)  # the same SDK clients, as a user's loop would hold them


@pytest.mark.slow
def test_a_full_weight_session_survives_kill_9_between_snapshots_exactly(restarted):
    server = restarted
    session = full_weight_session(server.base_url)
    first_leg(session)
    seen = observed(session)
    record = session.retrieve()

    crash_and_restart(server)
    after = session.retrieve()
    assert after.status == "TRAINING_SESSION_STATUS_RUNNING"
    assert after.step == record.step == 3
    assert observed(session) == seen  # trainer and generator weights, bit for bit
    second_leg(session)
    seen = observed(session)

    crash_and_restart(server)  # a snapshot at step 4, then step 5 and a sync journaled
    assert session.retrieve().step == 5
    assert observed(session) == seen
    train(session, 1)
    session.trainer.weights_sync(interval=FAST)
    crashed = observed(session)

    # A session that never saw a crash (a full-weight resource hosts one), same operations.
    twin = full_weight_session(server.base_url)
    first_leg(twin)
    observed(twin)
    second_leg(twin)
    observed(twin)
    train(twin, 1)
    twin.trainer.weights_sync(interval=FAST)
    assert observed(twin) == crashed  # moments and accumulated gradients included
    assert twin.retrieve().step == session.retrieve().step == 6
