"""`posttrain serve --model DIR` end to end through the SDK for a representative set of decoder
families (random-init, tests/unit/model/families.py; every family is covered at engine level in
tests/unit/engine/test_family_*.py), one server for all: the server's logprobs are plain
transformers', LoRA and full-weight training lower the loss, every weights-sync mode serves the
trained weights (the sampler's logprobs equal forward_only's), a training checkpoint resumes
with identical logprobs, a full-weight export is the trained model, and the sampling
parameters hold."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import ServerProcess
from helpers import API_KEY, sft_sample
from together import Together
from together.post_training import ModelResourcesClient, download_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "model"))
import families  # noqa: E402

# Every family serves LoRA sessions through the SDK; the full-weight and sampling-parameter
# tests take the common one, the eager soft-capped one, NeoX's fused qkv, Granite's logit
# scaling, Phi-3's fused qkv and gate_up, and the mixture of experts.
ALL = tuple(families.FAMILIES)
SERVED = ("llama", "gemma2", "gpt_neox", "granite", "phi3", "qwen3_moe")
SYNC_MODES = (
    "WEIGHT_SYNC_TYPE_SYNCHRONOUS",
    "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH",
    "WEIGHT_SYNC_TYPE_PIPELINE",
)
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
FAST = 0.05
TOKENS = [1, 40, 41, 42, 50, 60, 70, 80, 33, 34, 35, 36, 90, 91, 92, 20]
PROMPT = TOKENS[:9]


@pytest.fixture(scope="module")
def family_server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("families")
    dirs = {f: families.build(f, root / "models" / f) for f in ALL}
    model_args = [arg for d in dirs.values() for arg in ("--model", str(d))]
    proc = ServerProcess.started(root, "--poll-hold-seconds", "0", *model_args)
    yield proc, dirs
    proc.stop()


def model_input(tokens: list[int]) -> dict:
    return {"chunks": [{"encoded_text": {"tokens": tokens}}]}


def scored(session, tokens: list[int], prompt_len: int) -> tuple[float, list[float]]:
    result = session.trainer.forward(
        samples=[sft_sample(tokens, prompt_len)], loss=CE, interval=FAST
    )
    return result.loss, result.loss_fn_outputs[0].tensors["logprobs"].data


def assert_sampler_logprobs_are_forward_only(session, sequences) -> None:
    for sequence in sequences:
        assert len(sequence.tokens) == len(sequence.logprobs) >= 1
        _, forward = scored(session, PROMPT + sequence.tokens, len(PROMPT))
        forward = forward[len(PROMPT) - 1 :]
        diffs = [abs(a - b) for a, b in zip(forward, sequence.logprobs, strict=True)]
        assert max(diffs) <= 1e-4, diffs


@pytest.mark.parametrize("family", ALL)
def test_a_family_trains_scores_and_samples_through_the_sdk(family, family_server):
    server, dirs = family_server
    resources = ModelResourcesClient.create(
        base_url=server.base_url, api_key=API_KEY, base_model=family, interval=0.2
    )
    session = resources.create_session(interval=0.2, lora_config={"rank": 4, "seed": 5})

    plain = AutoModelForCausalLM.from_pretrained(dirs[family])
    with torch.no_grad():
        logits = plain(input_ids=torch.tensor([TOKENS[:-1]])).logits[0]
    expected = torch.log_softmax(logits.float(), -1)
    expected = expected.gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
    before, logprobs = scored(session, TOKENS, 1)
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=0)

    for _ in range(3):
        session.trainer.forward_backward(samples=[sft_sample(TOKENS, 1)], loss=CE, interval=FAST)
        session.trainer.optim_step(adam_params={"learning_rate": 2e-2}, interval=FAST)
    after, _ = scored(session, TOKENS, 1)
    assert after < before

    session.trainer.weights_sync(interval=FAST)  # the generator serves the trained weights
    params = {"max_tokens": 8, "temperature": 1.0, "seed": 4}
    result = session.generator.sample(
        model_input(PROMPT), num_samples=2, sampling_params=params, interval=FAST
    )
    assert_sampler_logprobs_are_forward_only(session, result.sequences)
    for step, mode in enumerate(SYNC_MODES[1:], start=4):  # the deferred modes serve them too
        train_step(session)
        session.trainer.weights_sync(weight_sync_type=mode, interval=FAST)
        result = session.generator.sample(
            model_input(PROMPT), num_samples=2, sampling_params=params, interval=FAST
        )
        assert [(p.start_token, p.version) for p in result.policy_segments] == [(0, step)]
        assert_sampler_logprobs_are_forward_only(session, result.sequences)
    session.stop()
    resources.stop()


def train_step(session) -> None:
    session.trainer.forward_backward(samples=[sft_sample(TOKENS, 1)], loss=CE, interval=FAST)
    session.trainer.optim_step(adam_params={"learning_rate": 1e-2}, interval=FAST)


@pytest.mark.parametrize("family", SERVED)
def test_full_weights_train_sync_in_every_mode_export_and_resume_from_a_checkpoint(
    family, family_server, tmp_path
):
    server, _ = family_server
    resources = ModelResourcesClient.create(
        base_url=server.base_url,
        api_key=API_KEY,
        base_model=family,
        lora_enabled=False,
        interval=0.2,
    )
    session = resources.create_session(interval=0.2)
    before, _ = scored(session, TOKENS, 1)
    for _ in range(2):
        train_step(session)
    after, at_checkpoint = scored(session, TOKENS, 1)
    assert after < before
    training = session.create_training_checkpoint()
    inference = session.create_inference_checkpoint()
    sdk = Together(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    download_checkpoint(sdk, inference.id, output_dir=tmp_path)  # MERGED: the trained model
    merged = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        logits = merged(input_ids=torch.tensor([TOKENS[:-1]])).logits[0]
    exported = torch.log_softmax(logits.float(), -1)
    exported = exported.gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
    torch.testing.assert_close(exported, torch.tensor(at_checkpoint), atol=1e-5, rtol=0)

    params = {"max_tokens": 6, "temperature": 1.0, "seed": 3}
    for step, mode in enumerate(SYNC_MODES, start=3):
        train_step(session)  # new weights for each mode to serve
        synced = session.trainer.weights_sync(weight_sync_type=mode, interval=FAST)
        assert synced.weights_version == step
        result = session.generator.sample(
            model_input(PROMPT), num_samples=2, sampling_params=params, interval=FAST
        )
        assert [(p.start_token, p.version) for p in result.policy_segments] == [(0, step)]
        assert_sampler_logprobs_are_forward_only(session, result.sequences)
    session.stop()  # a full-weight resource hosts one session at a time

    resumed = resources.create_session(resume_from_checkpoint_id=training.id, interval=0.2)
    assert resumed.retrieve().step == 2
    assert scored(resumed, TOKENS, 1)[1] == at_checkpoint
    resumed.stop()
    resources.stop()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_sampling_parameters_hold_through_the_sdk(family, family_server):
    server, dirs = family_server
    resources = ModelResourcesClient.create(
        base_url=server.base_url, api_key=API_KEY, base_model=family, interval=0.2
    )
    session = resources.create_session(interval=0.2, lora_config={"rank": 4, "seed": 5})

    def sampled(num_samples: int = 1, **params: object) -> list[list[int]]:
        result = session.generator.sample(
            model_input(PROMPT),
            num_samples=num_samples,
            sampling_params={"max_tokens": 6, **params},
            interval=FAST,
        )
        return [sequence.tokens for sequence in result.sequences]

    (greedy,) = sampled(temperature=0.0)
    assert sampled(2, temperature=1.0, top_k=1, seed=1) == [greedy, greedy]
    assert sampled(2, temperature=1.0, top_p=1e-6, seed=1) == [greedy, greedy]
    seeded = sampled(3, temperature=1.0, seed=7)
    assert sampled(3, temperature=1.0, seed=7) == seeded
    assert sampled(3, temperature=1.0, seed=8) != seeded

    tokenizer = AutoTokenizer.from_pretrained(dirs[family])
    stop = next(t for t in (tokenizer.decode(greedy[i : i + 1]) for i in (2, 3)) if t)
    cut = next(n for n in range(1, len(greedy) + 1) if stop in tokenizer.decode(greedy[:n]))
    assert sampled(temperature=0.0, stop=[stop]) == [greedy[:cut]]

    result = session.generator.sample(
        model_input(PROMPT),
        sampling_params={"max_tokens": 1},
        prompt_logprobs=True,
        topk_prompt_logprobs=3,
        interval=FAST,
    )
    plain = AutoModelForCausalLM.from_pretrained(dirs[family])
    with torch.no_grad():
        expected_TV = torch.log_softmax(plain(input_ids=torch.tensor([PROMPT])).logits[0], -1)
    expected = expected_TV[:-1].gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    assert result.prompt_logprobs[0] == 0.0
    torch.testing.assert_close(
        torch.tensor(result.prompt_logprobs[1:]), expected, atol=1e-5, rtol=0
    )
    topk = result.topk_prompt_logprobs
    for position in range(1, len(PROMPT)):
        reference = torch.topk(expected_TV[position - 1], 3)
        torch.testing.assert_close(
            torch.tensor(topk[position].logprobs), reference.values, atol=1e-5, rtol=0
        )
    session.stop()
    resources.stop()
