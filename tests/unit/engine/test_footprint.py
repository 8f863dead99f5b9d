"""The engine's read-only sizes (engine/memory/footprint.py) and the benchmark hooks of LocalEngine,
on the built-in model: exact tensor bytes, and a caller's own forward through trainer_model."""

from __future__ import annotations

import pytest
import torch
from engine_calls import forward_backward

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.types import (
    AdamParams,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    OptimStepRequest,
    TrainingSample,
)

CE = LossConfig(LossType.CROSS_ENTROPY)
SAMPLE = TrainingSample(
    (5, 6, 7, 8), {"target_tokens": (6.0, 7.0, 8.0, 9.0), "weights": (1.0,) * 4}
)
STEP = OptimStepRequest(adam=AdamParams(learning_rate=1e-3))
FLOAT32 = 4


@pytest.fixture
def engine() -> LocalEngine:
    torch.manual_seed(0)
    engine = LocalEngine(EngineConfig(device="cpu"), {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR})
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    return engine


def test_a_lora_session_holds_its_adapter_a_generator_copy_and_two_moments_after_a_step(engine):
    engine.create_session("r", "s", LoraConfig(rank=8, seed=1))
    fresh = engine.session_footprint("r", "s")
    assert fresh.optimizer_bytes == fresh.gradient_bytes == 0
    assert fresh.generator_bytes == fresh.weights_bytes > 0
    forward_backward(engine, "r", "s", ForwardBackwardRequest((SAMPLE,), CE))
    assert engine.session_footprint("r", "s").gradient_bytes == fresh.weights_bytes
    engine.optim_step("r", "s", STEP)
    stepped = engine.session_footprint("r", "s")
    assert stepped.gradient_bytes == 0
    # AdamW: two float32 moments per adapter tensor (plus a scalar step count per tensor).
    assert 2 * fresh.weights_bytes <= stepped.optimizer_bytes < 2 * fresh.weights_bytes + 4096


def test_resource_total_is_the_base_plus_each_sessions_tensors(engine):
    empty = engine.resource_footprint("r")
    assert empty.base_bytes == empty.base_parameters * FLOAT32
    assert empty.total_bytes >= empty.base_bytes  # buffers (rotary tables) come on top
    for index, name in enumerate(("a", "b")):
        engine.create_session("r", name, LoraConfig(rank=4, seed=index))
        forward_backward(engine, "r", name, ForwardBackwardRequest((SAMPLE,), CE))
        engine.optim_step("r", name, STEP)
    sessions = [engine.session_footprint("r", name) for name in ("a", "b")]
    total = engine.resource_footprint("r").total_bytes
    assert total == empty.total_bytes + sum(s.resident_bytes for s in sessions)


def test_discard_gradients_drops_what_forward_backward_accumulated(engine):
    engine.create_session("r", "s", LoraConfig(rank=4, seed=1))
    forward_backward(engine, "r", "s", ForwardBackwardRequest((SAMPLE,), CE))
    assert engine.session_footprint("r", "s").gradient_bytes > 0
    engine.discard_gradients("r", "s")
    assert engine.session_footprint("r", "s").gradient_bytes == 0


def test_a_forward_through_trainer_model_gives_the_engines_logprobs(engine):
    engine.create_session("r", "s", LoraConfig(rank=4, seed=1))
    with torch.no_grad():  # non-zero B, so the adapter changes the model
        for _, p in engine._session("r", "s")[1].optimizer.named_params:
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(7))
    request = ForwardBackwardRequest((SAMPLE,), CE, forward_only=True, return_loss_fn_outputs=True)
    (engine_logprobs,) = forward_backward(engine, "r", "s", request).loss_fn_outputs
    with engine.trainer_model("r", "s") as model, torch.no_grad():
        logits_TV = model(input_ids=torch.tensor([SAMPLE.tokens])).logits[0].float()
    targets_T = torch.tensor([6, 7, 8, 9])
    own_T = torch.log_softmax(logits_TV, -1).gather(-1, targets_T[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(engine_logprobs), own_T, atol=1e-5, rtol=0)
