"""LocalEngine on the built-in model: losses against torch references, accumulation, sampling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_calls import forward_backward, sample

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.train.logprobs import target_logprobs
from posttrain.errors import NonFiniteLoss
from posttrain.types import (
    AdamParams,
    CustomForwardBackwardRequest,
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


@pytest.fixture
def engine() -> LocalEngine:
    torch.manual_seed(0)
    engine = LocalEngine(
        EngineConfig(device="cpu", logprob_chunk_tokens=3), {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}
    )
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=4, alpha=8, seed=1))
    return engine


def ce_sample(tokens: list[int], weights: list[float]) -> TrainingSample:
    return TrainingSample(
        tokens=tuple(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": tuple(weights),
        },
    )


def grads(engine: LocalEngine) -> dict[str, torch.Tensor]:
    session = engine._session("r", "s")[1]
    return {n: p.grad.clone() for n, p in session.optimizer.named_params if p.grad is not None}


def test_chunked_target_logprobs_equal_a_full_log_softmax():
    head = torch.nn.Linear(8, 11)
    hidden = torch.randn(2, 7, 8)
    targets = torch.randint(0, 11, (2, 7))
    expected = torch.log_softmax(head(hidden), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(target_logprobs(head, hidden, targets, chunk_tokens=3), expected)


def test_cross_entropy_matches_torch_on_the_model(engine):
    sample = ce_sample([5, 6, 7, 8, 9, 10], [0.0, 1.0, 0.5, 1.0, 2.0])
    result = forward_backward(
        engine,
        "r",
        "s",
        ForwardBackwardRequest((sample,), CE, forward_only=True, return_loss_fn_outputs=True),
    )
    model = engine._resource("r").loaded.model
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]])).logits[0]
    per_token = F.cross_entropy(logits, torch.tensor([6, 7, 8, 9, 10]), reduction="none")
    weights = torch.tensor([0.0, 1.0, 0.5, 1.0, 2.0])
    assert result.loss == pytest.approx(float((per_token * weights).sum()), rel=1e-5)
    reported = torch.tensor(result.loss_fn_outputs[0])
    assert reported[0] == 0.0  # weight-0 position is reported as 0.0
    torch.testing.assert_close(reported[1:], -per_token[1:], rtol=1e-5, atol=1e-5)
    assert grads(engine) == {}  # forward_only accumulates nothing


def test_gradients_accumulate_across_calls_until_optim_step(engine):
    a = ce_sample([5, 6, 7, 8], [1.0, 1.0, 1.0])
    b = ce_sample([9, 10, 11, 12], [1.0, 1.0, 1.0])
    forward_backward(engine, "r", "s", ForwardBackwardRequest((a,), CE))
    forward_backward(engine, "r", "s", ForwardBackwardRequest((b,), CE))
    separate = grads(engine)
    engine.discard_gradients("r", "s")
    forward_backward(engine, "r", "s", ForwardBackwardRequest((a, b), CE))
    together = grads(engine)
    assert separate.keys() == together.keys() and separate
    for name in separate:
        # Batched and separate passes sum in different orders: compare relative to the norm.
        error = (separate[name] - together[name]).norm() / separate[name].norm().clamp(min=1e-12)
        assert float(error) < 1e-4, (name, float(error))
    engine.optim_step("r", "s", OptimStepRequest(adam=AdamParams(learning_rate=1e-2)))
    assert grads(engine) == {}


def test_custom_forward_backward_equals_cross_entropy_with_weights_minus_g(engine):
    tokens = [5, 6, 7, 8, 9]
    g = (-0.5, -1.0, -2.0, -0.25)  # CE's gradient coefficient is -w, so w = -g
    forward_backward(
        engine, "r", "s", ForwardBackwardRequest((ce_sample(tokens, [-x for x in g]),), CE)
    )
    via_ce = grads(engine)
    engine.discard_gradients("r", "s")
    # Zero weights are placeholders here (tinker shim): they must not scale the gradients.
    engine.custom_forward_backward(
        "r", "s", CustomForwardBackwardRequest((ce_sample(tokens, [0.0] * 4),), (g,))
    )
    custom = grads(engine)
    for name in via_ce:
        torch.testing.assert_close(custom[name], via_ce[name], rtol=1e-5, atol=1e-7)


def test_a_non_finite_gradient_leaves_accumulated_gradients_untouched(engine):
    forward_backward(engine, "r", "s", ForwardBackwardRequest((ce_sample([5, 6, 7], [1, 1]),), CE))
    before = grads(engine)
    huge = (float("inf"), 1.0)
    with pytest.raises(NonFiniteLoss):
        engine.custom_forward_backward(
            "r", "s", CustomForwardBackwardRequest((ce_sample([5, 6, 7], [1, 1]),), (huge,))
        )
    after = grads(engine)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name])


def greedy_without_cache(model, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(torch.argmax(logits)))
    return tokens[len(prompt) :]


def test_greedy_kv_cache_generation_equals_full_recompute_and_batching(engine):
    model = engine._resource("r").loaded.model
    prompts = ((5, 6, 7), (20, 21, 22, 23, 24))
    params = SamplingParams(max_tokens=6, temperature=0.0)
    batched = sample(engine, "r", "s", SampleRequest(prompts, 1, params))
    for prompt, result in zip(prompts, batched, strict=True):
        alone = sample(engine, "r", "s", SampleRequest((prompt,), 1, params))[0]
        tokens = result.sequences[0].tokens
        assert tokens == alone.sequences[0].tokens
        expected = greedy_without_cache(model, list(prompt), len(tokens))
        assert tokens == expected


def test_sampler_logprobs_equal_forward_logprobs_and_seeds_reproduce(engine):
    prompt = (5, 6, 7, 8)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=123)
    result = sample(engine, "r", "s", SampleRequest((prompt,), 3, params))[0]
    again = sample(engine, "r", "s", SampleRequest((prompt, (9, 9)), 3, params))[0]
    assert [s.tokens for s in result.sequences] == [s.tokens for s in again.sequences]
    for sequence in result.sequences:
        full = list(prompt) + sequence.tokens
        scored_sample = ce_sample(full, [0.0] * (len(prompt) - 1) + [1.0] * len(sequence.tokens))
        scored = forward_backward(
            engine,
            "r",
            "s",
            ForwardBackwardRequest(
                (scored_sample,), CE, forward_only=True, return_loss_fn_outputs=True
            ),
        )
        forward = scored.loss_fn_outputs[0][len(prompt) - 1 :]
        assert max(abs(a - b) for a, b in zip(forward, sequence.logprobs, strict=True)) <= 1e-4


def test_bfloat16_base_weights_keep_float32_adapters_and_logprobs_near_float32(engine):
    """`--dtype bfloat16` (the CUDA default) on CPU: the frozen base is bf16, the adapters the
    optimizer updates stay float32, and the logprobs stay within bf16 rounding of float32's."""
    half = LocalEngine(
        EngineConfig(device="cpu", dtype="bfloat16"), {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}
    )
    half.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    half.create_session("r", "s", LoraConfig(rank=4, alpha=8, seed=1))
    resource = half._resource("r")
    base = {p.dtype for p in resource.loaded.model.parameters()}
    keys = resource.lora.adapter_keys()  # the trainer's and the generator's copies
    adapters = {p.dtype for key in keys for _, p in resource.lora.adapter_parameters(key)}
    assert (base, adapters) == ({torch.bfloat16}, {torch.float32})

    sample = ce_sample([5, 6, 7, 8, 9, 10], [1.0] * 5)
    request = ForwardBackwardRequest((sample,), CE, forward_only=True, return_loss_fn_outputs=True)
    exact = torch.tensor(forward_backward(engine, "r", "s", request).loss_fn_outputs[0])
    rounded = torch.tensor(forward_backward(half, "r", "s", request).loss_fn_outputs[0])
    assert exact.dtype == rounded.dtype == torch.float32
    assert 0 < (exact - rounded).abs().max() < 0.1
