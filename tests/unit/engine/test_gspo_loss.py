"""Tinker's gspo (engine/train/losses.gspo) against its closed form, written here in plain
Python floats from Tinker's GSPO page: per datum s = exp(mean over the sequence_ratio_mask
tokens of x - q), each token's ratio s with its own logprob's gradient, and
L = -sum_t min(s A_t, clip(s, lo, hi) A_t), so dL/dx_t = -s A_t unless the clip bites (then 0).

Legend: S = samples, T = longest sample.
"""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.engine.train.losses import LOSSES, LossBatch
from posttrain.types import GspoParams, LossType

X = [[-0.5, -1.2, -0.3, -2.0], [-0.7, -1.5], [-0.4, -0.9]]
Q = [[0.0, -1.0, -0.9, -2.4], [-0.2, -1.1], [-0.6, -0.5]]
# Per-token advantages (GSPO-token); sample 0's first position is a prompt placeholder.
A = [[0.0, 1.0, -0.5, 2.0], [-1.0, -1.0], [0.7, 0.7]]
# Sample 1's second token is outside the ratio but still in the loss; sample 2 has no ratio
# tokens (s = 1).
M = [[0.0, 1.0, 1.0, 1.0], [1.0, 0.0], [0.0, 0.0]]


def padded(rows: list[list[float]], fill: float = 0.0) -> torch.Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([row + [fill] * (width - len(row)) for row in rows])


def closed_form(low: float, high: float) -> tuple[float, list[list[float]]]:
    total, grads = 0.0, []
    for xs, qs, advs, ms in zip(X, Q, A, M, strict=True):
        in_ratio = [x - q for x, q, m in zip(xs, qs, ms, strict=True) if m != 0]
        s = math.exp(sum(in_ratio) / len(in_ratio)) if in_ratio else 1.0
        row = []
        for a in advs:
            if (a > 0 and s > high) or (a < 0 and s < low):
                total += -min(max(s, low), high) * a
                row.append(0.0)
            else:
                total += -s * a
                row.append(-s * a)
        grads.append(row)
    return total, grads


def batch() -> LossBatch:
    valid = padded([[1.0] * len(row) for row in X]) != 0
    return LossBatch(
        valid_ST=valid,
        sampler_logprobs_ST=padded(Q),
        advantages_ST=padded(A),
        sequence_ratio_mask_ST=padded(M),
    )


@pytest.mark.parametrize(
    ("low", "high"),
    [(0.8, 1.2), (0.5, 1.5), (0.99, 1.01)],
    ids=["tinker-default", "wide", "narrow"],
)
def test_gspo_value_and_gradient_equal_the_closed_form(low, high):
    x = padded(X).requires_grad_()
    output = LOSSES[LossType.GSPO](x, batch(), GspoParams(low, high))
    (grad,) = torch.autograd.grad(output.loss, x)
    want_loss, want_grads = closed_form(low, high)

    assert float(output.loss.detach()) == pytest.approx(want_loss, rel=1e-6)
    torch.testing.assert_close(grad, padded(want_grads))
    assert output.metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-6)
    # Counted: positions whose sampler logprob or advantage is non-zero (all but (0, 0)).
    assert output.metrics["valid_tokens:sum"] == 7.0


def test_the_default_thresholds_are_tinkers_ppo_ones():
    assert GspoParams() == GspoParams(0.8, 1.2)
    x = padded(X)
    with_defaults = LOSSES[LossType.GSPO](x, batch(), None)
    assert float(with_defaults.loss) == pytest.approx(closed_form(0.8, 1.2)[0], rel=1e-6)


def test_a_nan_outside_the_loss_and_the_ratio_reaches_nothing():
    x = padded(X, fill=math.nan).requires_grad_()  # padding positions hold NaN
    output = LOSSES[LossType.GSPO](x, batch(), GspoParams(0.5, 1.5))
    (grad,) = torch.autograd.grad(output.loss, x)
    assert math.isfinite(float(output.loss.detach())) and bool(torch.isfinite(grad).all())
    assert float(output.loss.detach()) == pytest.approx(closed_form(0.5, 1.5)[0], rel=1e-6)
