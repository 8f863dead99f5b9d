"""Length buckets: the plan (engine/train/buckets.py) and bucketed training forwards in LocalEngine,
which must equal one padded forward over the whole batch."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.train.buckets import assemble, bucket_routing, plan_buckets
from posttrain.types import (
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    TrainingSample,
)

CE = LossConfig(LossType.CROSS_ENTROPY)
IS = LossConfig(LossType.IMPORTANCE_SAMPLING)
ONE_FORWARD = 10**9  # an overhead no padding outweighs: the whole batch in one padded forward


def padded_tokens(lengths: list[int], buckets: list[list[int]]) -> int:
    return sum(len(rows) * max(lengths[row] for row in rows) for rows in buckets)


def brute_force_cost(lengths: list[int], overhead: int) -> int:
    """Cheapest grouping over every set partition of the rows (not only contiguous ones)."""

    def partitions(items: list[int]):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for partition in partitions(rest):
            yield [[first], *partition]
            for index in range(len(partition)):
                yield [*partition[:index], [first, *partition[index]], *partition[index + 1 :]]

    return min(
        padded_tokens(lengths, p) + overhead * len(p) for p in partitions(list(range(len(lengths))))
    )


# ------------------------------------------------------------------ the plan


@pytest.mark.parametrize("overhead", [0, 1, 256, ONE_FORWARD])
def test_equal_lengths_are_one_forward(overhead):
    assert plan_buckets([7] * 5, overhead) == [[0, 1, 2, 3, 4]]


def test_spread_lengths_make_several_buckets_of_similar_rows():
    lengths = [1000, 10, 990, 12, 11, 1010]
    assert plan_buckets(lengths, 64) == [[1, 3, 4], [0, 2, 5]]


@pytest.mark.parametrize("seed", range(5))
def test_every_row_lands_in_exactly_one_bucket_in_length_order(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
    for overhead in (0, 8, 64, 512):
        buckets = plan_buckets(lengths, overhead)
        assert sorted(itertools.chain(*buckets)) == list(range(len(lengths)))
        assert all(rows == sorted(rows) for rows in buckets)
        # Buckets are contiguous in length: each one's rows are no longer than the next's.
        for shorter, longer in itertools.pairwise(buckets):
            assert max(lengths[r] for r in shorter) < min(lengths[r] for r in longer)


def test_overhead_trades_forwards_for_padding():
    rng = random.Random(0)
    lengths = [rng.randint(64, 1024) for _ in range(32)]
    plans = [plan_buckets(lengths, overhead) for overhead in (0, 16, 256, 4096, ONE_FORWARD)]
    forwards = [len(plan) for plan in plans]
    padding = [padded_tokens(lengths, plan) for plan in plans]
    assert forwards == sorted(forwards, reverse=True) and padding == sorted(padding)
    assert forwards[0] == len(set(lengths)) and padding[0] == sum(lengths)  # no padding at all
    assert forwards[-1] == 1 and padding[-1] == len(lengths) * max(lengths)


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_is_as_cheap_as_any_grouping(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 7))]
    overhead = rng.choice([0, 3, 10, 40])
    plan = plan_buckets(lengths, overhead)
    cost = padded_tokens(lengths, plan) + overhead * len(plan)
    assert cost == brute_force_cost(lengths, overhead)


@pytest.mark.parametrize("seed", range(20))
def test_no_row_is_padded_by_more_than_one_forwards_overhead(seed):
    """A long row (32k tokens among RL-sized ones) is never padded to a bucket far above it:
    a row padded by more than the overhead would make splitting its bucket below it cheaper,
    so the optimal plan pads every row by at most `overhead_tokens`."""
    rng = random.Random(seed)
    overhead = 256
    lengths = [32768, 32768 - rng.randrange(600)]
    lengths += [rng.randrange(64, 32768) for _ in range(rng.randrange(1, 20))]
    for bucket in plan_buckets(lengths, overhead):
        width = max(lengths[row] for row in bucket)
        assert all(width - lengths[row] <= overhead for row in bucket), (lengths, bucket)


def test_routing_is_re_expressed_in_bucket_positions():
    routing = [("a", range(0, 3)), ("b", range(3, 6)), ("all", None)]
    assert bucket_routing(routing, [1, 4, 5]) == [("a", [0]), ("b", [1, 2]), ("all", None)]
    # A session without rows in the bucket is left out; one covering it all applies to all.
    assert bucket_routing(routing, [3, 5]) == [("b", None), ("all", None)]


def test_assemble_restores_batch_order_with_zero_padding_and_gradients():
    buckets = [[1, 3], [0, 2]]
    short = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    long = torch.tensor([[5.0, 6.0, 7.0], [8.0, 9.0, 10.0]], requires_grad=True)
    whole = assemble([short, long], buckets, 4)
    expected = [[5, 6, 7, 0], [1, 2, 0, 0], [8, 9, 10, 0], [3, 4, 0, 0]]
    assert whole.tolist() == expected
    (whole * torch.arange(4.0).repeat(4, 1)).sum().backward()
    assert short.grad.tolist() == [[0, 1], [0, 1]] and long.grad.tolist() == [[0, 1, 2]] * 2


# ------------------------------------------------------------------ bucketed engine passes


def make_engine(overhead: int, train_unembed: bool) -> LocalEngine:
    config = EngineConfig(device="cpu", bucket_overhead_tokens=overhead, logprob_chunk_tokens=16)
    engine = LocalEngine(config, {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR})
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    for index, name in enumerate(("a", "b")):
        lora = LoraConfig(rank=4, alpha=8, seed=index, train_unembed=train_unembed)
        engine.create_session("r", name, lora)
        # Non-zero B so each adapter changes the model and the two sessions differ.
        with torch.no_grad():
            for param_name, p in engine._session("r", name)[1].optimizer.named_params:
                if param_name.endswith("lora_B"):
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(10 + index))
    return engine


def sample(length: int, seed: int) -> TrainingSample:
    """A sample of `length` random tokens, its targets, and IS inputs (all losses ignore extra
    keys they do not use)."""
    rng = random.Random(seed)
    tokens = [rng.randrange(3, 99) for _ in range(length + 1)]
    return TrainingSample(
        tuple(tokens[:-1]),
        {
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": tuple(rng.uniform(0.5, 1.5) for _ in range(length)),
            "logprobs": (-5.0,) * length,
            "advantages": tuple(rng.uniform(-1, 1) for _ in range(length)),
        },
    )


# Lengths interleave so both sessions have rows in several buckets, and some buckets hold rows
# of both sessions.
LENGTHS = {"a": [3, 17, 9, 30, 12], "b": [30, 5, 9, 21, 17, 4]}
REQUESTS = {
    "a": ForwardBackwardRequest(
        tuple(sample(n, i) for i, n in enumerate(LENGTHS["a"])), CE, return_loss_fn_outputs=True
    ),
    "b": ForwardBackwardRequest(
        tuple(sample(n, 100 + i) for i, n in enumerate(LENGTHS["b"])),
        IS,
        return_loss_fn_outputs=True,
    ),
}


def gradients(engine: LocalEngine, name: str) -> dict[str, torch.Tensor]:
    session = engine._session("r", name)[1]
    return {n: p.grad.clone() for n, p in session.optimizer.named_params if p.grad is not None}


def assert_same_gradients(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and got
    for key in want:
        error = float((got[key] - want[key]).norm()) / max(float(want[key].norm()), 1e-12)
        assert error <= 1e-5, (key, error)


def test_the_shared_pass_lands_in_several_mixed_buckets():
    merged = LENGTHS["a"] + LENGTHS["b"]
    buckets = plan_buckets(merged, 0)
    owners = [{"a" if row < len(LENGTHS["a"]) else "b" for row in rows} for rows in buckets]
    assert len(buckets) > 3 and sum(owner == {"a", "b"} for owner in owners) >= 2


@pytest.mark.parametrize("train_unembed", [False, True])
def test_bucketed_shared_pass_equals_one_padded_forward(train_unembed):
    """Two sessions with different adapters and losses, rows in several buckets: same losses,
    logprobs and LoRA gradients as one padded forward (both head paths of
    engine/train/logprobs.py)."""
    items = [(name, REQUESTS[name]) for name in ("a", "b")]
    padded = make_engine(ONE_FORWARD, train_unembed)
    bucketed = make_engine(0, train_unembed)
    want = padded.forward_backward_batch("r", items)
    got = bucketed.forward_backward_batch("r", items)
    for name, result, reference in zip(("a", "b"), got, want, strict=True):
        assert not isinstance(result, Exception) and not isinstance(reference, Exception)
        assert result.loss == pytest.approx(reference.loss, rel=1e-5)
        for row, expected in zip(result.loss_fn_outputs, reference.loss_fn_outputs, strict=True):
            torch.testing.assert_close(torch.tensor(row), torch.tensor(expected), rtol=0, atol=1e-5)
        assert_same_gradients(gradients(bucketed, name), gradients(padded, name))


def test_bucketed_custom_forward_backward_equals_one_padded_forward():
    samples = REQUESTS["a"].samples
    rng = random.Random(0)
    request = CustomForwardBackwardRequest(
        samples, tuple(tuple(rng.uniform(-1, 1) for _ in s.tokens) for s in samples)
    )
    padded, bucketed = make_engine(ONE_FORWARD, True), make_engine(0, True)
    padded.custom_forward_backward("r", "a", request)
    bucketed.custom_forward_backward("r", "a", request)
    assert_same_gradients(gradients(bucketed, "a"), gradients(padded, "a"))
