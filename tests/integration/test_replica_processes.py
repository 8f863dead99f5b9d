"""`posttrain serve --generators process`: each model resource's generators are
`compute_config.num_generator_replicas` replica processes sampling beside its trainer
(engine/hosts/replicas/engine.py). Through the SDK against a real server: a forward-backward
submitted during another session's long sample finishes before that sample; a loop on two replicas,
with weights-syncs of every mode, gets exactly what the inline generator gives; a killed
replica fails its sample with INTERNAL_ERROR naming it while training goes on, and the next
sample runs on a new replica; the server's bound on replicas is a 400 naming the field;
shutdown leaves no replica behind."""

from __future__ import annotations

import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL, low_level, running, sft_sample
from test_worker_processes import alive, workers_of
from together.post_training import ModelResourcesClient, SessionClient

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
FAST = 0.05
LORA = {"rank": 4, "seed": 5}
ADAM = {"learning_rate": 2e-2}
TOKENS = [1, 40, 41, 42, 50, 60, 70, 80, 33, 34]
PROMPT = {"chunks": [{"encoded_text": {"tokens": TOKENS[:4]}}]}
MODES = (
    "WEIGHT_SYNC_TYPE_SYNCHRONOUS",
    "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH",
    "WEIGHT_SYNC_TYPE_PIPELINE",
)


def open_session(base_url: str, replicas: int) -> tuple[ModelResourcesClient, SessionClient]:
    resources = ModelResourcesClient.create(
        base_url=base_url,
        api_key=API_KEY,
        base_model=BASE_MODEL,
        compute_config={"num_generator_replicas": replicas},
        interval=0.2,
    )
    return resources, resources.create_session(interval=0.2, lora_config=LORA)


def sampled(session: SessionClient, seed: int) -> list[list[int]]:
    result = session.generator.sample(
        PROMPT, num_samples=2, sampling_params={"max_tokens": 6, "seed": seed}, interval=FAST
    )
    return [list(s.tokens) for s in result.sequences]


def scored_samples(session: SessionClient) -> tuple[list, list]:
    """A fixed-seed sample's tokens and their logprobs under the weights served."""
    result = session.generator.sample(
        PROMPT, num_samples=2, sampling_params={"max_tokens": 6, "seed": 3}, interval=FAST
    )
    return [list(s.tokens) for s in result.sequences], [s.logprobs for s in result.sequences]


def loop(session: SessionClient) -> list:
    """Train, publish in each mode, and sample after each (four at once after the last)."""
    seen: list = []
    for mode in MODES:
        fb = session.trainer.forward_backward(
            samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST
        )
        session.trainer.optim_step(adam_params=ADAM, interval=FAST)
        synced = session.trainer.weights_sync(weight_sync_type=mode, interval=FAST)
        seen.append((fb.metrics["loss:sum"], synced.weights_version, sampled(session, 9)))
    with ThreadPoolExecutor(4) as pool:
        seen.append(list(pool.map(lambda seed: sampled(session, seed), range(4))))
    return seen


@pytest.fixture(scope="module")
def replica_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("replicas")
    proc = ServerProcess.started(
        directory,
        "--poll-hold-seconds",
        "0",
        "--generators",
        "process",
        "--max-generator-replicas",
        "2",
    )
    yield proc
    proc.stop()


def test_a_forward_backward_finishes_during_another_sessions_long_sample(replica_server):
    url = replica_server.base_url
    resources, sampler = open_session(url, 1)
    trainee = resources.create_session(interval=0.2, lora_config=LORA)
    ops = low_level(url).post_training.operations
    generating = ops.sample(
        sampler.session_id,
        model_inputs=[PROMPT] * 16,
        num_samples=16,
        sampling_params={"max_tokens": 120, "seed": 1, "temperature": 1.0},
        idempotency_key=str(uuid.uuid4()),
    )
    while running(url, "sample") < 1:
        time.sleep(0.02)
    trainee.trainer.forward_backward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
    trainee.trainer.optim_step(adam_params=ADAM, interval=FAST)
    # Both finished while the sample still generates: it did not hold the trainer.
    status = ops.retrieve_sample(generating.id, session_id=sampler.session_id).status
    assert status == "TRAINING_OPERATION_STATUS_RUNNING", status
    while status != "TRAINING_OPERATION_STATUS_COMPLETED":
        time.sleep(0.05)
        status = ops.retrieve_sample(generating.id, session_id=sampler.session_id).status
    assert status == "TRAINING_OPERATION_STATUS_COMPLETED"


def test_two_replicas_give_what_the_inline_generator_gives(replica_server, tmp_path):
    _, session = open_session(replica_server.base_url, 2)
    through_replicas = loop(session)
    inline = ServerProcess.started(tmp_path, "--poll-hold-seconds", "0")
    try:
        _, twin = open_session(inline.base_url, 1)  # inline: one generator
        assert loop(twin) == through_replicas
    finally:
        inline.stop()
    assert [version for _, version, _ in through_replicas[:3]] == [1, 2, 3]


def test_a_killed_replica_fails_its_sample_and_training_goes_on(replica_server):
    url = replica_server.base_url
    before = set(workers_of(replica_server.process.pid))
    _, session = open_session(url, 1)
    (replica,) = set(workers_of(replica_server.process.pid)) - before
    expected = sampled(session, 4)

    os.kill(replica, signal.SIGKILL)
    with pytest.raises(Exception) as info:
        sampled(session, 4)
    message = str(info.value)
    assert "INTERNAL_ERROR" in message or "internal" in message.lower(), message
    assert "generator replica 0 of model resource" in message and f"pid {replica})" in message
    assert replica_server.process.poll() is None  # the API process lives on
    session.trainer.forward_backward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
    assert sampled(session, 4) == expected  # a new replica, the same weights
    (restarted,) = set(workers_of(replica_server.process.pid)) - before
    assert restarted != replica


def test_more_replicas_than_the_servers_bound_is_a_400_naming_the_field(replica_server):
    response = httpx.post(
        f"{replica_server.base_url}/v1/rl/model-resources",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"base_model": BASE_MODEL, "compute_config": {"num_generator_replicas": 3}},
    )
    assert response.status_code == 400, response.text
    assert "compute_config.num_generator_replicas" in response.text
    assert "--max-generator-replicas" in response.text


def test_shutdown_leaves_no_replica(tmp_path):
    server = ServerProcess.started(tmp_path, "--generators", "process")
    try:
        open_session(server.base_url, 2)
        replicas = workers_of(server.process.pid)
        assert len(replicas) == 2
    finally:
        server.stop()
    assert not any(alive(pid) for pid in replicas)


def test_replicas_serve_the_published_weights_again_after_kill_9(tmp_path):
    """A restart rebuilds the replicas from the sessions' durable state: the generator
    serves what it served before the crash, and a weights-sync after it reaches them."""
    server = ServerProcess.started(tmp_path, "--poll-hold-seconds", "0", "--generators", "process")
    try:
        _, session = open_session(server.base_url, 2)
        for _ in range(2):
            session.trainer.forward_backward(
                samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST
            )
            session.trainer.optim_step(adam_params=ADAM, interval=FAST)
        session.trainer.weights_sync(interval=FAST)
        served = scored_samples(session)
        session.trainer.forward_backward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
        session.trainer.optim_step(adam_params=ADAM, interval=FAST)  # trained, not published

        server.stop(kill=True)
        server.start(keep_port=True)
        assert session.retrieve().status == "TRAINING_SESSION_STATUS_RUNNING"
        assert scored_samples(session) == served  # tokens and logprobs, bit for bit
        assert session.trainer.weights_sync(interval=FAST).weights_version == 3
        assert scored_samples(session)[1] != served[1]  # the third step's weights
    finally:
        server.stop()
