"""The Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5 text dense and MoE; families.py's
LINEAR_ATTENTION_FAMILIES) at engine level: the trainer's logprobs are plain transformers' for
samples of different lengths in one padded batch, LoRA adapts every projection of the linear
attention layers as well as the gated attention and MLPs, the trainer's LoRA gradients equal
autograd through plain transformers with the adapters merged into its weights, LoRA training
lowers the loss, their MoE routers replay given routes, and sampling is refused with an error
that names the linear-attention layers (model/linear_attention.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from engine_calls import forward_backward, sample
from torch.func import functional_call
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent.parent / "model"))
import families  # noqa: E402

from posttrain.config import EngineConfig  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.errors import Unsupported  # noqa: E402
from posttrain.model import routing  # noqa: E402
from posttrain.types import (  # noqa: E402
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

CE = LossConfig(LossType.CROSS_ENTROPY)
FAMILIES = tuple(families.LINEAR_ATTENTION_FAMILIES)
LONG = (1, 40, 41, 42, 50, 60, 70, 80, 33, 34, 35, 36, 90, 91, 92, 20)
SHORT = (1, 44, 45, 46, 47, 48, 49)
RANK, ALPHA = 4, 8
# The linear-attention (Gated DeltaNet) projections of decoder layer 0, by family.
LINEAR_PROJECTIONS = {
    "qwen3_next": ("in_proj_qkvz", "in_proj_ba", "out_proj"),
    "qwen3_5_text": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
    "qwen3_5_moe_text": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("linear")
    return {f: families.build(f, root / f) for f in FAMILIES}


def engine_for(directory: Path) -> LocalEngine:
    engine = LocalEngine(EngineConfig(device="cpu", logprob_chunk_tokens=5), {"m": directory})
    engine.load_resource("r", "m", muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=RANK, alpha=ALPHA, seed=1))
    return engine


def ce_sample(tokens: tuple[int, ...]) -> TrainingSample:
    return TrainingSample(
        tokens=tokens[:-1],
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": (1.0,) * (len(tokens) - 1),
        },
    )


def plain_logprobs(model: torch.nn.Module, tokens: tuple[int, ...], **params) -> torch.Tensor:
    """log_softmax of plain transformers' logits at tokens[1:], `params` replacing weights."""
    inputs = torch.tensor([tokens[:-1]])
    logits = functional_call(model, params, (), {"input_ids": inputs}).logits[0]
    targets = torch.tensor(tokens[1:])[:, None]
    return torch.log_softmax(logits.float(), -1).gather(-1, targets)[:, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_logprobs_are_plain_transformers_for_a_padded_batch(family, family_dirs):
    plain = AutoModelForCausalLM.from_pretrained(family_dirs[family]).eval()
    engine = engine_for(family_dirs[family])
    request = ForwardBackwardRequest(
        (ce_sample(LONG), ce_sample(SHORT)), CE, True, return_loss_fn_outputs=True
    )
    got = forward_backward(engine, "r", "s", request).loss_fn_outputs
    with torch.no_grad():
        for tokens, row in zip((LONG, SHORT), got, strict=True):
            expected = plain_logprobs(plain, tokens)
            torch.testing.assert_close(torch.tensor(row), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_gradients_equal_autograd_through_plain_transformers(family, family_dirs):
    """After one step (adapters B nonzero), the trainer's gradients of every adapter (linear
    attention, gated attention, MLPs or experts, head) are those of plain transformers'
    forward with W + (alpha / rank) B A in place of each adapted weight."""
    engine = engine_for(family_dirs[family])
    step = OptimStepRequest(adam=AdamParams(learning_rate=1e-2))
    forward_backward(engine, "r", "s", ForwardBackwardRequest((ce_sample(LONG),), CE))
    engine.optim_step("r", "s", step)
    request = ForwardBackwardRequest((ce_sample(LONG), ce_sample(SHORT)), CE)
    forward_backward(engine, "r", "s", request)
    named = dict(engine._session("r", "s")[1].optimizer.named_params)
    got = {name: p.grad.clone() for name, p in named.items()}
    adapted = sorted({name.rsplit(".", 1)[0] for name in named})
    linear = LINEAR_PROJECTIONS[family]
    assert {f"model.layers.0.linear_attn.{p}" for p in linear} <= set(adapted)

    plain = AutoModelForCausalLM.from_pretrained(family_dirs[family]).eval()
    weights = dict(plain.named_parameters())
    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in named.items()}
    params = {}
    for module in adapted:
        base = f"{module}.weight" if f"{module}.weight" in weights else module
        merged = leaves[f"{module}.lora_B"] @ leaves[f"{module}.lora_A"]
        params[base] = weights[base].detach() + (ALPHA / RANK) * merged
    loss = -sum(plain_logprobs(plain, tokens, **params).sum() for tokens in (LONG, SHORT))
    loss.backward()
    for name, leaf in leaves.items():
        torch.testing.assert_close(got[name], leaf.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_training_lowers_the_loss(family, family_dirs):
    engine = engine_for(family_dirs[family])
    request = ForwardBackwardRequest((ce_sample(LONG),), CE)
    losses = []
    for _ in range(4):
        losses.append(forward_backward(engine, "r", "s", request).loss)
        engine.optim_step("r", "s", OptimStepRequest(adam=AdamParams(learning_rate=1e-2)))
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe_text"])
def test_moe_routers_capture_and_replay_routes(family, family_dirs):
    """Routes captured on one model's forward, replayed on another's (different router
    weights), give the first model's experts; without replay the second picks its own."""
    first = families.model(family, seed=0)
    second = families.model(family, seed=1)
    for model in (first, second):
        routing.install(model)
        assert routing.moe_shape(model) is not None
    tokens = torch.tensor([LONG])
    with torch.no_grad(), routing.capture() as routes:
        first(input_ids=tokens)
    with torch.no_grad(), routing.capture() as free:
        second(input_ids=tokens)
    assert any(not torch.equal(a, b) for a, b in zip(routes, free, strict=True))
    with torch.no_grad(), routing.replay(list(routes)), routing.capture() as replayed:
        second(input_ids=tokens)
    for a, b in zip(routes, replayed, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_is_refused_naming_the_linear_attention_layers(family, family_dirs):
    engine = engine_for(family_dirs[family])
    request = SampleRequest((SHORT,), 2, SamplingParams(max_tokens=4, seed=1))
    with pytest.raises(Unsupported, match="linear-attention"):
        sample(engine, "r", "s", request)
