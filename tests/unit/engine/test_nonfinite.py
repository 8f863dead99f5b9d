"""The non-finite guard (losses.md 1.5, api.md 6.3): a forward-backward whose loss or gradient is
NaN/inf raises NonFiniteLoss and leaves the weights, the optimizer state and the gradients
accumulated earlier bit-for-bit as they were. Checked by hashing all three on a LocalEngine."""

from __future__ import annotations

import hashlib

import pytest
import torch
from engine_calls import forward_backward

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.errors import NonFiniteLoss
from posttrain.types import (
    AdamParams,
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    OptimStepRequest,
    TrainingSample,
)

TOKENS = (5, 6, 7, 8, 9, 10)
N = len(TOKENS) - 1
CE = LossConfig(LossType.CROSS_ENTROPY)
IS = LossConfig(LossType.IMPORTANCE_SAMPLING)


@pytest.fixture
def engine() -> LocalEngine:
    engine = LocalEngine(EngineConfig(device="cpu"), {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR})
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=4, alpha=8, seed=1))
    return engine


def sample(**inputs: tuple[float, ...]) -> TrainingSample:
    targets = tuple(float(t) for t in TOKENS[1:])
    return TrainingSample(TOKENS[:-1], {"target_tokens": targets, **inputs})


def current_logprobs(engine: LocalEngine) -> tuple[float, ...]:
    request = ForwardBackwardRequest(
        (sample(weights=(1.0,) * N),), CE, forward_only=True, return_loss_fn_outputs=True
    )
    outputs = forward_backward(engine, "r", "s", request).loss_fn_outputs
    assert outputs is not None
    return tuple(outputs[0])


def state_hash(engine: LocalEngine) -> str:
    """sha256 over the base weights, the session's adapter weights and their .grad, and the
    optimizer state, in name order. (Adapters live outside the model's named_parameters.)"""
    resource, session = engine._session("r", "s")
    digest = hashlib.sha256()

    def add(name: str, value: torch.Tensor | None) -> None:
        digest.update(name.encode())
        if value is not None:
            digest.update(value.detach().cpu().contiguous().numpy().tobytes())

    for name, p in sorted(resource.loaded.model.named_parameters()):
        add(name, p)
    assert session.optimizer.named_params, "the session has trainable parameters"
    for name, p in session.optimizer.named_params:
        add(f"adapter/{name}", p)
        add(f"adapter/{name}.grad", p.grad)
    state = session.optimizer.state_dict()
    for group in sorted(state):
        for name in sorted(state[group]):
            for key, value in sorted(state[group][name].items()):
                add(f"{group}/{name}/{key}", value)
    return digest.hexdigest()


@pytest.fixture
def trained(engine: LocalEngine) -> LocalEngine:
    """A session with optimizer state (one step done) and gradients accumulated since."""
    forward_backward(engine, "r", "s", ForwardBackwardRequest((sample(weights=(1.0,) * N),), CE))
    engine.optim_step("r", "s", OptimStepRequest(adam=AdamParams(learning_rate=1e-2)))
    x = current_logprobs(engine)
    ok = sample(logprobs=x, advantages=(0.0, 1.0, -0.5, 2.0, 1.0))
    forward_backward(engine, "r", "s", ForwardBackwardRequest((ok,), IS))
    session = engine._session("r", "s")[1]
    assert session.optimizer.state_dict()["adam"], "the fixture must leave optimizer state"
    assert session.optimizer.has_gradients(), "the fixture must leave accumulated gradients"
    return engine


def on_policy(engine: LocalEngine, advantages: tuple[float, ...]) -> TrainingSample:
    return sample(logprobs=current_logprobs(engine), advantages=advantages)


BAD_REQUESTS = {
    # -sum r A with r = 1 and A = 3e38 twice: the float32 sum overflows to -inf.
    "loss overflows": lambda e: ForwardBackwardRequest(
        (on_policy(e, (0.0, 3e38, 3e38, 0.0, 0.0)),), IS
    ),
    # q = -1e30 at an included position: exp(x - q) overflows, so the loss is -inf.
    "ratio overflows": lambda e: ForwardBackwardRequest(
        (sample(logprobs=(0.0, -1e30, 0.0, 0.0, 0.0), advantages=(0.0, 1.0, 0.0, 0.0, 0.0)),),
        IS,
    ),
    # The loss, -1e38, is finite; its gradient overflows on the way back through the model.
    "gradient overflows with a finite loss": lambda e: ForwardBackwardRequest(
        (on_policy(e, (1e38, 0.0, 0.0, 0.0, 0.0)),), IS
    ),
    "cross-entropy weights overflow": lambda e: ForwardBackwardRequest(
        (sample(weights=(3e38, 3e38, 0.0, 0.0, 0.0)),), CE
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_non_finite_forward_backward_changes_no_weight_state_or_gradient(trained, case):
    request = BAD_REQUESTS[case](trained)
    before = state_hash(trained)
    with pytest.raises(NonFiniteLoss):
        forward_backward(trained, "r", "s", request)
    assert state_hash(trained) == before


def test_the_finite_loss_case_really_has_a_finite_loss(trained):
    """Pins that the gradient guard, not the loss check, rejects that case."""
    request = BAD_REQUESTS["gradient overflows with a finite loss"](trained)
    forward_only = ForwardBackwardRequest(request.samples, request.loss, forward_only=True)
    assert forward_backward(trained, "r", "s", forward_only).loss == pytest.approx(-1e38, rel=1e-6)


def test_non_finite_custom_gradient_changes_nothing(trained):
    before = state_hash(trained)
    request = CustomForwardBackwardRequest((sample(),), ((1e38, 1e38, 0.0, 0.0, 0.0),))
    with pytest.raises(NonFiniteLoss):
        trained.custom_forward_backward("r", "s", request)
    assert state_hash(trained) == before


def test_overflow_at_an_excluded_position_is_ignored(trained):
    """Safe masking (losses.md 1.3): the same -1e30 placeholder, masked out, is harmless."""
    masked = sample(
        logprobs=(0.0, -1e30, 0.0, 0.0, 0.0),
        advantages=(0.0, 1.0, 0.0, 0.0, 1.0),
        mask=(1.0, 0.0, 1.0, 1.0, 1.0),
    )
    before = state_hash(trained)
    result = forward_backward(trained, "r", "s", ForwardBackwardRequest((masked,), IS))
    assert torch.isfinite(torch.tensor(result.loss))
    assert state_hash(trained) != before  # its gradient was accumulated


def test_a_step_after_a_rejected_batch_equals_a_step_without_it(engine):
    """Two fresh sessions with the same seed; one also sees a rejected batch between its
    forward-backward and its step. Their weights after the step are identical."""
    engine.create_session("r", "t", LoraConfig(rank=4, alpha=8, seed=1))
    good = ForwardBackwardRequest((sample(weights=(1.0, 0.5, 1.0, 2.0, 1.0)),), CE)
    bad = ForwardBackwardRequest((sample(weights=(3e38, 3e38, 0.0, 0.0, 0.0)),), CE)
    step = OptimStepRequest(adam=AdamParams(learning_rate=1e-2))
    for session in ("s", "t"):
        forward_backward(engine, "r", session, good)
        if session == "s":
            with pytest.raises(NonFiniteLoss):
                forward_backward(engine, "r", session, bad)
        engine.optim_step("r", session, step)
    adapters = [
        {name: p.detach().clone() for name, p in engine._session("r", s)[1].optimizer.named_params}
        for s in ("s", "t")
    ]
    assert [t.shape for t in adapters[0].values()] == [t.shape for t in adapters[1].values()]
    for (name, a), b in zip(adapters[0].items(), adapters[1].values(), strict=True):
        assert torch.equal(a, b), name


def test_an_allocator_failure_mid_backward_keeps_the_earlier_gradients(trained):
    """Out of memory in the backward (here: torch's CPU allocator message, raised from a hook
    on the first adapter's gradient): the item fails RESOURCE_EXHAUSTED and the gradients the
    session accumulated before are all still there, bit for bit."""
    from posttrain.errors import RESOURCE_EXHAUSTED, operation_error_code

    before = state_hash(trained)
    _, parameter = trained._session("r", "s")[1].optimizer.named_params[0]

    def fail(_grad):
        raise RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory")

    handle = parameter.register_hook(fail)
    try:
        request = ForwardBackwardRequest((sample(weights=(1.0,) * N),), CE)
        with pytest.raises(RuntimeError) as info:
            forward_backward(trained, "r", "s", request)
    finally:
        handle.remove()
    assert operation_error_code(info.value) == RESOURCE_EXHAUSTED
    assert state_hash(trained) == before
