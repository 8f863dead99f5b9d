"""EngineConfig.loss_fn_outputs on LocalEngine with the built-in model: `requested` returns
per-sample logprobs only when the request sets return_loss_fn_outputs (api.md); `always`
returns them on every forward-backward, equal to the requested ones."""

from __future__ import annotations

from typing import Literal

import pytest
import torch
from engine_calls import forward_backward

from posttrain.cli import parser, serve_config
from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.types import ForwardBackwardRequest, LoraConfig, LossConfig, LossType, TrainingSample

TOKENS = [5, 6, 7, 8, 9, 10]
# Policy-loss sample without weights or mask: the first position is a prompt placeholder.
SAMPLE = TrainingSample(
    tokens=tuple(TOKENS[:-1]),
    loss_fn_inputs={
        "target_tokens": tuple(float(t) for t in TOKENS[1:]),
        "logprobs": (0.0, -2.0, -1.5, -3.0, -2.5),
        "advantages": (0.0, 1.0, 1.0, -1.0, -1.0),
    },
)
IS = LossConfig(LossType.IMPORTANCE_SAMPLING)


def engine_with(loss_fn_outputs: Literal["requested", "always"]) -> LocalEngine:
    torch.manual_seed(0)
    config = EngineConfig(device="cpu", loss_fn_outputs=loss_fn_outputs)
    engine = LocalEngine(config, {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR})
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=4, alpha=8, seed=1))
    return engine


def test_loss_fn_outputs_flag_becomes_the_engine_config():
    assert EngineConfig().loss_fn_outputs == "requested"
    args = parser().parse_args(["serve", "--loss-fn-outputs", "always"])
    assert serve_config(args).engine == EngineConfig(loss_fn_outputs="always")
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--loss-fn-outputs", "sometimes"])


def test_requested_returns_outputs_only_when_the_request_asks():
    engine = engine_with("requested")
    plain = forward_backward(engine, "r", "s", ForwardBackwardRequest((SAMPLE,), IS))
    assert plain.loss_fn_outputs is None
    asked = forward_backward(
        engine, "r", "s", ForwardBackwardRequest((SAMPLE,), IS, return_loss_fn_outputs=True)
    )
    assert asked.loss_fn_outputs is not None and len(asked.loss_fn_outputs[0]) == 5
    assert asked.loss == plain.loss and asked.metrics == plain.metrics


def test_always_returns_the_outputs_a_request_would_have_asked_for():
    engine = engine_with("always")
    scored = forward_backward(
        engine,
        "r",
        "s",
        ForwardBackwardRequest((SAMPLE,), IS, forward_only=True, return_loss_fn_outputs=True),
    )
    trained = forward_backward(engine, "r", "s", ForwardBackwardRequest((SAMPLE,), IS))
    assert scored.loss_fn_outputs is not None and trained.loss_fn_outputs is not None
    # No weights or mask: every position is reported, the prompt's included.
    assert all(value < 0.0 for value in trained.loss_fn_outputs[0])
    torch.testing.assert_close(
        torch.tensor(trained.loss_fn_outputs[0]), torch.tensor(scored.loss_fn_outputs[0])
    )
    assert trained.loss == pytest.approx(scored.loss, rel=1e-6)
    # Only the four completion positions carry the policy (engine/train/losses.py policy_positions).
    assert trained.metrics["valid_tokens:sum"] == 4.0
