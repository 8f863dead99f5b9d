"""Full-weight sessions in LocalEngine on the built-in model: every weight trains, the generator
keeps its own copy until weights-sync, and the base weights come back when the session ends."""

from __future__ import annotations

import pytest
import torch
from engine_calls import forward_backward

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.generate import generator
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.model.loader import load_model
from posttrain.types import (
    AdamParams,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    MuonScaling,
    OptimStepRequest,
    TrainingSample,
)

CE = LossConfig(LossType.CROSS_ENTROPY)
SAMPLE = TrainingSample(
    tokens=(5, 6, 7, 8, 9),
    loss_fn_inputs={"target_tokens": (6.0, 7.0, 8.0, 9.0, 10.0), "weights": (1.0,) * 5},
)
STEP = OptimStepRequest(adam=AdamParams(learning_rate=1e-2, weight_decay=0.1))


def make_engine(muon_scaling: MuonScaling | None = None) -> LocalEngine:
    engine = LocalEngine(EngineConfig(device="cpu"), {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR})
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=muon_scaling)
    engine.create_session("r", "s", None)
    return engine


@pytest.fixture(scope="module")
def base_weights() -> dict[str, torch.Tensor]:
    model = load_model(BUILTIN_MODEL_DIR, torch.device("cpu"), torch.float32).model
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def forward_loss(engine: LocalEngine) -> float:
    request = ForwardBackwardRequest((SAMPLE,), CE, forward_only=True)
    return forward_backward(engine, "r", "s", request).loss


def generator_weights(engine: LocalEngine) -> dict[str, torch.Tensor]:
    resource, session = engine._session("r", "s")
    model = generator.sampling_model(resource, session)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def trainer_weights(engine: LocalEngine) -> dict[str, torch.Tensor]:
    model = engine._resource("r").loaded.model
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_every_base_weight_trains_under_its_hugging_face_name(base_weights):
    engine = make_engine()
    optimizer = engine._session("r", "s")[1].optimizer
    assert {name for name, _ in optimizer.named_params} == set(base_weights)
    forward_backward(engine, "r", "s", ForwardBackwardRequest((SAMPLE,), CE))
    with_grad = {name for name, p in optimizer.named_params if p.grad is not None}
    assert with_grad == set(base_weights)
    before = forward_loss(engine)
    engine.optim_step("r", "s", STEP)
    assert forward_loss(engine) < before
    changed = {
        name
        for name, p in optimizer.named_params
        if not torch.equal(p.detach(), base_weights[name])
    }
    assert changed == set(base_weights)


def test_generator_keeps_its_copy_until_weights_sync(base_weights):
    engine = make_engine()
    forward_backward(engine, "r", "s", ForwardBackwardRequest((SAMPLE,), CE))
    engine.optim_step("r", "s", STEP)
    served = generator_weights(engine)
    trained = trainer_weights(engine)
    assert all(torch.equal(served[n], base_weights[n.replace(".base.", ".")]) for n in served)
    assert any(not torch.equal(served[n], trained[n]) for n in served)
    engine.publish("r", "s", version=1)
    served = generator_weights(engine)
    assert all(torch.equal(served[n], trained[n]) for n in served)
    copy = generator.sampling_model(*engine._session("r", "s"))
    assert all(not p.requires_grad for p in copy.parameters())


def test_stopping_the_session_restores_the_base_weights(base_weights):
    engine = make_engine()
    base_loss = forward_loss(engine)
    forward_backward(engine, "r", "s", ForwardBackwardRequest((SAMPLE,), CE))
    engine.optim_step("r", "s", STEP)
    engine.drop_session("r", "s")
    model = engine._resource("r").loaded.model
    assert all(not p.requires_grad and p.grad is None for p in model.parameters())
    engine.create_session("r", "s2", LoraConfig(rank=2, seed=3))
    request = ForwardBackwardRequest((SAMPLE,), CE, forward_only=True)
    # A fresh LoRA adapter (B = 0) on the restored model is the base model exactly.
    assert forward_backward(engine, "r", "s2", request).loss == base_loss


def test_a_full_weight_resource_refuses_a_second_session():
    engine = make_engine()
    with pytest.raises(AssertionError, match="full-weight"):
        engine.create_session("r", "s2", LoraConfig(rank=2))


def test_muon_leaves_embeddings_head_and_norms_to_adamw(base_weights):
    engine = make_engine(MuonScaling.MATCH_ADAM)
    optimizer = engine._session("r", "s")[1].optimizer
    muon = set(optimizer.muon_param_names)
    assert muon == {
        name
        for name, value in base_weights.items()
        if value.ndim >= 2 and not any(p in name for p in ("embed_tokens", "lm_head", "norm"))
    }
    assert muon and "model.layers.0.self_attn.q_proj.weight" in muon
