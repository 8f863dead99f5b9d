"""Every decoder family (tests/unit/model/families.py) and both built-in models at engine level:
the trainer's logprobs are the model's own (log_softmax of plain transformers' logits), and
sampling works: the sampler's logprobs equal a forward_only of the sampled sequence, greedy
KV-cache decode equals full recompute, and a prefix-cache hit gives the same tokens (hybrids
with linear attention keep no prefix cache). The same
holds for a GPT-NeoX whose config.json carries fields the family ignores (IGNORED): the KV
cache and the memory estimate take their shapes from its modules."""

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

from posttrain.config import BUILTIN_MODELS, EngineConfig  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.engine.memory import estimate  # noqa: E402
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

CE = LossConfig(LossType.CROSS_ENTROPY)
TOKENS = [1, 40, 41, 42, 50, 60, 70, 80, 33, 34, 35, 36, 90, 91, 92, 20]
# GPT-NeoX with num_key_value_heads and head_dim in its config.json, which it ignores.
IGNORED = "gpt_neox+ignored_fields"
# The random-init families, IGNORED, then the built-in models (pretrained, dense and MoE).
MODELS = [*families.FAMILIES, IGNORED, *BUILTIN_MODELS]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    extra = families.IGNORED_FIELDS["gpt_neox"]
    return {
        **{f: families.build(f, root / f) for f in families.FAMILIES},
        IGNORED: families.build("gpt_neox", root / IGNORED, extra=extra),
        **BUILTIN_MODELS,
    }


def engine_for(directory: Path) -> LocalEngine:
    engine = LocalEngine(EngineConfig(device="cpu", logprob_chunk_tokens=5), {"m": directory})
    engine.load_resource("r", "m", muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=4, alpha=8, seed=1))
    return engine


def trainer_logprobs(engine: LocalEngine, tokens: list[int]) -> list[float]:
    sample_ = TrainingSample(
        tokens=tuple(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": (1.0,) * (len(tokens) - 1),
        },
    )
    request = ForwardBackwardRequest((sample_,), CE, forward_only=True, return_loss_fn_outputs=True)
    (row,) = forward_backward(engine, "r", "s", request).loss_fn_outputs
    return row


@pytest.mark.parametrize("family", MODELS)
def test_trainer_logprobs_are_the_models_own(family, family_dirs):
    plain = AutoModelForCausalLM.from_pretrained(family_dirs[family])
    with torch.no_grad():
        logits = plain(input_ids=torch.tensor([TOKENS[:-1]])).logits[0]
    expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(TOKENS[1:])[:, None])
    got = torch.tensor(trainer_logprobs(engine_for(family_dirs[family]), TOKENS))
    torch.testing.assert_close(got, expected[:, 0], atol=1e-5, rtol=0)


PROMPT = (1, 40, 41, 42, 50, 60, 70, 80, 33)  # longer than the sliding windows


@pytest.mark.parametrize("family", MODELS)
def test_sampler_and_prompt_logprobs_equal_forward_only_for_any_settings(family, family_dirs):
    engine = engine_for(family_dirs[family])
    for params in (
        SamplingParams(max_tokens=10, temperature=1.0, seed=3),
        SamplingParams(max_tokens=10, temperature=0.7, top_k=8, top_p=0.9, seed=4),
    ):
        request = SampleRequest((PROMPT,), 3, params, prompt_logprobs=True)
        (result,) = sample(engine, "r", "s", request)
        prompt_scored = trainer_logprobs(engine, list(PROMPT))
        torch.testing.assert_close(
            torch.tensor(result.prompt_logprobs[1:]), torch.tensor(prompt_scored), atol=1e-4, rtol=0
        )
        for sequence in result.sequences:
            scored = trainer_logprobs(engine, [*PROMPT, *sequence.tokens])
            torch.testing.assert_close(
                torch.tensor(sequence.logprobs),
                torch.tensor(scored[-len(sequence.tokens) :]),
                atol=1e-4,
                rtol=0,
            )


@pytest.mark.parametrize("family", MODELS)
def test_greedy_decode_equals_full_recompute_and_a_prefix_cache_hit_the_same(family, family_dirs):
    plain = AutoModelForCausalLM.from_pretrained(family_dirs[family])
    tokens = list(PROMPT)
    with torch.no_grad():
        for _ in range(10):
            tokens.append(int(plain(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    expected = tokens[len(PROMPT) :]
    engine = engine_for(family_dirs[family])
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    first, second = (
        sample(engine, "r", "s", SampleRequest((PROMPT,), 2, greedy))[0] for _ in range(2)
    )
    eos = 0
    for result in (first, second):
        for sequence in result.sequences:
            cut = expected.index(eos) + 1 if eos in expected else len(expected)
            assert sequence.tokens == expected[:cut]
    hits = second.sequences[0].prompt_cache_hit_tokens
    # A recurrent state exists only at a prompt's end: hybrids recompute every prompt.
    assert hits == 0 if family in families.LINEAR_ATTENTION_FAMILIES else hits > 0


def test_kv_shapes_come_from_the_modules_not_config_fields_the_family_ignores(family_dirs):
    directory = family_dirs[IGNORED]
    saved = json.loads((directory / "config.json").read_text())
    extra = families.IGNORED_FIELDS["gpt_neox"]
    assert {k: saved[k] for k in extra} == extra  # the fields really travel in the directory
    # What GPT-NeoX builds: one KV head per query head, hidden / heads wide.
    built = KVShape(num_layers=2, num_kv_heads=families.NUM_HEADS, head_dim=families.TESTS.head_dim)
    assert (saved["num_key_value_heads"], saved["head_dim"]) != (built.num_kv_heads, built.head_dim)
    loaded = engine_for(directory)._resource("r").loaded
    assert loaded.kv == built
    assert path_kv_shape(directory) == built  # a meta build: the replicas' estimate
    shape = estimate.model_shape(loaded.model.config, loaded.kv, 4)
    hidden = loaded.model.config.hidden_size
    assert (shape.layers, shape.query_width, shape.kv_width) == (2, hidden, hidden)
