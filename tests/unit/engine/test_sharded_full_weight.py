"""A full-weight session on a trainer group of two gloo ranks, sharded with FSDP2
(engine/parallel/fsdp.py) with its layers kept gathered from forward to backward
(`--shard-parameters off`): a checkpoint with optimizer state written by two ranks resumes on
one and on two, one written by one process resumes on two, and every resumed run continues as
the one-process run does. The padding forwards that keep the ranks' collectives in step leave
logprobs and gradients the same bit for bit. The helpers here (batches, training loops,
comparisons) serve test_fsdp_full_weight.py, which tests the default sharding against one
process in full."""

from __future__ import annotations

import itertools
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_calls import forward_backward

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, BUILTIN_MODELS, EngineConfig
from posttrain.engine.checkpoint import durable
from posttrain.engine.checkpoint import formats as weights
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.hosts.ranks.trainer_group import TrainerGroupEngine
from posttrain.engine.parallel.data_parallel import DataParallel
from posttrain.engine.train import trainer
from posttrain.engine.train.batching import pack
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
    OptimStepRequest,
    TrainingSample,
)

CONFIG = EngineConfig(device="cpu")
# FSDP2 with each layer gathered from its forward to its backward (shard_parameters off).
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


# Bucket overhead 0 gives one forward per distinct length, so the ranks' shares of THREE
# (lengths 7 | 5, 3) take 1 and 2 buckets, and ONE leaves rank 1 without rows: both ranks must
# still run the same layer calls (trainer.aligned_forwards).
PER_LENGTH = EngineConfig(device="cpu", bucket_overhead_tokens=0)
ONE = ForwardBackwardRequest((rl_sample([50, 51, 52, 53, 54, 55], 0.3),), GRPO)
UNEVEN = (BATCHES[0], ONE, BATCHES[1])
# These batches' gradients differ from one process's by float32 rounding (1e-5 relative, as
# above), and AdamW (eps 1e-6) turns the rounding of a near-zero gradient entry into up to
# 4.4e-5 of weight after three steps: measured the same, to the bit, with the parameters
# replicated (the ZeRO-2 this replaced), so it is not the parameter sharding's; FSDP2's
# reduce-scattered slices measured 9.5e-5 at most.
UNEVEN_WEIGHTS = 10 * WEIGHTS


MOE = "posttrain/tiny-qwen3-moe"
WITH_MOE = {**MODELS, MOE: BUILTIN_MODELS[MOE]}


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


def _need(engine, resource: str, kind, request) -> tuple[int, int]:
    """Resident bytes of the resource and the estimated peak of one operation beyond them."""
    resident = engine.resource_footprint(resource).total_bytes
    return resident, engine.peak_bytes(resource, kind, [("f", request)])


def test_padding_forwards_leave_logprobs_and_gradients_the_same_bit_for_bit():
    """trainer.forward_logprobs with `forwards` beyond its buckets (what a sharded rank with
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
