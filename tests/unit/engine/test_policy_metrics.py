"""Policy-loss metrics of a request without weights or mask count only the positions that carry
the policy (engine/train/losses.py `policy_positions`), while the loss still reduces over every
position (losses.md 1.3). Closed forms are written here from losses.md, not from the module.

The request is what tinker-cookbook sends once it strips its mask: whole sequences whose prompt
positions hold placeholder sampler logprobs 0 and advantages 0. S = 2 samples of lengths 5 and
3 (prompts of 2 and 1 positions), padded to T = 5.

Legend: S = samples, T = longest sample.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_losses import POLICY_IDS, POLICY_LOSSES  # the same seven policy-loss settings
from torch import Tensor

from posttrain.engine.train.losses import LOSSES, LossBatch, LossOutput
from posttrain.types import (
    DroParams,
    GrpoAggregation,
    GrpoParams,
    GrpoRatioType,
    LossParams,
    LossType,
    PpoParams,
)

Rows = list[list[float]]

# Current logprobs x (the prompt's are far from 0, as a real model's are), sampler logprobs q
# and advantages A; q and A are 0 on the prompt.
X = [[-4.5, -3.9, -0.5, -1.2, -0.3], [-5.1, -0.7, -1.5]]
Q = [[0.0, 0.0, -0.6, -1.0, -0.9], [0.0, -0.2, -1.1]]
A = [[0.0, 0.0, 1.0, -0.5, 2.0], [0.0, 0.8, -1.0]]
REF = [[-4.4, -4.0, -0.4, -1.1, -0.5], [-5.0, -0.9, -1.3]]
COMPLETION = [[0, 0, 1, 1, 1], [0, 1, 1]]
EVERY = [[1] * 5, [1] * 3]


def padded(rows: list[list], fill: float = 0.0, dtype: torch.dtype = torch.float32) -> Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([list(row) + [fill] * (width - len(row)) for row in rows], dtype=dtype)


def make_batch(*, mask: Rows | None = None, logprobs: Rows = Q, advantages: Rows = A) -> LossBatch:
    return LossBatch(
        valid_ST=padded([[True] * len(row) for row in X], False, torch.bool),
        mask_ST=None if mask is None else padded(mask),
        sampler_logprobs_ST=padded(logprobs),
        advantages_ST=padded(advantages),
        reference_logprobs_ST=padded(REF),
    )


def run(loss_type: LossType, params: LossParams, batch: LossBatch) -> tuple[LossOutput, Tensor]:
    """The loss output and d loss / d logprobs_ST by autograd."""
    logprobs_ST = padded(X).requires_grad_(True)
    output = LOSSES[loss_type](logprobs_ST, batch, params)
    output.loss.backward()
    assert logprobs_ST.grad is not None
    return output, logprobs_ST.grad


def mean_over(values: Rows, counted: list[list[int]]) -> float:
    kept = [
        v
        for row, c_row in zip(values, counted, strict=True)
        for v, c in zip(row, c_row, strict=True)
        if c
    ]
    return sum(kept) / len(kept)


def elementwise(fn, *rows_list: Rows) -> Rows:
    return [[fn(*v) for v in zip(*rows, strict=True)] for rows in zip(*rows_list, strict=True)]


def approx(value: float) -> object:
    return pytest.approx(value, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(("loss_type", "params"), POLICY_LOSSES, ids=POLICY_IDS)
def test_unmasked_policy_metrics_count_only_completion_tokens(
    loss_type: LossType, params: LossParams
) -> None:
    output, _ = run(loss_type, params, make_batch())
    metrics = output.metrics
    assert metrics["valid_tokens:sum"] == 5.0  # completion tokens; the prompt's 3 are not counted
    mismatch = mean_over(elementwise(lambda x, q: abs(x - q), X, Q), COMPLETION)
    assert metrics["loss/sampler_mismatch/mean"] == approx(mismatch)
    # Counting the prompt would report its logprobs as mismatch: (13.5 + 1.8) / 8 = 1.91.
    assert mismatch == approx(1.8 / 5)
    if loss_type == LossType.GRPO and params.ratio_type == GrpoRatioType.SEQUENCE:
        return  # its ratio is the sequence ratio, checked below
    log_ratios = elementwise(lambda x, q: x - q, X, Q)
    ratios = elementwise(math.exp, log_ratios)
    assert metrics["loss/ratio/mean"] == approx(mean_over(ratios, COMPLETION))
    assert metrics["loss/kl_policy/mean"] == approx(
        mean_over(elementwise(lambda v: -v, log_ratios), COMPLETION)
    )


@pytest.mark.parametrize(("loss_type", "params"), POLICY_LOSSES, ids=POLICY_IDS)
def test_unmasked_policy_metrics_equal_those_of_the_completion_mask(
    loss_type: LossType, params: LossParams
) -> None:
    unmasked, _ = run(loss_type, params, make_batch())
    masked, _ = run(loss_type, params, make_batch(mask=COMPLETION))
    # The sequence ratio (GSPO) and the loss reduce over every position without a mask.
    differ = {"loss:sum"}
    if loss_type == LossType.GRPO and params.ratio_type == GrpoRatioType.SEQUENCE:
        differ |= {"loss/ratio/mean", "loss/kl_policy/mean", "loss/clip/clipped_ratio/mean"}
        differ |= {"loss/clip/high_fraction", "loss/clip/low_fraction"}
    assert unmasked.metrics.keys() == masked.metrics.keys()
    for key, value in masked.metrics.items():
        if key not in differ:
            assert unmasked.metrics[key] == approx(value), key


def test_unmasked_ppo_clip_fractions_are_shares_of_completion_tokens() -> None:
    # Completion ratios exp(x - q): 1.105 (A 1), 0.819 (A -0.5), 1.822 (A 2) | 0.607 (A 0.8),
    # 0.670 (A -1): one clipped high (1.822 > 1.2, A > 0), one clipped low (0.670 < 0.8, A < 0).
    output, _ = run(LossType.PPO, PpoParams(), make_batch())
    assert output.metrics["loss/clip/high_fraction"] == approx(1 / 5)
    assert output.metrics["loss/clip/low_fraction"] == approx(1 / 5)


def test_unmasked_grpo_sequence_ratio_metric_averages_over_completion_tokens() -> None:
    params = GrpoParams(ratio_type=GrpoRatioType.SEQUENCE)
    output, _ = run(LossType.GRPO, params, make_batch())
    # lambda_i averages x - q over every included position (all of them without a mask).
    lambdas = [
        sum(x - q for x, q in zip(xr, qr, strict=True)) / len(xr)
        for xr, qr in zip(X, Q, strict=True)
    ]
    expected = (3 * math.exp(lambdas[0]) + 2 * math.exp(lambdas[1])) / 5
    assert output.metrics["loss/ratio/mean"] == approx(expected)


@pytest.mark.parametrize(("loss_type", "params"), POLICY_LOSSES, ids=POLICY_IDS)
def test_unmasked_policy_loss_still_includes_every_position(
    loss_type: LossType, params: LossParams
) -> None:
    unmasked, unmasked_grad_ST = run(loss_type, params, make_batch())
    ones, ones_grad_ST = run(loss_type, params, make_batch(mask=EVERY))
    assert float(unmasked.loss.detach()) == float(ones.loss.detach())
    assert unmasked.metrics["loss:sum"] == float(unmasked.loss.detach())
    assert torch.equal(unmasked_grad_ST, ones_grad_ST)
    assert unmasked.included_ST.tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    # With a mask given, the metrics count its positions, prompt included.
    assert ones.metrics["valid_tokens:sum"] == 8.0


def test_unmasked_loss_values_are_the_closed_forms_over_every_position() -> None:
    every = [(s, t) for s, row in enumerate(X) for t in range(len(row))]
    is_loss = sum(-math.exp(X[s][t] - Q[s][t]) * A[s][t] for s, t in every)
    output, grad_ST = run(LossType.IMPORTANCE_SAMPLING, None, make_batch())
    assert float(output.loss.detach()) == approx(is_loss)
    expected_grad = [
        [-math.exp(x - q) * a for x, q, a in zip(*rows, strict=True)]
        for rows in zip(X, Q, A, strict=True)
    ]
    torch.testing.assert_close(grad_ST, padded(expected_grad), rtol=1e-5, atol=1e-6)

    # DRO's quadratic term does not vanish on the prompt: -(A x - beta/2 (x - q)^2) everywhere.
    beta = 0.3
    dro_loss = sum(-(A[s][t] * X[s][t] - 0.5 * beta * (X[s][t] - Q[s][t]) ** 2) for s, t in every)
    output, _ = run(LossType.DRO, DroParams(beta=beta), make_batch())
    assert float(output.loss.detach()) == approx(dro_loss)

    # GRPO TOKEN_MEAN divides by M = 8 included positions, not the 5 counted ones; beta = 0.
    params = GrpoParams(agg_type=GrpoAggregation.TOKEN_MEAN, ratio_type=GrpoRatioType.TOKEN)
    per_token = []
    for s, t in every:
        r, a = math.exp(X[s][t] - Q[s][t]), A[s][t]
        clipped = (a > 0 and r > 1.28) or (a < 0 and r < 0.8)
        per_token.append(-min(max(r, 0.8), 1.28) * a if clipped else -r * a)
    output, _ = run(LossType.GRPO, params, make_batch())
    assert float(output.loss.detach()) == approx(sum(per_token) / 8)


def test_a_completion_token_with_logprob_zero_counts_where_its_advantage_is_not_zero() -> None:
    # Position (0, 2) was sampled with probability 1 in float32 (q = 0) but carries A = 1.
    q = [[0.0, 0.0, 0.0, -1.0, -0.9], [0.0, -0.2, -1.1]]
    output, _ = run(LossType.IMPORTANCE_SAMPLING, None, make_batch(logprobs=q))
    assert output.metrics["valid_tokens:sum"] == 5.0
    # With A = 0 there too, nothing marks it as the policy's: it is not counted.
    a = [[0.0, 0.0, 0.0, -0.5, 2.0], [0.0, 0.8, -1.0]]
    output, _ = run(LossType.IMPORTANCE_SAMPLING, None, make_batch(logprobs=q, advantages=a))
    assert output.metrics["valid_tokens:sum"] == 4.0
    mismatch = mean_over(elementwise(lambda x, q: abs(x - q), X, q), [[0, 0, 0, 1, 1], [0, 1, 1]])
    assert output.metrics["loss/sampler_mismatch/mean"] == approx(mismatch)
