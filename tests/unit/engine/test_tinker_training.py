"""What the Tinker surface needs of a forward-backward, on the built-in model, against a plain
padded forward of the session's model with autograd written here: cross-entropy over [N, K]
targets (TrainingSample.targets_per_position), negative cross-entropy weights, the logprob of
every position (ForwardBackwardRequest.report_all_logprobs), and GSPO through the engine.

Legend: N = positions of a sample, K = targets per position, V = vocab.
"""

from __future__ import annotations

import pytest
import torch
from engine_calls import forward_backward

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.train.batching import pack
from posttrain.engine.train.losses import LOSSES
from posttrain.types import (
    ForwardBackwardRequest,
    GspoParams,
    LoraConfig,
    LossConfig,
    LossType,
    TrainingSample,
)

CE = LossConfig(LossType.CROSS_ENTROPY)


def make_engine(*, train_unembed: bool) -> LocalEngine:
    engine = LocalEngine(
        EngineConfig(device="cpu", logprob_chunk_tokens=8), {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}
    )
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    lora = LoraConfig(rank=4, alpha=8, seed=1, train_unembed=train_unembed)
    engine.create_session("r", "s", lora)
    rng = torch.Generator().manual_seed(1)
    for _, p in engine._session("r", "s")[1].optimizer.named_params:
        with torch.no_grad():  # away from B = 0, so the adapters change the logprobs
            p.add_(torch.randn(p.shape, generator=rng) * 0.05)
    return engine


def params(engine: LocalEngine) -> list[torch.nn.Parameter]:
    return [p for _, p in engine._session("r", "s")[1].optimizer.named_params]


def plain_logprobs_NV(engine: LocalEngine, tokens: tuple[int, ...]) -> torch.Tensor:
    """[N, V] float32 log-softmax of one sample by one unbatched forward, in autograd."""
    with engine.trainer_model("r", "s") as model:
        ids = torch.tensor([tokens])
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    return torch.log_softmax(logits.float(), -1)


def topk_sample(rng: torch.Generator, n: int, k: int) -> TrainingSample:
    """A sample with K targets per position and weights of both signs (some 0)."""
    tokens = tuple(torch.randint(3, 99, (n,), generator=rng).tolist())
    targets = torch.randint(0, 99, (n * k,), generator=rng).tolist()
    weights = (torch.randn(n * k, generator=rng).round(decimals=1)).tolist()
    weights[0] = 0.0
    inputs = {"target_tokens": tuple(map(float, targets)), "weights": tuple(weights)}
    return TrainingSample(tokens, inputs, targets_per_position=k)


@pytest.mark.parametrize("train_unembed", [False, True], ids=["frozen-head", "lora-head"])
def test_topk_cross_entropy_with_negative_weights_equals_autograd(train_unembed):
    engine = make_engine(train_unembed=train_unembed)
    rng = torch.Generator().manual_seed(0)
    # Two K = 3 samples and one plain one, so a bucket mixes K.
    samples = (topk_sample(rng, 7, 3), topk_sample(rng, 4, 1), topk_sample(rng, 5, 3))
    request = ForwardBackwardRequest(samples, CE, return_loss_fn_outputs=True)
    result = forward_backward(engine, "r", "s", request)
    got = [p.grad.clone() for p in params(engine)]
    engine.discard_gradients("r", "s")

    want_loss = torch.zeros(())
    want_outputs = []
    for sample in samples:
        n, k = len(sample.tokens), sample.targets_per_position
        logprobs_NV = plain_logprobs_NV(engine, sample.tokens)
        targets_NK = torch.tensor(sample.loss_fn_inputs["target_tokens"]).long().view(n, k)
        weights_NK = torch.tensor(sample.loss_fn_inputs["weights"]).view(n, k)
        x_NK = logprobs_NV.gather(-1, targets_NK)  # logp(target[n, k] | prefix n)
        want_loss = want_loss - (weights_NK * x_NK).sum()
        want_outputs.append(torch.where(weights_NK != 0, x_NK, 0.0).flatten())
    want = torch.autograd.grad(want_loss, params(engine))

    assert result.loss == pytest.approx(float(want_loss.detach()), rel=1e-5, abs=1e-5)
    assert result.metrics["loss:sum"] == result.loss
    assert result.loss_fn_outputs is not None
    for got_out, want_out in zip(result.loss_fn_outputs, want_outputs, strict=True):
        assert len(got_out) == len(want_out)  # N * K, row-major
        torch.testing.assert_close(torch.tensor(got_out), want_out.detach(), rtol=1e-5, atol=1e-5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-5)


def test_report_all_logprobs_reports_every_position_whatever_the_weights():
    engine = make_engine(train_unembed=False)
    tokens = (5, 9, 14, 3, 27, 8)
    targets = (9, 14, 3, 27, 8, 40)
    # The SDK's forward_backward_custom forward: cross-entropy with weights 0 everywhere.
    sample = TrainingSample(
        tokens, {"target_tokens": tuple(map(float, targets)), "weights": (0.0,) * 6}
    )
    logprobs_NV = plain_logprobs_NV(engine, tokens).detach()
    want = logprobs_NV.gather(-1, torch.tensor(targets).unsqueeze(-1)).squeeze(-1)

    common = dict(forward_only=True, return_loss_fn_outputs=True)
    everywhere = forward_backward(
        engine, "r", "s", ForwardBackwardRequest((sample,), CE, report_all_logprobs=True, **common)
    )
    masked = forward_backward(engine, "r", "s", ForwardBackwardRequest((sample,), CE, **common))

    assert everywhere.loss_fn_outputs is not None and masked.loss_fn_outputs is not None
    torch.testing.assert_close(torch.tensor(everywhere.loss_fn_outputs[0]), want)
    assert all(value < 0.0 for value in everywhere.loss_fn_outputs[0])
    assert masked.loss_fn_outputs[0] == [0.0] * 6  # the Together surface: as before
    assert everywhere.loss == masked.loss == 0.0


def test_gspo_forward_backward_equals_autograd_of_the_plain_path():
    engine = make_engine(train_unembed=True)
    rng = torch.Generator().manual_seed(3)
    samples = []
    for n, prompt in ((8, 3), (5, 2)):
        tokens = torch.randint(3, 99, (n + 1,), generator=rng).tolist()
        completion = n - prompt
        sampler = (-torch.rand(completion, generator=rng) * 3 - 1).tolist()
        advantage = float(torch.rand((), generator=rng) * 2 - 1)
        inputs = {  # as tinker_cookbook's rl_loop builds a gspo datum: no weights, no mask
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "logprobs": (0.0,) * prompt + tuple(sampler),
            "advantages": (0.0,) * prompt + (advantage,) * completion,
            "sequence_ratio_mask": (0.0,) * prompt + (1.0,) * completion,
        }
        samples.append(TrainingSample(tuple(tokens[:-1]), inputs))
    loss = LossConfig(LossType.GSPO, GspoParams(clip_low_threshold=0.9, clip_high_threshold=1.1))
    result = forward_backward(engine, "r", "s", ForwardBackwardRequest(tuple(samples), loss))
    got = [p.grad.clone() for p in params(engine)]
    engine.discard_gradients("r", "s")

    packed = pack(tuple(samples), torch.device("cpu"))
    with engine.trainer_model("r", "s") as model:
        logits = model(input_ids=packed.tokens_ST, attention_mask=packed.attention_mask_ST).logits
    x = torch.log_softmax(logits.float(), -1).gather(-1, packed.targets_ST.unsqueeze(-1))
    x = torch.where(packed.loss_batch.valid_ST, x.squeeze(-1), 0.0)
    want_loss = LOSSES[LossType.GSPO](x, packed.loss_batch, loss.params).loss
    want = torch.autograd.grad(want_loss, params(engine))
    assert result.loss == pytest.approx(float(want_loss.detach()), rel=1e-5, abs=1e-6)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)
