"""The official together SDK drives SFT and RL steps against a real posttrain server."""

from __future__ import annotations

import uuid

import pytest
from helpers import API_KEY, low_level, open_session, sft_sample
from transformers import AutoTokenizer

from posttrain.config import BUILTIN_MODEL_DIR

TOKENIZER = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
EOS = TOKENIZER.eos_token_id

SFT_PAIRS = [("12+34=", "46"), ("7+8=", "15"), ("50+25=", "75"), ("3+9=", "12")]


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def sft_batch() -> list[dict]:
    samples = []
    for prompt, answer in SFT_PAIRS:
        prompt_ids = encode(prompt)
        samples.append(sft_sample(prompt_ids + encode(answer) + [EOS], len(prompt_ids)))
    return samples


def test_sft_cross_entropy_halves_the_loss_in_20_steps(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 8, "seed": 1})
    trainer = session.trainer
    losses = []
    for _ in range(20):
        result = trainer.forward_backward(
            samples=sft_batch(), loss={"type": "LOSS_TYPE_CROSS_ENTROPY"}
        )
        losses.append(result.loss)
        step = trainer.optim_step(adam_params={"learning_rate": 2e-2, "weight_decay": 0.0})
    assert step.step == 20
    assert losses[-1] < 0.5 * losses[0], losses
    assert session.retrieve().step == 20
    assert session.retrieve().policy_state.trainer_step == 20
    session.stop()
    resources.stop()


def rl_sample(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float):
    full = prompt + tokens
    n_prompt = len(prompt) - 1
    return {
        "model_input": {"chunks": [{"encoded_text": {"tokens": full[:-1]}}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": full[1:], "dtype": "int64"},
            "logprobs": {"data": [0.0] * n_prompt + logprobs, "dtype": "float32"},
            "advantages": {
                "data": [0.0] * n_prompt + [advantage] * len(tokens),
                "dtype": "float32",
            },
            "mask": {"data": [0] * n_prompt + [1] * len(tokens), "dtype": "int64"},
        },
    }


def test_rl_step_sample_score_train_sync_sample(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 8, "seed": 2})
    prompt = encode("<|im_start|>12+34=")
    generator, trainer = session.generator, session.trainer
    result = generator.sample(
        {"chunks": [{"encoded_text": {"tokens": prompt}}]},
        num_samples=4,
        sampling_params={"max_tokens": 8, "temperature": 1.0, "seed": 7},
    )
    assert result.policy_segments[0].version == 0
    assert len(result.sequences) == 4
    samples = []
    for index, sequence in enumerate(result.sequences):
        assert len(sequence.tokens) == len(sequence.logprobs) >= 1
        assert sequence.stop_reason in ("STOP_REASON_STOP", "STOP_REASON_LENGTH")
        samples.append(rl_sample(prompt, sequence.tokens, sequence.logprobs, index - 1.5))

    scored = trainer.forward(samples=samples, loss={"type": "LOSS_TYPE_IMPORTANCE_SAMPLING"})
    for sample, output, sequence in zip(
        samples, scored.loss_fn_outputs, result.sequences, strict=True
    ):
        logprobs = output.tensors["logprobs"].data
        assert len(logprobs) == len(sample["model_input"]["chunks"][0]["encoded_text"]["tokens"])
        completion = logprobs[len(prompt) - 1 :]
        assert max(abs(a - b) for a, b in zip(completion, sequence.logprobs, strict=True)) <= 1e-4
        assert all(v == 0.0 for v in logprobs[: len(prompt) - 1])  # masked prompt positions

    # On-policy, the ratio is 1, so the IS loss is -sum of the included advantages.
    expected = -sum((i - 1.5) * len(s.tokens) for i, s in enumerate(result.sequences))
    trained = trainer.forward_backward(
        samples=samples, loss={"type": "LOSS_TYPE_IMPORTANCE_SAMPLING"}
    )
    assert trained.loss == pytest.approx(expected, abs=1e-3)
    assert trained.metrics["loss/ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    assert trainer.optim_step(adam_params={"learning_rate": 1e-2}).step == 1
    synced = trainer.weights_sync()
    assert synced.weights_version == 1
    state = session.retrieve().policy_state
    assert (state.trainer_step, state.target_weights_version, state.applied_weights_version) == (
        1,
        1,
        1,
    )
    assert state.pending_publish is False
    again = generator.sample(
        {"chunks": [{"encoded_text": {"tokens": prompt}}]},
        num_samples=2,
        sampling_params={"max_tokens": 4, "seed": 7},
    )
    assert [(s.start_token, s.version) for s in again.policy_segments] == [(0, 1)]
    session.stop()
    resources.stop()


def test_greedy_sampling_is_deterministic_and_prompt_logprobs_match_scoring(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 3})
    prompt = encode("<|im_start|>reverse abc:")
    model_input = {"chunks": [{"encoded_text": {"tokens": prompt}}]}
    first = session.generator.sample(
        model_input,
        num_samples=2,
        sampling_params={"max_tokens": 6, "temperature": 0},
        prompt_logprobs=True,
    )
    assert first.sequences[0].tokens == first.sequences[1].tokens
    assert first.prompt_logprobs[0] == 0.0 and len(first.prompt_logprobs) == len(prompt)
    scored = session.trainer.forward(
        samples=[sft_sample(prompt, 1)], loss={"type": "LOSS_TYPE_CROSS_ENTROPY"}
    )
    forward = scored.loss_fn_outputs[0].tensors["logprobs"].data
    assert max(abs(a - b) for a, b in zip(forward, first.prompt_logprobs[1:], strict=True)) < 1e-4
    logprobs = session.generator.compute_logprobs(model_input)
    assert logprobs == pytest.approx(first.prompt_logprobs, abs=1e-5)
    session.stop()
    resources.stop()


def test_stop_string_ends_generation_with_stop_reason(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 3})
    prompt = encode("<|im_start|>1 2 3 4 5 6")
    result = session.generator.sample(
        {"chunks": [{"encoded_text": {"tokens": prompt}}]},
        num_samples=3,
        sampling_params={"max_tokens": 30, "temperature": 1.0, "seed": 1, "stop": [" "]},
    )
    for sequence in result.sequences:
        text = TOKENIZER.decode(sequence.tokens)
        if sequence.stop_reason == "STOP_REASON_STOP" and sequence.tokens[-1] != EOS:
            assert text.endswith(" ") and " " not in text[:-1]
        else:
            assert " " not in text
    session.stop()
    resources.stop()


def test_replayed_idempotency_key_returns_the_same_operation_and_steps_once(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4})
    client = low_level(shared_server.base_url)
    ops = client.post_training.operations
    sid = session.session_id
    fb_key = str(uuid.uuid4())
    first_fb = ops.forward_backward(
        sid,
        idempotency_key=fb_key,
        loss={"type": "LOSS_TYPE_CROSS_ENTROPY"},
        samples=sft_batch(),
    )
    replay_fb = ops.forward_backward(
        sid,
        idempotency_key=fb_key,
        loss={"type": "LOSS_TYPE_CROSS_ENTROPY"},
        samples=sft_batch(),
    )
    assert replay_fb.id == first_fb.id
    key = str(uuid.uuid4())
    first = ops.optim_step(sid, idempotency_key=key, adam_params={"learning_rate": 1e-3})
    replay = ops.optim_step(sid, idempotency_key=key, adam_params={"learning_rate": 1e-3})
    assert replay.id == first.id
    done = session.trainer.optim_step()  # waits behind the first; proves only one step ran
    assert done.step == 2
    from together import UnprocessableEntityError

    with pytest.raises(UnprocessableEntityError):
        ops.optim_step(sid, idempotency_key=key, adam_params={"learning_rate": 5e-3})
    polled = ops.retrieve_optim_step(first.id, session_id=sid)
    assert polled.status == "TRAINING_OPERATION_STATUS_COMPLETED" and polled.output.step == 1
    session.stop()
    resources.stop()


def test_an_operation_on_a_stopped_session_fails_session_not_active(shared_server):
    resources, session = open_session(shared_server.base_url)
    sid = session.session_id
    session.stop()
    op = low_level(shared_server.base_url).post_training.operations.optim_step(
        sid, idempotency_key=str(uuid.uuid4())
    )
    assert op.status == "TRAINING_OPERATION_STATUS_FAILED"
    assert op.error.code == "TRAINING_OPERATION_ERROR_CODE_SESSION_NOT_ACTIVE"
    resources.stop()


def test_headers_auth_and_supported_models(shared_server):
    import httpx

    assert httpx.get(f"{shared_server.base_url}/v1/rl/supported-models").status_code == 401
    models = low_level(shared_server.base_url).post_training.supported_models.get()
    ids = [m.base_model for m in models.data]
    assert "posttrain/tiny-qwen3" in ids
    limits = models.data[0].compute_configs[0]
    assert limits.generator_config.context_length >= 128
    assert limits.trainer_config.lora.max_rank >= 8
    assert API_KEY
