"""Activation checkpointing of decoder layers (engine/train/layer_checkpoint.py): it changes
memory and time, never numbers. On small random-init Qwen3 and Qwen3-MoE models
(tests/unit/model/families.py), loss and gradients are equal with --activation-checkpointing
on and off for a LoRA session (with dropout, and two sessions' rows in one shared pass), a
full-weight session, a custom forward-backward, and MoE routes replayed or routed freely; the
layers really are recomputed; the estimate counts the checkpointed peak (lower, growing with
the tokens rather than layers x tokens); auto checkpoints a pass only where it does not fit
without, and admission refuses one that does not fit even checkpointed, before it runs."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import test_sharded_full_weight as helpers
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "model"))
import families  # noqa: E402

from posttrain.config import EngineConfig  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.engine.hosts.ranks.trainer_group import TrainerGroupEngine  # noqa: E402
from posttrain.engine.memory import estimate  # noqa: E402
from posttrain.engine.memory.headroom import _rss_bytes  # noqa: E402
from posttrain.engine.train.expert_routes import to_routes  # noqa: E402
from posttrain.engine.train.layer_checkpoint import decoder_layers  # noqa: E402
from posttrain.service.scheduling.admission import plan_passes  # noqa: E402
from posttrain.types import (  # noqa: E402
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    OperationKind,
    TrainingSample,
)

CE = LossConfig(LossType.CROSS_ENTROPY)
FB = OperationKind.FORWARD_BACKWARD
TOLERANCE = 1e-6
LORA = LoraConfig(rank=4, alpha=8, seed=1, dropout=0.1)  # dropout: the recompute's RNG


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return families.build("qwen3", tmp_path_factory.mktemp("ckpt") / "qwen3")


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory) -> Path:
    """Eight layers and long positions: activations that dwarf the resident set's noise."""
    size = families.Size(num_hidden_layers=8, max_position_embeddings=8192)
    return families.build("qwen3", tmp_path_factory.mktemp("ckpt") / "deep", size=size)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def moe_dir(request, tmp_path_factory) -> Path:
    """A softmax top-k MoE, and a sigmoid group-limited one (multi-head latent attention)."""
    return families.build(request.param, tmp_path_factory.mktemp("ckpt") / request.param)


def sample(length: int, offset: int = 0, routes=None) -> TrainingSample:
    tokens = [3 + (7 * t + offset) % 90 for t in range(length + 1)]
    return TrainingSample(
        tuple(tokens[:-1]),
        {"target_tokens": tuple(float(t) for t in tokens[1:]), "weights": (1.0,) * length},
        routed_experts=routes,
    )


def engine_for(directory: Path, mode: str, lora: LoraConfig | None, sessions=("s",)):
    config = EngineConfig(device="cpu", activation_checkpointing=mode)
    engine = LocalEngine(config, {"m": directory})
    engine.load_resource("r", "m", muon_scaling=None)
    for session in sessions:
        engine.create_session("r", session, lora)
    return engine


def gradients(engine: LocalEngine, session: str) -> dict[str, torch.Tensor]:
    grads = engine._session("r", session)[1].optimizer.full_gradients()
    assert grads
    return {name: grad.clone() for name, grad in grads.items()}


def both_ways(directory, lora, items, sessions=("s",)):
    """(losses, gradients per session) of one pass of `items`, checkpointed and not."""
    outcomes = {}
    for mode in ("off", "on"):
        engine = engine_for(directory, mode, lora, sessions)
        torch.manual_seed(7)  # the same dropout draws both ways
        results = engine.forward_backward_batch("r", items)
        losses = [r.loss for r in results if not isinstance(r, Exception)]
        assert len(losses) == len(items), results
        outcomes[mode] = (losses, {s: gradients(engine, s) for s in sessions})
    return outcomes["off"], outcomes["on"]


def assert_same(off, on):
    (losses_off, grads_off), (losses_on, grads_on) = off, on
    assert losses_on == pytest.approx(losses_off, abs=TOLERANCE, rel=TOLERANCE)
    for session, grads in grads_off.items():
        assert grads.keys() == grads_on[session].keys()
        for name, grad in grads.items():
            difference = (grad - grads_on[session][name]).abs().max().item()
            assert difference <= TOLERANCE, (session, name, difference)


def test_a_lora_session_trains_the_same_checkpointed(qwen3_dir):
    request = ForwardBackwardRequest((sample(40), sample(23, 5), sample(31, 9)), CE)
    assert_same(*both_ways(qwen3_dir, LORA, [("s", request)]))


def test_two_sessions_rows_in_one_pass_train_the_same_checkpointed(qwen3_dir):
    first = ForwardBackwardRequest((sample(40), sample(12, 3)), CE)
    second = ForwardBackwardRequest((sample(33, 8),), CE)
    items = [("s", first), ("t", second)]
    assert_same(*both_ways(qwen3_dir, LORA, items, sessions=("s", "t")))


def test_a_full_weight_session_trains_the_same_checkpointed(qwen3_dir):
    request = ForwardBackwardRequest((sample(40), sample(17, 2)), CE)
    assert_same(*both_ways(qwen3_dir, None, [("s", request)]))


def test_a_custom_forward_backward_is_the_same_checkpointed(qwen3_dir):
    samples = (sample(30), sample(21, 4))
    given = tuple(tuple(0.1 * ((t % 5) - 2) for t in range(len(s.tokens))) for s in samples)
    grads = {}
    for mode in ("off", "on"):
        engine = engine_for(qwen3_dir, mode, LORA)
        torch.manual_seed(7)
        engine.custom_forward_backward("r", "s", CustomForwardBackwardRequest(samples, given))
        grads[mode] = gradients(engine, "s")
    assert_same(([], {"s": grads["off"]}), ([], {"s": grads["on"]}))


def test_moe_routes_replayed_or_free_train_the_same_checkpointed(moe_dir):
    # One row replays given routes (the expert ids of a sampler), one routes freely.
    moe = LocalEngine(EngineConfig(device="cpu"), {"m": moe_dir}).model_info("m").moe
    assert moe is not None
    generator = torch.Generator().manual_seed(3)
    experts = [
        torch.randperm(moe.num_experts, generator=generator)[: moe.top_k]
        for _ in range(30 * moe.num_layers)
    ]
    routes_TLK = torch.stack(experts).view(30, moe.num_layers, moe.top_k)
    request = ForwardBackwardRequest((sample(30, routes=to_routes(routes_TLK)), sample(26, 1)), CE)
    assert_same(*both_ways(moe_dir, LoraConfig(rank=4, alpha=8, seed=1), [("s", request)]))


def test_moe_routes_all_free_train_the_same_checkpointed(moe_dir):
    # No row replays routes: the forward captures the experts its router chose freely, and
    # the recompute replays them through the same ops (the same tensors kept for the backward).
    request = ForwardBackwardRequest((sample(4),), CE)
    assert_same(*both_ways(moe_dir, LoraConfig(rank=4, alpha=8, seed=1), [("s", request)]))


def test_a_full_weight_moe_session_with_free_routes_trains_the_same_checkpointed(
    tmp_path_factory,
):
    directory = families.build("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "qwen3_moe")
    request = ForwardBackwardRequest((sample(4), sample(7, 2)), CE)
    assert_same(*both_ways(directory, None, [("s", request)]))


@contextmanager
def counted(modules: list[torch.nn.Module]) -> Iterator[list[int]]:
    """Inside, how many times the modules' forwards ran, in the one entry of the list."""
    calls = [0]

    def hook(*_: object) -> None:
        calls[0] += 1

    handles = [module.register_forward_hook(hook) for module in modules]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def test_checkpointed_layers_run_their_forward_again_in_the_backward(qwen3_dir):
    calls = {}
    for mode in ("off", "on"):
        engine = engine_for(qwen3_dir, mode, LORA)
        model = engine._resource("r").loaded.model
        with counted([layer.self_attn for layer in decoder_layers(model)]) as count:
            engine.forward_backward_batch("r", [("s", ForwardBackwardRequest((sample(9),), CE))])
        assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))
        calls[mode] = count[0]
    layers = len(decoder_layers(engine._resource("r").loaded.model))
    assert (calls["off"], calls["on"]) == (layers, 2 * layers)


SHAPE = estimate.ModelShape(
    layers=8, hidden=64, query_width=64, kv_width=32, ffn_width=128, vocab=99, dtype_bytes=4
)


def pass_bytes(shape: estimate.ModelShape, tokens: int, *, checkpointed: bool) -> int:
    request = ForwardBackwardRequest((sample(tokens),), CE)
    return estimate.forward_backward_bytes(
        shape, [request], chunk_tokens=1024, trainable_bytes=[0], checkpointed=checkpointed
    )


def test_the_checkpointed_estimate_is_lower_and_grows_with_tokens_not_layers_times_tokens():
    for tokens in (4096, 16384):
        assert pass_bytes(SHAPE, tokens, checkpointed=True) < pass_bytes(
            SHAPE, tokens, checkpointed=False
        ) / 3
    # Linear in the tokens past the logit chunk: 8k more tokens add twice what 4k more do.
    at = {t: pass_bytes(SHAPE, t, checkpointed=True) for t in (4096, 8192, 16384)}
    assert at[16384] - at[8192] == 2 * (at[8192] - at[4096])
    # Twice the layers: checkpointed, one hidden vector more per layer and token (the input
    # it keeps); not, every layer's activations more.
    deeper = estimate.ModelShape(**{**SHAPE.__dict__, "layers": 16})
    tokens = 16384
    per_layer = {
        checkpointed: (
            pass_bytes(deeper, tokens, checkpointed=checkpointed)
            - pass_bytes(SHAPE, tokens, checkpointed=checkpointed)
        )
        / (8 * tokens)
        for checkpointed in (True, False)
    }
    assert per_layer[True] == pytest.approx(estimate.ACTIVATION_SAFETY * 64 * 4, rel=1e-3)
    assert per_layer[False] > 20 * per_layer[True]


def test_auto_checkpoints_only_a_pass_that_does_not_fit_without(deep_dir):
    request = ForwardBackwardRequest((sample(2000), sample(1800, 1)), CE)
    engine = engine_for(deep_dir, "auto", LORA)
    peaks = {}
    for mode in ("off", "on"):
        engine.config = EngineConfig(device="cpu", activation_checkpointing=mode)
        peaks[mode] = engine.peak_bytes("r", FB, [("s", request)])
    assert peaks["on"] < peaks["off"] / 3
    engine.config = EngineConfig(device="cpu")  # auto, room for either
    assert engine.peak_bytes("r", FB, [("s", request)]) == peaks["off"]
    # A limit between the two: auto counts and runs the checkpointed pass.
    between = _rss_bytes() + (peaks["on"] + peaks["off"]) // 2
    engine.config = EngineConfig(device="cpu", memory_limit=between)
    assert engine.peak_bytes("r", FB, [("s", request)]) == peaks["on"]
    attention = decoder_layers(engine._resource("r").loaded.model)[0].self_attn
    with counted([attention]) as calls:
        (result,) = engine.forward_backward_batch("r", [("s", request)])
    assert not isinstance(result, Exception)
    assert calls == [2]  # the forward, and its recompute in the backward


def test_a_pass_that_does_not_fit_even_checkpointed_is_refused_before_it_runs(deep_dir):
    engine = engine_for(deep_dir, "on", LORA)
    request = ForwardBackwardRequest((sample(2000),), CE)
    checkpointed = engine.peak_bytes("r", FB, [("s", request)])
    limit = _rss_bytes() + checkpointed // 2
    engine.config = EngineConfig(device="cpu", memory_limit=limit)
    room = engine.headroom("r")
    passes, refused = plan_passes(
        FB, [request], lambda rs: engine.peak_bytes("r", FB, [("s", r) for r in rs]), room
    )
    assert passes == [] and list(refused) == [0]
    assert "forward-backward would need an estimated" in refused[0].message
    assert engine._session("r", "s")[1].optimizer.full_gradients() == {}  # nothing ran


def test_fsdp2_ranks_train_checkpointed_what_one_process_does(tmp_path, monkeypatch):
    """Two gloo ranks sharding a full-weight session with FSDP2 (parameters gathered per layer
    by hooks that stay outside the checkpoint), checkpointed, against one process without."""
    monkeypatch.setattr(helpers, "BATCHES", helpers.UNEVEN)
    monkeypatch.setattr(helpers, "WEIGHTS", helpers.UNEVEN_WEIGHTS)
    local = LocalEngine(
        EngineConfig(device="cpu", bucket_overhead_tokens=0, activation_checkpointing="off"),
        helpers.MODELS,
    )
    helpers.fresh(local, "r", None)
    expected = helpers.train(local, "r", tmp_path / "local", None, steps=2)
    group = TrainerGroupEngine(
        EngineConfig(
            device="cpu", trainer_ranks=2, bucket_overhead_tokens=0, activation_checkpointing="on"
        ),
        helpers.MODELS,
    )
    try:
        helpers.fresh(group, "g", None)
        actual = helpers.train(group, "g", tmp_path / "group", None, steps=2)
    finally:
        group.close()
    helpers.assert_runs_equal(actual, expected)


def test_auto_leaves_a_model_too_shallow_to_gain_unchecked(qwen3_dir):
    """Two layers: the checkpointed peak (inputs, and one layer recomputed with its gradients)
    is no lower, so auto runs and counts the pass as it is, even where it does not fit."""
    request = ForwardBackwardRequest((sample(200),), CE)
    engine = engine_for(qwen3_dir, "off", LORA)
    off = engine.peak_bytes("r", FB, [("s", request)])
    engine.config = EngineConfig(device="cpu", activation_checkpointing="on")
    assert engine.peak_bytes("r", FB, [("s", request)]) >= off
    engine.config = EngineConfig(device="cpu", memory_limit=_rss_bytes() + off // 2)
    assert engine.peak_bytes("r", FB, [("s", request)]) == off
