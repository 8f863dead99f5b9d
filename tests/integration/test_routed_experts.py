"""Routed-expert replay through the official SDK against a real server, on a random-init
Qwen3-MoE served with `--model` (tests/unit/model/families.py).

A sample with return_routed_experts returns a key per sequence; scoring the sequence with its
key equals scoring it freely while the weights are the sampler's, and differs once training
moved the routing; the seed-era uint16 buffer of the same routes (computed here with plain
transformers) gives exactly the key's result. Unknown keys, another session's keys, evicted
keys and routes that do not fit are refused naming the field; a dense model ignores
return_routed_experts."""

from __future__ import annotations

import base64
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ServerProcess
from helpers import API_KEY, low_level, open_session
from together import BadRequestError
from together.post_training import ModelResourcesClient
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "model"))
import families  # noqa: E402

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
FAST = 0.05
PROMPT = [1, 40, 41, 42, 50, 60, 70]


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("routed")
    directory = families.build("qwen3_moe", root / "models" / "qwen3_moe")
    proc = ServerProcess.started(root, "--poll-hold-seconds", "0", "--model", str(directory))
    yield proc, directory
    proc.stop()


def model_input(tokens: list[int]) -> dict:
    return {"chunks": [{"encoded_text": {"tokens": tokens}}]}


def ce_sample(tokens: list[int], **extra) -> dict:
    return {
        "model_input": model_input(tokens[:-1]),
        "loss_fn_inputs": {
            "target_tokens": {"data": tokens[1:], "dtype": "int64"},
            "weights": {"data": [1.0] * (len(tokens) - 1), "dtype": "float32"},
        },
        **extra,
    }


def scored(session, sample: dict) -> list[float]:
    result = session.trainer.forward(samples=[sample], loss=CE, interval=FAST)
    return result.loss_fn_outputs[0].tensors["logprobs"].data


def plain_routes(directory: Path, tokens: list[int]) -> np.ndarray:
    """[T, L, K] experts plain transformers routes tokens[:-1] to (the untrained weights)."""
    model = AutoModelForCausalLM.from_pretrained(directory)
    captured = []
    handles = [
        m.register_forward_hook(lambda _m, _a, out: captured.append(out[2]))
        for m in model.modules()
        if type(m).__name__ == "Qwen3MoeTopKRouter"
    ]
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens[:-1]]))
    for handle in handles:
        handle.remove()
    return torch.stack(captured, dim=1).numpy()


def seed_sample(tokens: list[int], routes: np.ndarray, shape: list | None = None) -> dict:
    """The seed-era shape (api.md 5.2): loss_inputs with a base64 uint16 routes buffer."""
    return {
        "model_input": model_input(tokens[:-1]),
        "loss_inputs": {
            "target_tokens": {"data": tokens[1:]},
            "weights": {"data": [1.0] * (len(tokens) - 1)},
            "routed_experts": {
                "data": base64.b64encode(routes.astype("<u2").tobytes()).decode(),
                "shape": shape or [str(n) for n in routes.shape],  # shape items may be strings
            },
        },
    }


def seed_scored(base_url: str, session_id: str, sample: dict) -> list[float]:
    ops = low_level(base_url).post_training.operations
    op = ops.forward_backward(
        session_id,
        idempotency_key=str(uuid.uuid4()),
        samples=[sample],
        loss=CE,
        forward_only=True,
        return_loss_fn_outputs=True,
    )
    while op.status not in (
        "TRAINING_OPERATION_STATUS_COMPLETED",
        "TRAINING_OPERATION_STATUS_FAILED",
    ):
        op = ops.retrieve_forward_backward(op.id, session_id=session_id)
    assert op.status == "TRAINING_OPERATION_STATUS_COMPLETED", op.error
    return op.output.loss_fn_outputs[0].tensors["logprobs"].data


def refused(session, sample: dict) -> str:
    with pytest.raises(BadRequestError) as info:
        session.trainer.forward(samples=[sample], loss=CE, interval=FAST)
    return str(info.value)


def close(a: list[float], b: list[float], tolerance: float) -> bool:
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tolerance


def test_sampled_keys_replay_their_routing_through_the_sdk(moe_server):
    server, directory = moe_server
    resources = ModelResourcesClient.create(
        base_url=server.base_url, api_key=API_KEY, base_model="qwen3_moe", interval=0.2
    )
    session = resources.create_session(interval=0.2, lora_config={"rank": 8, "seed": 3})
    other = resources.create_session(interval=0.2, lora_config={"rank": 8, "seed": 3})
    params = {"max_tokens": 8, "temperature": 1.0, "seed": 5}
    plain = session.generator.sample(
        model_input(PROMPT), num_samples=1, sampling_params=params, interval=FAST
    )
    assert plain.sequences[0].routed_experts_key is None
    result = session.generator.sample(
        model_input(PROMPT),
        num_samples=3,
        sampling_params=params,
        return_routed_experts=True,
        interval=FAST,
    )
    keys = [s.routed_experts_key for s in result.sequences]
    assert all(keys) and len(set(keys)) == 3
    sequence = result.sequences[0]
    tokens = PROMPT + list(sequence.tokens)
    key = sequence.routed_experts_key

    # The weights that sampled: the key's routing is the free routing.
    free_before = scored(session, ce_sample(tokens))
    assert close(scored(session, ce_sample(tokens, routed_experts_key=key)), free_before, 1e-6)

    # Train until the routing moves (LoRA changes the hidden states the router reads).
    for _ in range(6):
        session.trainer.forward_backward(samples=[ce_sample(tokens)], loss=CE, interval=FAST)
        session.trainer.optim_step(adam_params={"learning_rate": 5e-2}, interval=FAST)
    replayed = scored(session, ce_sample(tokens, routed_experts_key=key))
    free_after = scored(session, ce_sample(tokens))
    assert not close(replayed, free_after, 1e-4)

    # The seed-era buffer of the same routes is the key's result exactly.
    routes = plain_routes(directory, tokens)
    assert routes.shape == (len(tokens) - 1, 2, 2)
    assert close(
        seed_scored(server.base_url, session.session_id, seed_sample(tokens, routes)),
        replayed,
        1e-6,
    )

    # Refusals name the field.
    assert "samples[0].routed_experts_key" in refused(
        session, ce_sample(tokens, routed_experts_key="re_unknown")
    )
    assert "samples[0].routed_experts_key" in refused(
        other, ce_sample(tokens, routed_experts_key=key)
    )  # another session's key
    too_long = tokens + [33, 34]  # routes cover all but the last token, not two more
    message = refused(session, ce_sample(too_long, routed_experts_key=key))
    assert "samples[0].routed_experts_key" in message and "cover" in message
    ops = low_level(server.base_url).post_training.operations
    for bad, field in (
        (seed_sample(tokens, routes[:, :1]), "loss_inputs.routed_experts"),  # one layer
        (seed_sample(tokens, routes, shape=[len(tokens), 2, 2]), "routed_experts.data"),
        (seed_sample(tokens, routes + 4), "loss_inputs.routed_experts"),  # no expert 4..7
    ):
        with pytest.raises(BadRequestError) as info:
            ops.forward_backward(
                session.session_id, idempotency_key=str(uuid.uuid4()), samples=[bad], loss=CE
            )
        assert field in str(info.value), str(info.value)
    # Nothing above changed the session: the key still scores as before.
    assert close(scored(session, ce_sample(tokens, routed_experts_key=key)), replayed, 1e-6)


def test_keys_past_the_memory_budget_are_forgotten(tmp_path):
    directory = families.build("qwen3_moe", tmp_path / "models" / "qwen3_moe")
    server = ServerProcess.started(
        tmp_path, "--poll-hold-seconds", "0", "--model", str(directory), "--routed-experts-mib", "0"
    )
    try:
        resources = ModelResourcesClient.create(
            base_url=server.base_url, api_key=API_KEY, base_model="qwen3_moe", interval=0.2
        )
        session = resources.create_session(interval=0.2, lora_config={"rank": 4})
        result = session.generator.sample(
            model_input(PROMPT),
            num_samples=1,
            sampling_params={"max_tokens": 4, "seed": 1},
            return_routed_experts=True,
            interval=FAST,
        )
        (sequence,) = result.sequences
        tokens = PROMPT + list(sequence.tokens)
        message = refused(
            session, ce_sample(tokens, routed_experts_key=sequence.routed_experts_key)
        )
        assert "samples[0].routed_experts_key" in message and "expired" in message
    finally:
        server.stop()


def test_a_dense_model_ignores_return_routed_experts(moe_server):
    server, _ = moe_server  # it serves the built-in dense model too
    _, session = open_session(server.base_url)
    result = session.generator.sample(
        model_input(PROMPT),
        num_samples=2,
        sampling_params={"max_tokens": 4, "seed": 1},
        return_routed_experts=True,
        interval=FAST,
    )
    assert [s.routed_experts_key for s in result.sequences] == [None, None]
    message = refused(session, ce_sample(PROMPT, routed_experts_key="re_anything"))
    assert "samples[0].routed_experts_key" in message


def test_keys_a_completed_sample_reported_survive_kill_9(tmp_path):
    """The loop sampled with return_routed_experts, the server died before it trained on the
    routes: after the restart the keys still replay exactly the routes they named."""
    server = ServerProcess.started(tmp_path, "--poll-hold-seconds", "0")
    try:
        resources = ModelResourcesClient.create(
            base_url=server.base_url,
            api_key=API_KEY,
            base_model="posttrain/tiny-qwen3-moe",
            interval=0.2,
        )
        session = resources.create_session(interval=0.2, lora_config={"rank": 4, "seed": 2})
        result = session.generator.sample(
            model_input(PROMPT),
            num_samples=2,
            sampling_params={"max_tokens": 6, "seed": 4},
            return_routed_experts=True,
            interval=FAST,
        )
        samples = [
            ce_sample(PROMPT + list(s.tokens), routed_experts_key=s.routed_experts_key)
            for s in result.sequences
        ]
        session.trainer.forward_backward(samples=[samples[1]], loss=CE, interval=FAST)
        session.trainer.optim_step(adam_params={"learning_rate": 5e-2}, interval=FAST)
        before = [scored(session, sample) for sample in samples]

        server.stop(kill=True)
        server.start(keep_port=True)
        assert [scored(session, sample) for sample in samples] == before
    finally:
        server.stop()
