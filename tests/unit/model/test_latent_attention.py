"""DeepSeek-V3's multi-head latent attention in posttrain's caches (latent_attention.py):
a position costs (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes, what the architecture
promises, and decoding from the latent cache, with a trained LoRA adapter on every latent
projection, gives at every step the logprob a full recompute (the trainer's forward) gives,
whether decode passes attend in latent space or over keys and values expanded per row. The
other families with the same attention (DeepSeek-V2's complex rope and query without a latent,
GLM-4 MoE Lite, MiniCPM3, Youtu, AXK1, LongCat-Flash's scaled latents) cache their latents too,
score as plain transformers does and decode as a full recompute scores."""

from __future__ import annotations

import sys
from pathlib import Path

import families
import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.config import EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.model.attention_kinds import latent_attention
from posttrain.model.attention_kinds.latent_attention import latent_attention_modules
from posttrain.model.loader import path_kv_shape
from posttrain.types import (
    AdamParams,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    OptimStepRequest,
    SampleRequest,
    SamplingParams,
    TrainingSample,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
import test_joining_pass as joining  # noqa: E402
from engine_calls import forward_backward, sample  # noqa: E402

FAMILY = "deepseek_v3"
CE = LossConfig(LossType.CROSS_ENTROPY)
TOKENS = (1, 40, 41, 42, 50, 60, 70, 80, 33, 34, 35, 36)
PROMPTS = ((1, 40, 41, 42, 50, 60, 70), (1, 33, 34))
LATENT_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def engine_for(directory: Path) -> LocalEngine:
    engine = LocalEngine(EngineConfig(device="cpu"), {"m": directory})
    engine.load_resource("r", "m", muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=4, alpha=8, seed=1))
    return engine


def ce_sample(tokens: tuple[int, ...]) -> TrainingSample:
    return TrainingSample(
        tokens=tokens[:-1],
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": (1.0,) * (len(tokens) - 1),
        },
    )


def scored(engine: LocalEngine, tokens: tuple[int, ...]) -> list[float]:
    request = ForwardBackwardRequest((ce_sample(tokens),), CE, True, return_loss_fn_outputs=True)
    (row,) = forward_backward(engine, "r", "s", request).loss_fn_outputs
    return row


def test_a_position_costs_the_latent_and_the_rope_key(tmp_path):
    directory = families.build(FAMILY, tmp_path / FAMILY)
    loaded = engine_for(directory)._resource("r").loaded
    config = loaded.model.config
    kv = loaded.kv
    assert path_kv_shape(directory) == kv  # a meta build: the replicas' estimate
    dtype_bytes = 4  # float32
    per_position = kv.num_layers * 2 * kv.num_kv_heads * kv.head_dim * dtype_bytes
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    assert per_position == latent * config.num_hidden_layers * dtype_bytes
    # Full keys and values would cost heads x (qk_head_dim + v_head_dim) numbers a layer.
    full = config.num_attention_heads * (config.qk_head_dim + config.v_head_dim)
    assert latent < full
    assert len(latent_attention_modules(loaded.model)) == config.num_hidden_layers


# 15: an odd latent width (15 + 8), which the cache's two slots hold zero-padded. Decode
# passes attend in latent space (absorbed) or over keys and values expanded per row.
@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
@pytest.mark.parametrize("kv_lora_rank", [16, 15])
def test_decode_from_the_latent_cache_equals_a_full_recompute_at_every_step(
    tmp_path, monkeypatch, kv_lora_rank, absorbed
):
    monkeypatch.setattr(latent_attention, "ABSORBED_DECODE", absorbed)
    absorbed_passes = []
    spied = latent_attention._absorbed

    def spy(*args, **kwargs):
        absorbed_passes.append(1)
        return spied(*args, **kwargs)

    monkeypatch.setattr(latent_attention, "_absorbed", spy)
    directory = families.build(FAMILY, tmp_path / FAMILY, extra={"kv_lora_rank": kv_lora_rank})
    engine = engine_for(directory)
    base = scored(engine, TOKENS)
    train(engine)
    names = [name for name, _ in engine._session("r", "s")[1].optimizer.named_params]
    for projection in LATENT_PROJECTIONS:
        assert any(f".self_attn.{projection}.lora_B" in name for name in names), projection
    assert max(abs(a - b) for a, b in zip(scored(engine, TOKENS), base, strict=True)) > 1e-2

    worst = decoded_against_recomputed(engine)
    print(f"latent-cache decode vs full recompute: max |logprob difference| {worst:.2e}")
    assert worst <= 1e-5
    assert bool(absorbed_passes) == absorbed


def train(engine: LocalEngine, steps: int = 3) -> None:
    for _ in range(steps):
        forward_backward(engine, "r", "s", ForwardBackwardRequest((ce_sample(TOKENS),), CE))
        engine.optim_step("r", "s", OptimStepRequest(adam=AdamParams(learning_rate=2e-2)))
    engine.publish("r", "s", version=1)


def decoded_against_recomputed(engine: LocalEngine) -> float:
    """The largest |sampler logprob - full recompute's| over 3 samples of each prompt."""
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, stop_at_eos=False)
    results = sample(engine, "r", "s", SampleRequest(PROMPTS, 3, params))
    worst = 0.0
    for result, prompt in zip(results, PROMPTS, strict=True):
        for sequence in result.sequences:
            recomputed = scored(engine, (*prompt, *sequence.tokens))[len(prompt) - 1 :]
            steps = zip(sequence.logprobs, recomputed, strict=True)
            worst = max(worst, *(abs(a - b) for a, b in steps))
    return worst


@pytest.mark.parametrize("family", families.LATENT_ATTENTION_FAMILIES)
def test_the_other_latent_attention_families_are_exact_and_decode_from_their_latents(
    tmp_path, family
):
    directory = families.build(family, tmp_path / family)
    engine = engine_for(directory)
    loaded = engine._resource("r").loaded
    config = loaded.model.config
    modules = latent_attention_modules(loaded.model)
    assert modules and all("forward" in vars(m) for m in modules)
    assert loaded.kv.num_kv_heads * 2 * loaded.kv.head_dim in {
        config.kv_lora_rank + config.qk_rope_head_dim + pad for pad in (0, 1)
    }
    plain = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        logits = plain(input_ids=torch.tensor([TOKENS])).logits[0, :-1]
    expected = torch.log_softmax(logits.double(), -1)[range(len(TOKENS) - 1), TOKENS[1:]]
    step_0 = torch.tensor(scored(engine, TOKENS), dtype=torch.float64)
    assert torch.allclose(step_0, expected, atol=1e-5, rtol=0)
    train(engine)
    names = [name for name, _ in engine._session("r", "s")[1].optimizer.named_params]
    assert any(".kv_b_proj.lora_B" in name for name in names)
    trained = torch.tensor(scored(engine, TOKENS), dtype=torch.float64)
    assert (trained - step_0).abs().max() > 1e-2
    worst = decoded_against_recomputed(engine)
    print(f"{family}: latent-cache decode vs full recompute: max |difference| {worst:.2e}")
    assert worst <= 1e-5


def test_joins_in_a_decode_pass_get_what_they_get_alone_with_decode_rows_expanded(
    tmp_path, monkeypatch
):
    """test_joining_pass.py's check on DeepSeek-V3 (which runs the decode rows of a joining
    pass in latent space) with them expanded per row instead."""
    monkeypatch.setattr(latent_attention, "ABSORBED_DECODE", False)
    joining.test_joins_inside_the_decode_pass_get_what_they_get_alone_on_every_family(
        tmp_path, monkeypatch, FAMILY
    )
