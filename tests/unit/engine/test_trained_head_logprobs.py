"""A trained LoRA head's gradients formed in forward from per-token loss gradients
(engine/train/logprobs.py _TrainedHeadLogprobs, engine/train/token_gradients.py): equal to autograd
on the full log-softmax, for a right and a wrong prediction (recomputed), and taken by every
separable loss of a one-session forward-backward."""

from __future__ import annotations

import pytest
import torch
from engine_calls import forward_backward

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.train import logprobs
from posttrain.engine.train.batching import pack
from posttrain.engine.train.losses import LOSSES
from posttrain.engine.train.token_gradients import is_separable
from posttrain.model.lora import AdapterWeights, LoraLinear
from posttrain.types import (
    CispoParams,
    DppoParams,
    DroParams,
    ForwardBackwardRequest,
    GrpoAggregation,
    GrpoParams,
    GrpoRatioType,
    LoraConfig,
    LossConfig,
    LossType,
    PpoParams,
    TrainingSample,
)


def lora_head(scale: float = 2.0) -> LoraLinear:
    head = LoraLinear(torch.nn.Linear(8, 11, bias=False).requires_grad_(False))
    lora_A = torch.nn.Parameter(torch.randn(3, 8) * 0.3)
    lora_B = torch.nn.Parameter(torch.randn(11, 3) * 0.3)
    head.adapters["a"] = AdapterWeights(lora_A, lora_B, scale, 0.0)
    head.routing = [("a", None)]
    return head


@pytest.mark.parametrize("predicted_right", [True, False])
def test_values_and_gradients_equal_autograd_on_a_full_log_softmax(predicted_right):
    torch.manual_seed(0)
    head = lora_head()
    adapter = head.adapters["a"]
    hidden = torch.randn(3, 7, 8, requires_grad=True)
    targets = torch.randint(0, 11, (3, 7))
    upstream = torch.randn(3, 7)
    inputs = [hidden, adapter.lora_A, adapter.lora_B]

    want = torch.log_softmax(head(hidden), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    want_grads = torch.autograd.grad((want * upstream).sum(), inputs)

    def gradient(start: int, logprobs_BC: torch.Tensor) -> torch.Tensor:
        given = upstream[:, start : start + logprobs_BC.shape[1]]
        return given if predicted_right else given + 1.0

    before = logprobs.chunk_paths.copy()
    got = logprobs.target_logprobs(head, hidden, targets, chunk_tokens=6, gradient=gradient)
    got_grads = torch.autograd.grad((got * upstream).sum(), inputs)
    paths = logprobs.chunk_paths - before

    torch.testing.assert_close(got, want)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad)
    chunks = 4  # 7 positions, 6 // 3 rows = 2 per chunk
    assert paths["trained"] == chunks
    assert paths["recomputed"] == (0 if predicted_right else chunks)
    assert paths["checkpoint"] == 0


def test_several_adapters_or_dropout_keep_the_recomputing_path():
    head = lora_head()
    head.adapters["b"] = head.adapters["a"]
    head.routing = [("a", torch.tensor([0])), ("b", torch.tensor([1]))]
    hidden = torch.randn(2, 4, 8, requires_grad=True)
    before = logprobs.chunk_paths.copy()
    logprobs.target_logprobs(
        head, hidden, torch.zeros(2, 4, dtype=torch.int64), chunk_tokens=8,
        gradient=lambda start, x: torch.ones_like(x),
    )  # fmt: skip
    assert (logprobs.chunk_paths - before)["checkpoint"] == 1


def sample(rng: torch.Generator, length: int, prompt: int) -> TrainingSample:
    tokens = torch.randint(3, 99, (length + 1,), generator=rng).tolist()
    completion = length - prompt
    sampler = (-torch.rand(completion, generator=rng) * 3 - 1).tolist()
    advantage = float(torch.rand((), generator=rng) * 2 - 1)
    inputs = {
        "target_tokens": tuple(float(t) for t in tokens[1:]),
        "weights": (0.0,) * prompt + (1.0,) * completion,
        "logprobs": (0.0,) * prompt + tuple(sampler),
        "advantages": (0.0,) * prompt + (advantage,) * completion,
        "reference_logprobs": (0.0,) * prompt + tuple(x - 0.1 for x in sampler),
    }
    return TrainingSample(tuple(tokens[:-1]), inputs)


LOSS_CASES = [
    LossConfig(LossType.CROSS_ENTROPY),
    LossConfig(LossType.IMPORTANCE_SAMPLING),
    LossConfig(LossType.PPO, PpoParams()),
    LossConfig(LossType.CISPO, CispoParams()),
    LossConfig(LossType.DRO, DroParams(beta=0.3)),
    LossConfig(LossType.DPPO, DppoParams()),
    LossConfig(LossType.GRPO, GrpoParams(beta=0.1, agg_type=GrpoAggregation.TOKEN_MEAN)),
    LossConfig(LossType.GRPO, GrpoParams(agg_type=GrpoAggregation.SEQUENCE_MEAN)),
    LossConfig(LossType.GRPO, GrpoParams(ratio_type=GrpoRatioType.SEQUENCE)),
]


@pytest.fixture
def engine() -> LocalEngine:
    engine = LocalEngine(
        EngineConfig(device="cpu", logprob_chunk_tokens=8), {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}
    )
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=4, alpha=8, seed=1, train_unembed=True))
    return engine


@pytest.mark.parametrize("loss", LOSS_CASES, ids=lambda c: f"{c.type.name}-{c.params}")
def test_one_session_forward_backward_equals_autograd_of_the_naive_path(engine, loss):
    rng = torch.Generator().manual_seed(0)
    samples = (sample(rng, 9, 3), sample(rng, 5, 2), sample(rng, 12, 4))
    session = engine._session("r", "s")[1]
    params = [p for _, p in session.optimizer.named_params]
    for p in params:  # away from B = 0, so the head's adapter is not the identity
        with torch.no_grad():
            p.add_(torch.randn(p.shape, generator=rng) * 0.05)
    engine.discard_gradients("r", "s")

    before = logprobs.chunk_paths.copy()
    result = forward_backward(engine, "r", "s", ForwardBackwardRequest(samples, loss))
    paths = logprobs.chunk_paths - before
    got = [p.grad.clone() for p in params]
    engine.discard_gradients("r", "s")

    # The naive path: one padded forward, full float32 log-softmax, the loss, autograd.
    packed = pack(samples, torch.device("cpu"))
    with engine.trainer_model("r", "s") as model:
        logits = model(input_ids=packed.tokens_ST, attention_mask=packed.attention_mask_ST).logits
        x = torch.log_softmax(logits.float(), -1).gather(-1, packed.targets_ST.unsqueeze(-1))
        x = torch.where(packed.loss_batch.valid_ST, x.squeeze(-1), 0.0)
        want_loss = LOSSES[loss.type](x, packed.loss_batch, loss.params).loss
        want = torch.autograd.grad(want_loss, params)
    assert result.loss == pytest.approx(float(want_loss.detach()), rel=1e-5, abs=1e-6)
    for g, w in zip(got, want, strict=True):
        # float32 noise of a padded forward against bucketed ones: the recomputing path's own
        # distance from this reference (measured: up to 2e-3 relative on GRPO).
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)
    if is_separable(loss):
        assert paths["trained"] > 0 and paths["recomputed"] == 0 and paths["checkpoint"] == 0
    else:
        assert paths["trained"] == 0 and paths["checkpoint"] > 0
