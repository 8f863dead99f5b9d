"""`posttrain serve --model DIR` end to end through the SDK for a few decoder families
(random-init, tests/unit/model/families.py): the server's logprobs are plain transformers',
LoRA training lowers the loss, and the sampler's logprobs equal forward_only's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import ServerProcess
from helpers import API_KEY, sft_sample
from together.post_training import ModelResourcesClient
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "model"))
import families  # noqa: E402

SERVED = ("llama", "gemma2", "gpt_neox")  # the common one, the eager soft-capped one, NeoX
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
FAST = 0.05
TOKENS = [1, 40, 41, 42, 50, 60, 70, 80, 33, 34, 35, 36, 90, 91, 92, 20]
PROMPT = TOKENS[:9]


@pytest.fixture(scope="module")
def family_server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("families")
    dirs = {f: families.build(f, root / "models" / f) for f in SERVED}
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


@pytest.mark.parametrize("family", SERVED)
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
    for sequence in result.sequences:
        assert len(sequence.tokens) == len(sequence.logprobs) >= 1
        _, forward = scored(session, PROMPT + sequence.tokens, len(PROMPT))
        forward = forward[len(PROMPT) - 1 :]
        diffs = [abs(a - b) for a, b in zip(forward, sequence.logprobs, strict=True)]
        assert max(diffs) <= 1e-4, diffs
    session.stop()
    resources.stop()
