"""Forward-backward of several sessions in one shared pass equals each session run alone."""

from __future__ import annotations

import pytest
import torch
from engine_calls import forward_backward

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.errors import NonFiniteLoss, NotFound
from posttrain.types import (
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    TrainingSample,
)

CE = LossConfig(LossType.CROSS_ENTROPY)
IS = LossConfig(LossType.IMPORTANCE_SAMPLING)


def engine_with_sessions(names: list[str]) -> LocalEngine:
    engine = LocalEngine(EngineConfig(device="cpu"), {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR})
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    for index, name in enumerate(names):
        engine.create_session("r", name, LoraConfig(rank=4 + 4 * index, alpha=8, seed=index))
        # Non-zero B so each adapter changes the model and sessions differ from each other.
        with torch.no_grad():
            for param_name, p in engine._session("r", name)[1].optimizer.named_params:
                if param_name.endswith("lora_B"):
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(100 + index))
    return engine


def ce(tokens: list[int]) -> TrainingSample:
    n = len(tokens) - 1
    return TrainingSample(
        tuple(tokens[:-1]),
        {"target_tokens": tuple(float(t) for t in tokens[1:]), "weights": (1.0,) * n},
    )


def is_sample(tokens: list[int], advantage: float, sampler: float = -2.0) -> TrainingSample:
    n = len(tokens) - 1
    return TrainingSample(
        tuple(tokens[:-1]),
        {
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "logprobs": (sampler,) * n,
            "advantages": (advantage,) * n,
        },
    )


REQUESTS = {
    "a": ForwardBackwardRequest(
        (ce([5, 6, 7, 8, 9]), ce([10, 11, 12])), CE, return_loss_fn_outputs=True
    ),
    "b": ForwardBackwardRequest(
        (is_sample([20, 21, 22, 23, 24, 25, 26], 0.5),), IS, return_loss_fn_outputs=True
    ),
    "c": ForwardBackwardRequest(
        (ce([30, 31, 32]),), CE, forward_only=True, return_loss_fn_outputs=True
    ),
}


def gradients(engine: LocalEngine, name: str) -> dict[str, torch.Tensor]:
    session = engine._session("r", name)[1]
    return {n: p.grad.clone() for n, p in session.optimizer.named_params if p.grad is not None}


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).norm()) <= 1e-5 * max(1.0, float(b.norm()))


def test_shared_pass_matches_each_session_alone():
    names = sorted(REQUESTS)
    alone_engine = engine_with_sessions(names)
    alone = {n: forward_backward(alone_engine, "r", n, REQUESTS[n]) for n in names}
    shared_engine = engine_with_sessions(names)
    shared = shared_engine.forward_backward_batch("r", [(n, REQUESTS[n]) for n in names])
    for name, result in zip(names, shared, strict=True):
        assert not isinstance(result, Exception)
        assert result.loss == pytest.approx(alone[name].loss, rel=1e-5)
        for got, want in zip(result.loss_fn_outputs, alone[name].loss_fn_outputs, strict=True):
            assert got == pytest.approx(want, abs=1e-5)
        grads_alone, grads_shared = gradients(alone_engine, name), gradients(shared_engine, name)
        assert grads_alone.keys() == grads_shared.keys()
        assert bool(grads_shared) == (not REQUESTS[name].forward_only)
        for key in grads_alone:
            assert close(grads_shared[key], grads_alone[key]), (name, key)


def test_a_failing_item_does_not_disturb_the_others():
    engine = engine_with_sessions(["a", "b"])
    forward_backward(engine, "r", "a", REQUESTS["a"])
    before = gradients(engine, "a")
    overflow = ForwardBackwardRequest((is_sample([5, 6, 7], 3e38, sampler=-50.0),), IS)
    outcomes = engine.forward_backward_batch("r", [("a", overflow), ("b", REQUESTS["b"])])
    assert isinstance(outcomes[0], NonFiniteLoss)
    assert not isinstance(outcomes[1], Exception) and gradients(engine, "b")
    after = gradients(engine, "a")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_an_item_of_an_unknown_session_fails_alone_with_not_found():
    engine = engine_with_sessions(["a", "b"])
    alone = forward_backward(engine_with_sessions(["a", "b"]), "r", "b", REQUESTS["b"])
    items = [("gone", REQUESTS["a"]), ("b", REQUESTS["b"])]
    missing, result = engine.forward_backward_batch("r", items)
    assert isinstance(missing, NotFound) and "gone" in str(missing)
    assert not isinstance(result, Exception)
    assert result.loss == pytest.approx(alone.loss, rel=1e-6)
    assert not gradients(engine, "a")
