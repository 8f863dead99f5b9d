"""Long sequences (issue 44) on two-layer random-init models whose config allows 16k positions,
against plain transformers on the same weights: an 8k-token sample's logprobs through the
engine's forward-backward equal transformers' log-softmax (Qwen3 and Llama), with decoder layers
checkpointed and not (same loss and gradients); a prompt longer than one prefill pass (its
second pass attends over 8k cached positions as a CausalChunk) gets prompt logprobs equal to a
forward pass's, and a later prompt that extends it is served from the prefix cache whole."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from engine_calls import forward_backward, sample
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent.parent / "model"))
import families  # noqa: E402

from posttrain.config import EngineConfig  # noqa: E402
from posttrain.engine.generate.prefill import PREFILL_TOKENS_PER_PASS  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.types import (  # noqa: E402
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    SampleRequest,
    SamplingParams,
    TrainingSample,
)

CE = LossConfig(LossType.CROSS_ENTROPY)
LONG = families.Size(max_position_embeddings=16384)
TRAIN_TOKENS = 8192
PROMPT_TOKENS = PREFILL_TOKENS_PER_PASS + 1000  # two prefill passes, the second over a cache


def tokens(count: int, offset: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(offset)
    return torch.randint(3, families.VOCAB, (count,), generator=generator).tolist()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def family_dir(request, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("long") / request.param
    return families.build(request.param, directory, size=LONG)


def plain_logprobs(directory: Path, ids: list[int]) -> torch.Tensor:
    """Transformers' own float32 log-softmax of each next token, [T - 1]."""
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


def engine_for(directory: Path, checkpointing: str) -> LocalEngine:
    config = EngineConfig(device="cpu", activation_checkpointing=checkpointing)
    engine = LocalEngine(config, {"m": directory})
    engine.load_resource("r", "m", muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=4, alpha=8, seed=1))
    return engine


def test_a_long_sample_trains_on_transformers_logprobs_checkpointed_or_not(family_dir):
    ids = tokens(TRAIN_TOKENS + 1)
    inputs = {"target_tokens": tuple(map(float, ids[1:])), "weights": (1.0,) * TRAIN_TOKENS}
    request = ForwardBackwardRequest(
        (TrainingSample(tuple(ids[:-1]), inputs),), CE, return_loss_fn_outputs=True
    )
    expected = plain_logprobs(family_dir, ids)  # a new adapter leaves the model as it was
    modes = ["on", "off"] if family_dir.name == "qwen3" else ["on"]
    losses, grads = {}, {}
    for mode in modes:
        engine = engine_for(family_dir, mode)
        result = forward_backward(engine, "r", "s", request)
        assert result.loss_fn_outputs is not None
        (logprobs,) = result.loss_fn_outputs
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=0)
        losses[mode] = result.loss
        optimizer = engine._session("r", "s")[1].optimizer
        grads[mode] = {name: g.clone() for name, g in optimizer.full_gradients().items()}
    if "off" in modes:
        assert losses["on"] == pytest.approx(losses["off"], rel=1e-6)
        for name, grad in grads["off"].items():
            torch.testing.assert_close(grads["on"][name], grad, atol=1e-6, rtol=1e-5)


def test_a_long_prompts_logprobs_equal_a_forward_pass_and_its_prefix_is_cached(tmp_path):
    directory = families.build("qwen3", tmp_path / "qwen3", size=LONG)
    engine = engine_for(directory, "auto")
    prompt = tuple(tokens(PROMPT_TOKENS, offset=1))
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    request = SampleRequest((prompt,), 1, greedy, prompt_logprobs=True)
    (result,) = sample(engine, "r", "s", request)
    expected = plain_logprobs(directory, list(prompt))
    assert len(result.prompt_logprobs) == len(prompt)
    torch.testing.assert_close(
        torch.tensor(result.prompt_logprobs[1:]), expected, atol=1e-5, rtol=0
    )
    # The whole long prompt went into the prefix cache: a prompt that extends it runs only
    # its own tokens, and draws what a forward pass over all of them gives.
    longer = prompt + tuple(tokens(20, offset=2))
    (extended,) = sample(engine, "r", "s", SampleRequest((longer,), 1, greedy))
    assert extended.sequences[0].prompt_cache_hit_tokens == len(prompt)
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
    with torch.no_grad():
        last = model(input_ids=torch.tensor([longer])).logits[0, -1]
    assert extended.sequences[0].tokens == [int(last.argmax())]
