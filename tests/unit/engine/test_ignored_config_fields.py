"""A model whose config.json carries fields its family ignores is served by the shapes of its
modules: a GPT-NeoX directory with `num_key_value_heads` and `head_dim` (GPT-NeoX attention has
one KV head per query head, hidden / heads wide) samples, its sampler logprobs equal a
forward_only of the sampled tokens, greedy decode equals plain transformers' full recompute,
and the memory estimate counts the KV the model really writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from engine_calls import forward_backward, sample
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent.parent / "model"))
import families  # noqa: E402

from posttrain.config import EngineConfig  # noqa: E402
from posttrain.engine import memory_estimate as estimate  # noqa: E402
from posttrain.engine.local import LocalEngine  # noqa: E402
from posttrain.model.kv_shape import KVShape  # noqa: E402
from posttrain.model.loader import path_kv_shape  # noqa: E402
from posttrain.types import (  # noqa: E402
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    SampleRequest,
    SamplingParams,
    TrainingSample,
)

FAMILY = "gpt_neox"
PROMPT = (1, 40, 41, 42, 50, 60, 70, 80, 33)
# What GPT-NeoX builds from families.config: 4 query heads of 64 / 4, one KV head for each.
BUILT = KVShape(num_layers=2, num_kv_heads=families.NUM_HEADS, head_dim=families.TESTS.head_dim)


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> Path:
    extra = families.IGNORED_FIELDS[FAMILY]
    built = families.build(FAMILY, tmp_path_factory.mktemp(FAMILY), extra=extra)
    saved = json.loads((built / "config.json").read_text())
    # The fields really travel in the directory and really disagree with the modules.
    assert {k: saved[k] for k in extra} == extra
    assert (saved["num_key_value_heads"], saved["head_dim"]) != (BUILT.num_kv_heads, BUILT.head_dim)
    return built


@pytest.fixture(scope="module")
def engine(directory) -> LocalEngine:
    engine = LocalEngine(EngineConfig(device="cpu", logprob_chunk_tokens=5), {"m": directory})
    engine.load_resource("r", "m", muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=4, alpha=8, seed=1))
    return engine


def scored(engine: LocalEngine, tokens: list[int]) -> list[float]:
    """forward_only logprobs of tokens[1:] given their prefixes."""
    training_sample = TrainingSample(
        tokens=tuple(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": (1.0,) * (len(tokens) - 1),
        },
    )
    request = ForwardBackwardRequest(
        (training_sample,),
        LossConfig(LossType.CROSS_ENTROPY),
        forward_only=True,
        return_loss_fn_outputs=True,
    )
    (row,) = forward_backward(engine, "r", "s", request).loss_fn_outputs
    return row


def test_kv_shape_comes_from_the_modules_not_the_ignored_fields(engine, directory):
    assert engine._resource("r").loaded.kv == BUILT
    assert path_kv_shape(directory) == BUILT  # the replicas' estimate, from a meta build


def test_sampler_logprobs_equal_forward_only_despite_ignored_fields(engine):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    (result,) = sample(engine, "r", "s", SampleRequest((PROMPT,), 3, params))
    assert len(result.sequences) == 3
    for sequence in result.sequences:
        assert sequence.tokens
        forward = scored(engine, [*PROMPT, *sequence.tokens])
        torch.testing.assert_close(
            torch.tensor(sequence.logprobs),
            torch.tensor(forward[-len(sequence.tokens) :]),
            atol=1e-4,
            rtol=0,
        )


def test_greedy_decode_equals_full_recompute_despite_ignored_fields(engine, directory):
    plain = AutoModelForCausalLM.from_pretrained(directory)
    tokens = list(PROMPT)
    with torch.no_grad():
        for _ in range(10):
            tokens.append(int(plain(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    expected = tokens[len(PROMPT) :]
    eos = 0
    expected = expected[: expected.index(eos) + 1] if eos in expected else expected
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    for _ in range(2):  # the second from the prefix cache
        (result,) = sample(engine, "r", "s", SampleRequest((PROMPT,), 2, greedy))
        assert [s.tokens for s in result.sequences] == [expected, expected]
    assert result.sequences[0].prompt_cache_hit_tokens > 0


def test_memory_estimate_counts_the_kv_the_model_writes(engine):
    loaded = engine._resource("r").loaded
    shape = estimate.model_shape(loaded.model.config, loaded.kv, 4)
    hidden = loaded.model.config.hidden_size
    # One KV head per query head: keys and values as wide as the hidden state.
    assert (shape.layers, shape.query_width, shape.kv_width) == (2, hidden, hidden)
