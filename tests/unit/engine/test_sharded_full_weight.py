"""A full-weight session on a trainer group of two gloo ranks shards its gradients and optimizer
state (engine/parallel/zero2.py) and still computes what one LocalEngine does: losses and gradients
within 1e-5 relative, weights after several AdamW and Muon steps within float32 rounding.
Each rank holds about half the optimizer state and gradients, together exactly one process's;
a checkpoint with optimizer state written by two ranks resumes on one and on two, one written
by one process resumes on two, and every resumed run continues as the one-process run does.
With the parameters sharded too (ZeRO-3), the built-in loss and a client's custom
forward-backward train what one process does, each rank holding its share of the weights."""

from __future__ import annotations

import itertools
import sys
import types
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_calls import forward_backward

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, BUILTIN_MODELS, EngineConfig
from posttrain.engine.checkpoint import durable
from posttrain.engine.checkpoint import formats as weights
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.hosts.messages import Command
from posttrain.engine.hosts.trainer_group import TrainerGroupEngine
from posttrain.engine.interface import Headroom
from posttrain.engine.parallel.data_parallel import DataParallel
from posttrain.engine.parallel.zero2 import Sharding
from posttrain.engine.train import trainer
from posttrain.engine.train.batching import pack
from posttrain.errors import NonFiniteLoss
from posttrain.service.admission import plan_passes
from posttrain.types import (
    AdamParams,
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    GrpoAggregation,
    GrpoParams,
    LossConfig,
    LossType,
    MuonParams,
    MuonScaling,
    OperationKind,
    OptimStepRequest,
    TrainingSample,
)

CONFIG = EngineConfig(device="cpu")
# ZeRO-2: parameters replicated (shard_parameters off); ZERO3 below shards them too.
GROUP = EngineConfig(device="cpu", trainer_ranks=2, shard_parameters=False)
MODELS = {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}
# eps above the gradients' rounding noise, as in test_trainer_group.py (whose comment says why).
LEARNING_RATE = 1e-2
ADAM = AdamParams(learning_rate=LEARNING_RATE, eps=1e-6)
STEPS = {
    None: OptimStepRequest(adam=ADAM),
    MuonScaling.MATCH_ADAM: OptimStepRequest(
        muon=MuonParams(learning_rate=LEARNING_RATE, weight_decay=0.01, adam=ADAM)
    ),
}
_HUGE_ADAM = AdamParams(learning_rate=1e308)
HUGE = {
    None: OptimStepRequest(adam=_HUGE_ADAM),
    MuonScaling.MATCH_ADAM: OptimStepRequest(muon=MuonParams(learning_rate=1e308, adam=_HUGE_ADAM)),
}
# Row-split rounding of ranks against one process, as in test_trainer_group.py (whose comment
# gives the measurements).
WEIGHTS = 1e-2 * LEARNING_RATE  # a hundredth of a step
REL = 1e-4
CE = LossConfig(LossType.CROSS_ENTROPY)
GRPO = LossConfig(LossType.GRPO, GrpoParams(agg_type=GrpoAggregation.TOKEN_MEAN))


def rl_sample(tokens: list[int], advantage: float) -> TrainingSample:
    n = len(tokens) - 1
    return TrainingSample(
        tokens=tuple(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": tuple(float(i % 3 != 0) for i in range(n)),
            "logprobs": tuple(-2.0 - 0.1 * i for i in range(n)),
            "advantages": (advantage,) * n,
        },
    )


THREE = (
    rl_sample([5, 6, 7, 8, 9, 10, 11, 12], 1.0),
    rl_sample([13, 14, 15, 16], -0.5),
    rl_sample([20, 21, 22, 23, 24, 25], 0.25),
)
TWO = (rl_sample([30, 31, 32, 33, 34], 0.7), rl_sample([40, 41, 42], -1.0))
BATCHES = (ForwardBackwardRequest(THREE, CE), ForwardBackwardRequest(TWO, GRPO))

_dirs = itertools.count()


@pytest.fixture(scope="module")
def group():
    engine = TrainerGroupEngine(GROUP, MODELS)
    yield engine
    engine.close()


def state(engine, resource: str, root: Path, parts: tuple[str, ...]) -> dict:
    """Session f's parts as the engine persists them (a group: gathered onto rank 0)."""
    directory = root / f"state-{next(_dirs)}"
    engine.persist_session(resource, "f", directory, parts, {})
    return durable.read(directory)[0]


def train(engine, resource: str, root: Path, scaling, steps: int) -> list:
    """`steps` forward-backwards and optim-steps; the loss, gradients and weights of each."""
    seen = []
    for index in range(steps):
        result = forward_backward(engine, resource, "f", BATCHES[index % len(BATCHES)])
        gradients = state(engine, resource, root, ("gradients",))["gradients"]
        engine.optim_step(resource, "f", STEPS[scaling])
        trained = state(engine, resource, root, ("trainer",))["trainer"]
        seen.append((result.loss, gradients, trained))
    return seen


def fresh(engine, resource: str, scaling) -> None:
    if not engine.is_loaded(resource):
        engine.load_resource(resource, BUILTIN_MODEL_ID, muon_scaling=scaling)
    engine.create_session(resource, "f", None)


def assert_runs_equal(actual: list, expected: list) -> None:
    """Losses within 1e-5; the first step's gradients (same weights) within 1e-5, later ones
    within 1e-4: the weights then differ by float32 rounding (a few ulps), which a gradient can
    amplify (measured: 1.15e-5 for a k_norm weight at the second step, identical on main's
    replicated ranks, so not from the sharding); weights within a thousandth of a step."""
    assert len(actual) == len(expected)
    for index, ((loss, grads, weights_), (want_loss, want_grads, want_weights)) in enumerate(
        zip(actual, expected, strict=True)
    ):
        assert loss == pytest.approx(want_loss, rel=REL)
        assert grads.keys() == want_grads.keys() and want_grads
        for name, want in want_grads.items():
            error = torch.linalg.vector_norm(grads[name] - want) / torch.linalg.vector_norm(want)
            assert float(error) <= (REL if index == 0 else 10 * REL), (index, name, float(error))
        assert weights_.keys() == want_weights.keys()
        for name, want in want_weights.items():
            assert float((weights_[name] - want).abs().max()) <= WEIGHTS, name


def test_owners_are_balanced_by_bytes_and_the_same_on_every_rank():
    sizes = {"embed": (64, 8), "a": (16, 8), "b": (16, 8), "c": (8, 8), "norm": (8,)}
    named = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in sizes.items()]
    ranks = [Sharding.over(DataParallel(rank, 2), named) for rank in range(2)]
    assert ranks[0].owners == ranks[1].owners
    # Largest first, each to the rank holding the fewest bytes: embed | a, b, c, norm.
    assert ranks[0].owners == {"embed": 0, "a": 1, "b": 1, "c": 1, "norm": 1}
    assert [r.owns("embed") for r in ranks] == [True, False]
    assert Sharding.over(DataParallel(0, 1), named) is None
    assert Sharding.over(None, named) is None


@pytest.mark.parametrize("scaling", [None, MuonScaling.MATCH_ADAM], ids=["adamw", "muon"])
def test_two_sharded_ranks_train_what_one_process_does_with_half_the_state(
    group, tmp_path, scaling
):
    local = LocalEngine(CONFIG, MODELS)
    fresh(local, "r", scaling)
    expected = train(local, "r", tmp_path / "local", scaling, steps=3)
    # Clipping binds (the first norm is above the default grad_clip_norm 1.0), so each rank
    # must clip with the exact norm over every rank's gradients.
    first = expected[0][1].values()
    assert (
        float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in first])))
        > 1
    )
    resource = f"full-{scaling}"
    fresh(group, resource, scaling)
    assert_runs_equal(train(group, resource, tmp_path / "group", scaling, steps=3), expected)

    # Optimizer state: each rank holds its own parameters' share, together one process's.
    one = local.session_footprint("r", "f")
    ranks = group.on_every_rank(resource, Command.SESSION_FOOTPRINT, "f")
    named = local._session("r", "f")[1].optimizer.named_params
    largest = max(p.numel() * p.element_size() for _, p in named)
    state_per_byte = one.optimizer_bytes / one.weights_bytes  # 2 moments (AdamW), fewer (Muon)
    assert sum(r.optimizer_bytes for r in ranks) == one.optimizer_bytes > 0
    for rank in ranks:
        assert rank.optimizer_bytes <= one.optimizer_bytes / 2 + 2 * largest * state_per_byte
        assert rank.weights_bytes == one.weights_bytes  # parameters stay replicated
    # Accumulated gradients likewise, until the next step.
    forward_backward(local, "r", "f", BATCHES[0])
    forward_backward(group, resource, "f", BATCHES[0])
    one = local.session_footprint("r", "f")
    ranks = group.on_every_rank(resource, Command.SESSION_FOOTPRINT, "f")
    assert sum(r.gradient_bytes for r in ranks) == one.gradient_bytes > 0
    assert all(r.gradient_bytes <= one.gradient_bytes / 2 + largest for r in ranks)

    # A step that would overflow the weights fails alike on every rank (they agree on the
    # copy-backed path's outcome) and changes nothing; the next step equals one process's.
    for engine, name in ((local, "r"), (group, resource)):
        with pytest.raises(NonFiniteLoss, match="unchanged"):
            engine.optim_step(name, "f", HUGE[scaling])
        engine.optim_step(name, "f", STEPS[scaling])
    want = state(local, "r", tmp_path / "local", ("trainer",))["trainer"]
    got = state(group, resource, tmp_path / "group", ("trainer",))["trainer"]
    assert all(float((got[n] - want[n]).abs().max()) <= WEIGHTS for n in want)
    group.unload_resource(resource)


def checkpoint(engine, resource: str, directory: Path) -> Path:
    directory.mkdir(parents=True)
    engine.save_training_state(resource, "f", directory)
    return directory


def resumed(engine, resource: str, directory: Path, root: Path, scaling) -> list:
    """A fresh session that resumes from `directory` and trains two more steps."""
    if engine.is_loaded(resource):
        engine.drop_session(resource, "f")  # a no-op without one
    fresh(engine, resource, scaling)
    engine.load_training_state(resource, "f", directory, load_optimizer=True)
    return train(engine, resource, root, scaling, steps=2)


def test_checkpoints_resume_across_rank_counts(group, tmp_path):
    """Under Muon (momentum buffers and a nested AdamW group): a checkpoint from two ranks
    resumes on one and on two, one from one process on two, and each continues as one
    process continues from it."""
    scaling = MuonScaling.MATCH_ADAM
    fresh(group, "ckpt", scaling)
    train(group, "ckpt", tmp_path / "a", scaling, steps=2)
    from_two = checkpoint(group, "ckpt", tmp_path / "from-two")
    local = LocalEngine(CONFIG, MODELS)
    fresh(local, "r", scaling)
    train(local, "r", tmp_path / "b", scaling, steps=2)
    from_one = checkpoint(local, "r", tmp_path / "from-one")
    # Two ranks write what one process writes: every parameter's state, in the same layout.
    two, one = weights.load_training_state(from_two), weights.load_training_state(from_one)
    for family in ("adam", "muon"):
        assert two.optimizer[family].keys() == one.optimizer[family].keys()
        assert one.optimizer[family]
    assert two.tensors.keys() == one.tensors.keys()

    for directory in (from_two, from_one):
        expected = resumed(local, "r", directory, tmp_path / f"{directory.name}-1", scaling)
        actual = resumed(group, "ckpt", directory, tmp_path / f"{directory.name}-2", scaling)
        assert_runs_equal(actual, expected)
    group.unload_resource("ckpt")


# ZeRO-3 (engine/parallel/zero3.py): parameters sharded too. Bucket overhead 0 gives one forward
# per distinct length, so the ranks' shares of THREE (lengths 7 | 5, 3) take 1 and 2 buckets,
# and ONE leaves rank 1 without rows: both ranks must still run the same layer calls.
ZERO3 = EngineConfig(device="cpu", trainer_ranks=2, shard_parameters=True, bucket_overhead_tokens=0)
PER_LENGTH = EngineConfig(device="cpu", bucket_overhead_tokens=0)
ONE = ForwardBackwardRequest((rl_sample([50, 51, 52, 53, 54, 55], 0.3),), GRPO)
UNEVEN = (BATCHES[0], ONE, BATCHES[1])
# These batches' gradients differ from one process's by float32 rounding (1e-5 relative, as
# above), and AdamW (eps 1e-6) turns the rounding of a near-zero gradient entry into up to
# 4.4e-5 of weight after three steps: measured the same, to the bit, with the parameters
# replicated (ZeRO-2, shard_parameters off), so it is not the parameter sharding's.
UNEVEN_WEIGHTS = 10 * WEIGHTS


MOE = "posttrain/tiny-qwen3-moe"
WITH_MOE = {**MODELS, MOE: BUILTIN_MODELS[MOE]}


@pytest.fixture(scope="module")
def zero3():
    engine = TrainerGroupEngine(ZERO3, WITH_MOE)
    yield engine
    engine.close()


def assert_each_rank_holds_its_share(local, zero3, resource: str) -> tuple[Any, list[Any]]:
    """Session "f": weights, optimizer state and gradients, each rank its own parameters' share
    (whole parameters, so within one parameter of half), together exactly one process's (the
    one-process session "f" of resource "r"). Returns both footprints."""
    one = local.session_footprint("r", "f")
    ranks = zero3.on_every_rank(resource, Command.SESSION_FOOTPRINT, "f")
    named = local._session("r", "f")[1].optimizer.named_params
    largest = max(p.numel() * p.element_size() for _, p in named)
    for part in ("weights_bytes", "optimizer_bytes", "gradient_bytes"):
        total = getattr(one, part)
        assert sum(getattr(r, part) for r in ranks) == total > 0, part
        assert all(getattr(r, part) <= total / 2 + 2 * largest for r in ranks), part
    return one, ranks


@pytest.mark.parametrize("scaling", [None, MuonScaling.MATCH_ADAM], ids=["adamw", "muon"])
def test_zero3_ranks_train_what_one_process_does_holding_half_the_weights(
    zero3, tmp_path, scaling, monkeypatch
):
    monkeypatch.setattr(sys.modules[__name__], "BATCHES", UNEVEN)
    monkeypatch.setattr(sys.modules[__name__], "WEIGHTS", UNEVEN_WEIGHTS)
    local = LocalEngine(PER_LENGTH, MODELS)
    fresh(local, "r", scaling)
    expected = train(local, "r", tmp_path / "local", scaling, steps=3)
    resource = f"zero3-{scaling}"
    fresh(zero3, resource, scaling)
    assert_runs_equal(train(zero3, resource, tmp_path / "group", scaling, steps=3), expected)

    # Weights, optimizer state and gradients: each rank holds its own parameters' share
    # (whole parameters, so within one parameter of half), together exactly one process's.
    forward_backward(local, "r", "f", ONE)
    forward_backward(zero3, resource, "f", ONE)
    one, ranks = assert_each_rank_holds_its_share(local, zero3, resource)
    # The generator's copy, which sampling uses, is rank 0's alone.
    assert [r.generator_bytes for r in ranks] == [one.generator_bytes, 0]

    # weights-sync gathers the shards into the generator's copy, exactly the trained weights.
    zero3.discard_gradients(resource, "f")
    zero3.publish(resource, "f", version=1)
    parts = state(zero3, resource, tmp_path / "group", ("trainer", "generator"))
    # The generator's copy keeps model/lora.py's wrapper names (`<layer>.base.weight`).
    served = {n.replace(".base.", "."): t for n, t in parts["generator"].items()}
    assert served.keys() == parts["trainer"].keys()
    assert all(torch.equal(served[n], t) for n, t in parts["trainer"].items())
    zero3.unload_resource(resource)


# A client's own losses (custom forward-backward), from the logprobs the forward pass returns.
# DPO on (chosen, rejected) pairs of lengths (9, 3), (4, 3), which the ranks share as 9 | 3, 4, 3:
# 1 and 2 buckets; then a weighted logprob of ONE's one sample, which leaves rank 1 without
# rows in both passes.
DPO_BETA = 0.5
PAIRS = (
    rl_sample(list(range(60, 70)), 1.0),
    rl_sample([13, 14, 15, 16], -0.5),
    rl_sample([30, 31, 32, 33, 34], 0.7),
    rl_sample([40, 41, 42, 43], -1.0),
)


def dpo_loss(logprobs: list[torch.Tensor], samples: tuple[TrainingSample, ...]) -> torch.Tensor:
    """-log sigmoid(beta * (chosen - rejected)), each sequence's weighted logprob taken
    relative to its reference (the samples' `logprobs` input)."""
    relative = [
        (
            torch.tensor(s.loss_fn_inputs["weights"])
            * (x - torch.tensor(s.loss_fn_inputs["logprobs"]))
        ).sum()
        for x, s in zip(logprobs, samples, strict=True)
    ]
    margins = torch.stack(relative[0::2]) - torch.stack(relative[1::2])
    return -torch.nn.functional.logsigmoid(DPO_BETA * margins).mean()


def weighted_logprob_loss(
    logprobs: list[torch.Tensor], samples: tuple[TrainingSample, ...]
) -> torch.Tensor:
    return -sum(
        (torch.tensor(s.loss_fn_inputs["advantages"]) * x).mean()
        for x, s in zip(logprobs, samples, strict=True)
    )


CUSTOM = ((dpo_loss, PAIRS), (weighted_logprob_loss, ONE.samples))


def custom_train(engine, resource: str, root: Path) -> tuple[list, list]:
    """Each of CUSTOM as the SDK's forward_backward_custom runs it (api.md 1.4.3): a forward-only
    cross-entropy pass with unit weights returning every token's logprob, the client's loss and
    its gradient w.r.t. those logprobs by autograd, a custom forward-backward with that
    gradient; then optim-step. The forward passes' results; the client's loss, the gradients
    and the weights of each step."""
    forwards, seen = [], []
    for client_loss, samples in CUSTOM:
        unit = tuple(
            replace(s, loss_fn_inputs={**s.loss_fn_inputs, "weights": (1.0,) * len(s.tokens)})
            for s in samples
        )
        scoring = ForwardBackwardRequest(unit, CE, forward_only=True, return_loss_fn_outputs=True)
        result = forward_backward(engine, resource, "f", scoring)
        logprobs = [torch.tensor(row, requires_grad=True) for row in result.loss_fn_outputs]
        loss = client_loss(logprobs, samples)
        loss.backward()
        gradients = tuple(tuple(x.grad.tolist()) for x in logprobs)
        request = CustomForwardBackwardRequest(samples, gradients)
        engine.custom_forward_backward(resource, "f", request)
        accumulated = state(engine, resource, root, ("gradients",))["gradients"]
        engine.optim_step(resource, "f", STEPS[None])
        trained = state(engine, resource, root, ("trainer",))["trainer"]
        forwards.append(result)
        seen.append((float(loss.detach()), accumulated, trained))
    return forwards, seen


def test_zero3_custom_forward_backward_trains_what_one_process_does_holding_half_the_weights(
    zero3, tmp_path, monkeypatch
):
    # The weights differ from one process's by up to 8.7e-6 after either step (a v_proj
    # entry, AdamW eps 1e-6 on a gradient's rounding as above): measured the same, to the bit,
    # with the parameters replicated (ZeRO-2), so not the parameter sharding's.
    monkeypatch.setattr(sys.modules[__name__], "WEIGHTS", UNEVEN_WEIGHTS)
    local = LocalEngine(PER_LENGTH, MODELS)
    fresh(local, "r", None)
    expected_forwards, expected = custom_train(local, "r", tmp_path / "local")
    fresh(zero3, "custom3", None)
    forwards, actual = custom_train(zero3, "custom3", tmp_path / "group")

    # The forward passes: every token's logprob, the loss and the metrics within 1e-5.
    for got, want in zip(forwards, expected_forwards, strict=True):
        assert got.loss == pytest.approx(want.loss, rel=REL)
        assert got.metrics.keys() == want.metrics.keys()
        assert got.metrics == pytest.approx(want.metrics, rel=REL)
        assert len(got.loss_fn_outputs) == len(want.loss_fn_outputs)
        for got_row, want_row in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
            assert len(got_row) == len(want_row)
            assert got_row == pytest.approx(want_row, rel=REL)
    # The client's losses, the gradients the custom passes accumulate, the weights after.
    assert_runs_equal(actual, expected)

    # Each rank holds its own parameters' share of the weights and optimizer state after the
    # steps, and of the gradients a custom forward-backward accumulates.
    one_sample = CustomForwardBackwardRequest(ONE.samples, ((0.5, -0.25, 1.0, 0.0, -1.0),))
    local.custom_forward_backward("r", "f", one_sample)
    zero3.custom_forward_backward("custom3", "f", one_sample)
    assert_each_rank_holds_its_share(local, zero3, "custom3")
    zero3.unload_resource("custom3")


def test_zero3_trains_an_moe_model_as_one_process_does(zero3):
    """The MoE model's experts (fused 3-D parameters) shard and gather like any layer's."""
    local = LocalEngine(PER_LENGTH, WITH_MOE)
    for engine in (local, zero3):
        engine.load_resource("moe", MOE, muon_scaling=None)
        engine.create_session("moe", "f", None)
    for batch in UNEVEN:
        want = forward_backward(local, "moe", "f", batch).loss
        assert forward_backward(zero3, "moe", "f", batch).loss == pytest.approx(want, rel=REL)
        for engine in (local, zero3):
            engine.optim_step("moe", "f", STEPS[None])
    ranks = zero3.on_every_rank("moe", Command.SESSION_FOOTPRINT, "f")
    assert sum(r.weights_bytes for r in ranks) == local.session_footprint("moe", "f").weights_bytes
    zero3.unload_resource("moe")


def test_zero3_checkpoints_resume_across_rank_counts_and_sessions_end_unsharded(
    zero3, tmp_path, monkeypatch
):
    """Two ZeRO-3 ranks write what one process writes, a checkpoint from either resumes on
    the other and continues as one process does; a dropped session leaves every rank the
    whole base model."""
    monkeypatch.setattr(sys.modules[__name__], "BATCHES", UNEVEN)
    monkeypatch.setattr(sys.modules[__name__], "WEIGHTS", UNEVEN_WEIGHTS)
    for scaling in (None, MuonScaling.MATCH_ADAM):
        resource = f"ckpt3-{scaling}"
        fresh(zero3, resource, scaling)
        train(zero3, resource, tmp_path / f"a{scaling}", scaling, steps=2)
        from_two = checkpoint(zero3, resource, tmp_path / f"from-two-{scaling}")
        local = LocalEngine(PER_LENGTH, MODELS)
        fresh(local, "r", scaling)
        train(local, "r", tmp_path / f"b{scaling}", scaling, steps=2)
        from_one = checkpoint(local, "r", tmp_path / f"from-one-{scaling}")
        two, one = weights.load_training_state(from_two), weights.load_training_state(from_one)
        assert two.tensors.keys() == one.tensors.keys()
        for family in two.optimizer:
            assert two.optimizer[family].keys() == one.optimizer[family].keys()
        for directory in (from_two, from_one):
            root = tmp_path / f"{directory.name}"
            expected = resumed(local, "r", directory, root / "1", scaling)
            actual = resumed(zero3, resource, directory, root / "2", scaling)
            assert_runs_equal(actual, expected)
        # The session ends: each rank holds the whole base model again, as one process does.
        zero3.drop_session(resource, "f")
        local.drop_session("r", "f")
        assert (
            zero3.on_every_rank(resource, Command.RESOURCE_FOOTPRINT)
            == [local.resource_footprint("r")] * 2
        )
        zero3.unload_resource(resource)


def test_a_memory_limit_that_refuses_a_full_weight_step_on_one_process_admits_it_on_zero3(zero3):
    """Memory admission with the real estimates (peak_bytes, resource_footprint; no clock):
    the first optim-step (its AdamW moments appear) and a forward-backward of a full-weight
    session need resident + peak bytes; under a limit between one process's need and a ZeRO-3
    rank's (the group is admitted on rank 0's numbers), one process is refused and the
    sharded ranks admit it."""
    local = LocalEngine(PER_LENGTH, MODELS)
    fresh(local, "r", None)
    fresh(zero3, "admit", None)
    operations = (
        (OperationKind.OPTIM_STEP, STEPS[None]),
        (OperationKind.FORWARD_BACKWARD, BATCHES[0]),
    )
    for kind, request in operations:
        one, rank = _need(local, "r", kind, request), _need(zero3, "admit", kind, request)
        assert sum(rank) < 0.8 * sum(one), (kind, one, rank)
        limit = (sum(one) + sum(rank)) // 2
        # plan_passes with each engine's real estimate of the one member.
        for engine, resource, (resident, _), admitted in (
            (local, "r", one, False),
            (zero3, "admit", rank, True),
        ):
            room = Headroom(limit - resident, "--memory-limit")
            passes, refused = plan_passes(
                kind,
                ["f"],
                lambda members, e=engine, r=resource, k=kind, q=request: e.peak_bytes(
                    r, k, [(m, q) for m in members]
                ),
                room,
            )
            assert (passes == [["f"]]) is admitted and (0 in refused) is not admitted, kind
    zero3.unload_resource("admit")


def _need(engine, resource: str, kind, request) -> tuple[int, int]:
    """Resident bytes of the resource and the estimated peak of one operation beyond them."""
    resident = engine.resource_footprint(resource).total_bytes
    return resident, engine.peak_bytes(resource, kind, [("f", request)])


def test_padding_forwards_leave_logprobs_and_gradients_the_same_bit_for_bit():
    """trainer.forward_logprobs with `forwards` beyond its buckets (what a ZeRO-3 rank with
    fewer buckets, or none, runs): the extra forwards run, and the logprobs and every gradient
    equal those without them exactly. aligned_forwards gives every rank the most buckets of
    any rank's share."""
    local = LocalEngine(PER_LENGTH, MODELS)
    fresh(local, "r", None)
    resource, session = local._session("r", "f")
    packed = pack(THREE, resource.loaded.device)  # lengths 7, 3, 5
    routing = [(session.trainer_key, None)]
    named = session.optimizer.named_params
    calls = []
    layer = resource.loaded.model.base_model.layers[0]
    handle = layer.register_forward_pre_hook(lambda module, args: calls.append(1))
    weights_ST = torch.linspace(-1.0, 1.0, packed.tokens_ST.numel()).view_as(packed.tokens_ST)

    def run(rows: list[int], forwards: int | None) -> tuple[torch.Tensor, list, int]:
        calls.clear()
        for _, p in named:
            p.grad = None
        logprobs = trainer.forward_logprobs(
            PER_LENGTH, resource, packed, routing, rows=rows, forwards=forwards
        )
        (logprobs * weights_ST[rows]).sum().backward()
        return logprobs.detach(), [p.grad for _, p in named], len(calls)

    try:
        for rows in ([0, 2], [1]):
            plain, plain_grads, plain_calls = run(rows, None)
            padded, padded_grads, padded_calls = run(rows, plain_calls + 2)
            assert padded_calls == plain_calls + 2
            assert torch.equal(padded, plain)
            assert all(
                (g is None and h is None) or torch.equal(g, h)
                for g, h in zip(padded_grads, plain_grads, strict=True)
            )
        # A rank without rows forwards padding alone, and its gradients are exact zeros.
        empty, empty_grads, empty_calls = run([], 2)
        assert empty.shape == (0, packed.tokens_ST.shape[1]) and empty_calls == 2
        assert all(g is None or not g.any() for g in empty_grads)
    finally:
        handle.remove()

    # Two ranks' shares of THREE (7 | 5, 3) plan 1 and 2 buckets, of ONE (6 | none) 1 and 0.
    group = DataParallel(0, 2)
    sharded = types.SimpleNamespace(group=group, param_shards=object())
    assert trainer.aligned_forwards(PER_LENGTH, sharded, [7, 3, 5]) == 2
    assert trainer.aligned_forwards(PER_LENGTH, sharded, [6]) == 1
    replicated = types.SimpleNamespace(group=group, param_shards=None)
    assert trainer.aligned_forwards(PER_LENGTH, replicated, [7, 3, 5]) is None
