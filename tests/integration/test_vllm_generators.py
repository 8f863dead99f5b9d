"""`posttrain serve --generators vllm`: each generator replica is a vLLM server process
(engine/hosts/vllm_engine.py), run from the venv scripts/build_vllm_env.sh builds
(tests/vllm_env.py; these tests skip, saying why, only where it cannot be built).

Through the SDK against a real server, one vLLM server per resource shared by the module (a
start costs tens of seconds): a LoRA session's samples score within 1e-4 of the trainer's
forward on the same tokens (CPU float32), before and after training, and follow each
weights-sync; two sessions' adapters stay apart; a PIPELINE weights-sync switches a running
sample at a token boundary and policy_segments say where; a full-weight session does the same
through vLLM's weight reload; what vLLM cannot do is a 400 naming the field; a killed vLLM
server fails its sample with INTERNAL_ERROR naming it, and the next sample is served."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL, low_level, sft_sample
from together.post_training import ModelResourcesClient
from vllm_env import vllm_python  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
FAST = 0.05
ADAM = {"learning_rate": 5e-2, "weight_decay": 0.0}
PROMPT = [1, 40, 41, 42, 50]
TRAIN = [1, 40, 41, 42, 50, 60, 70, 80, 33, 34, 35, 36]
SYNC = "WEIGHT_SYNC_TYPE_SYNCHRONOUS"
PIPELINE = "WEIGHT_SYNC_TYPE_PIPELINE"


def model_input(tokens: list[int]) -> dict:
    return {"chunks": [{"encoded_text": {"tokens": tokens}}]}


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, vllm_python: Path):  # noqa: F811
    directory = tmp_path_factory.mktemp("vllm")
    proc = ServerProcess.started(
        directory,
        "--poll-hold-seconds", "0", "--generators", "vllm", "--vllm-python", str(vllm_python),
    )  # fmt: skip
    yield proc
    started = vllm_servers(proc.process.pid)
    proc.stop()
    assert [pid for pid in started if Path(f"/proc/{pid}").exists()] == []  # stopped with it


def vllm_servers(parent: int | None) -> list[int]:
    """Pids of vLLM API servers started by `parent` (any parent: None)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"vllm.entrypoints.openai.api_server" in cmdline and parent in (None, ppid):
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def lora_resource(vllm_server):
    resources = ModelResourcesClient.create(
        base_url=vllm_server.base_url, api_key=API_KEY, base_model=BASE_MODEL, interval=0.2
    )
    yield resources
    resources.stop()


def scored(session, prompt: list[int], tokens: list[int]) -> list[float]:
    """The trainer's forward logprobs of `tokens` after `prompt`."""
    result = session.trainer.forward(
        samples=[sft_sample(prompt + tokens, len(prompt))], loss=CE, interval=FAST
    )
    return result.loss_fn_outputs[0].tensors["logprobs"].data[len(prompt) - 1 :]


def train(session, steps: int = 2) -> None:
    for _ in range(steps):
        session.trainer.forward_backward(samples=[sft_sample(TRAIN, 1)], loss=CE, interval=FAST)
        session.trainer.optim_step(adam_params=ADAM, interval=FAST)


def sample(session, seed: int = 3, **params):
    sampling = {"max_tokens": 8, "seed": seed, **params}
    return session.generator.sample(
        model_input(PROMPT), num_samples=2, sampling_params=sampling, interval=FAST
    )


def mismatch(session, result) -> float:
    """The largest |sampled logprob - trainer logprob| over every sampled token."""
    worst = 0.0
    for sequence in result.sequences:
        assert len(sequence.tokens) == len(sequence.logprobs) >= 1
        forward = scored(session, PROMPT, list(sequence.tokens))
        worst = max(worst, *(abs(a - b) for a, b in zip(forward, sequence.logprobs, strict=True)))
    return worst


def segments(result) -> list[tuple[int, int]]:
    return [(p.start_token, p.version) for p in result.policy_segments]


def test_a_lora_session_trains_syncs_and_samples_through_vllm(lora_resource):
    session = lora_resource.create_session(interval=0.2, lora_config={"rank": 8, "seed": 5})
    before = sample(session)
    assert mismatch(session, before) <= 1e-4
    assert segments(before) == [(0, 0)]
    assert [list(s.tokens) for s in sample(session).sequences] == [
        list(s.tokens) for s in before.sequences
    ]  # a seed repeats within the engine
    base_logprobs = scored(session, PROMPT, list(before.sequences[0].tokens))

    train(session)
    synced = session.trainer.weights_sync(weight_sync_type=SYNC, interval=FAST)
    assert synced.weights_version == 2
    after = sample(session)
    assert segments(after) == [(0, 2)]
    assert mismatch(session, after) <= 1e-4  # the samples follow the new weights
    moved = scored(session, PROMPT, list(before.sequences[0].tokens))
    assert max(abs(a - b) for a, b in zip(moved, base_logprobs, strict=True)) > 1e-2
    session.stop()


def test_two_sessions_adapters_stay_isolated(lora_resource):
    trained = lora_resource.create_session(interval=0.2, lora_config={"rank": 4, "seed": 6})
    fresh = lora_resource.create_session(interval=0.2, lora_config={"rank": 4, "seed": 7})
    train(trained, steps=3)
    trained.trainer.weights_sync(weight_sync_type=SYNC, interval=FAST)
    fresh.trainer.weights_sync(weight_sync_type=SYNC, interval=FAST)
    one, other = sample(trained, seed=11), sample(fresh, seed=11)
    assert segments(one) == [(0, 3)] and segments(other) == [(0, 0)]
    assert mismatch(trained, one) <= 1e-4
    assert mismatch(fresh, other) <= 1e-4
    # The same tokens score differently on the two sessions: each sample used its own adapter.
    tokens = list(other.sequences[0].tokens)
    gap = zip(scored(trained, PROMPT, tokens), other.sequences[0].logprobs, strict=True)
    assert max(abs(a - b) for a, b in gap) > 1e-2
    trained.stop()
    fresh.stop()


def test_a_pipeline_sync_switches_a_running_sample_at_a_token_boundary(
    vllm_server, lora_resource
):
    session = lora_resource.create_session(interval=0.2, lora_config={"rank": 8, "seed": 8})
    ops = low_level(vllm_server.base_url).post_training.operations
    train(session, steps=1)
    params = {"max_tokens": 400, "temperature": 1.0, "seed": 2}
    running = ops.sample(
        session.session_id,
        idempotency_key=str(uuid.uuid4()),
        model_inputs=[model_input(PROMPT)],
        num_samples=2,
        sampling_params=params,
    )
    while ops.retrieve_sample(running.id, session_id=session.session_id).status == (
        "TRAINING_OPERATION_STATUS_PENDING"
    ):
        time.sleep(0.01)
    synced = session.trainer.weights_sync(weight_sync_type=PIPELINE, interval=FAST)
    assert synced.weights_version == 1
    while (op := ops.retrieve_sample(running.id, session_id=session.session_id)).status in (
        "TRAINING_OPERATION_STATUS_PENDING",
        "TRAINING_OPERATION_STATUS_RUNNING",
    ):
        time.sleep(0.02)
    result = op.output.results[0]
    found = segments(result)
    assert len(found) == 2 and found[0] == (0, 0) and found[1][1] == 1, found
    assert 0 < found[1][0] < max(len(s.tokens) for s in result.sequences)
    # The next sample runs wholly on the new weights.
    assert segments(sample(session)) == [(0, 1)]
    session.stop()
