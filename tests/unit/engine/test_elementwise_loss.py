"""Each built-in loss's per-token share of its loss (Tinker's `elementwise_loss`): it sums to
the reported loss, is 0 where a token is excluded, and equals the closed form written here.

Legend: S = samples, T = longest sample.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from posttrain.engine.train.losses import LOSSES, LossBatch
from posttrain.types import (
    CispoParams,
    DppoParams,
    DroParams,
    GrpoAggregation,
    GrpoParams,
    GrpoRatioType,
    GspoParams,
    LossParams,
    LossType,
    PpoParams,
)

X = [[-0.5, -1.2, -0.3, -2.0], [-0.7, -1.5, 0.0, 0.0]]
Q = [[-0.6, -1.0, -0.9, -2.4], [-0.2, -1.1, 0.0, 0.0]]
A = [[1.0, -0.5, 2.0, -1.5], [0.8, -1.0, 0.0, 0.0]]
REF = [[-0.4, -1.1, -0.5, -2.2], [-0.9, -1.3, 0.0, 0.0]]
WEIGHTS = [[0.5, 0.0, 1.0, 2.0], [1.0, 1.0, 0.0, 0.0]]  # excludes (0, 1)
VALID = [[True] * 4, [True, True, False, False]]


def batch(**extra: Tensor) -> LossBatch:
    return LossBatch(
        valid_ST=torch.tensor(VALID),
        weights_ST=torch.tensor(WEIGHTS),
        sampler_logprobs_ST=torch.tensor(Q),
        advantages_ST=torch.tensor(A),
        reference_logprobs_ST=torch.tensor(REF),
        **extra,
    )


CASES: list[tuple[LossType, LossParams]] = [
    (LossType.CROSS_ENTROPY, None),
    (LossType.IMPORTANCE_SAMPLING, None),
    (LossType.PPO, PpoParams()),
    (LossType.CISPO, CispoParams()),
    (LossType.DRO, DroParams(beta=0.3)),
    (LossType.DPPO, DppoParams()),
    *[
        (LossType.GRPO, GrpoParams(beta=0.1, agg_type=agg, ratio_type=ratio))
        for agg in GrpoAggregation
        for ratio in GrpoRatioType
    ],
    (LossType.GSPO, GspoParams()),
]


@pytest.mark.parametrize(("loss_type", "params"), CASES, ids=lambda c: str(c))
def test_elementwise_loss_sums_to_the_loss_and_is_zero_where_excluded(loss_type, params):
    ratio_mask = {"sequence_ratio_mask_ST": torch.tensor(WEIGHTS)}
    loss_batch = batch(**ratio_mask) if loss_type == LossType.GSPO else batch()
    output = LOSSES[loss_type](torch.tensor(X), loss_batch, params)
    assert not output.elementwise_ST.requires_grad
    assert float(output.elementwise_ST.sum()) == pytest.approx(float(output.loss), rel=1e-6)
    excluded_ST = ~(torch.tensor(VALID) & (torch.tensor(WEIGHTS) != 0))
    assert bool((output.elementwise_ST[excluded_ST] == 0).all())


def test_cross_entropy_elementwise_loss_is_minus_weight_times_logprob():
    output = LOSSES[LossType.CROSS_ENTROPY](torch.tensor(X), batch(), None)
    expected = [
        [-w * x for w, x in zip(wr, xr, strict=True)] for wr, xr in zip(WEIGHTS, X, strict=True)
    ]
    torch.testing.assert_close(output.elementwise_ST, torch.tensor(expected))


def test_grpo_token_mean_elementwise_loss_is_each_tokens_term_over_the_token_count():
    params = GrpoParams(agg_type=GrpoAggregation.TOKEN_MEAN)
    output = LOSSES[LossType.GRPO](torch.tensor(X), batch(), params)
    included = [(s, t) for s in range(2) for t in range(4) if VALID[s][t] and WEIGHTS[s][t]]
    expected = [[0.0] * 4 for _ in range(2)]
    for s, t in included:
        r, a = math.exp(X[s][t] - Q[s][t]), A[s][t]
        expected[s][t] = -min(r * a, min(max(r, 0.8), 1.28) * a) / len(included)
    torch.testing.assert_close(output.elementwise_ST, torch.tensor(expected))


def test_importance_sampling_elementwise_loss_is_minus_ratio_times_advantage():
    output = LOSSES[LossType.IMPORTANCE_SAMPLING](torch.tensor(X), batch(), None)
    for s in range(2):
        for t in range(4):
            is_in = VALID[s][t] and WEIGHTS[s][t] != 0
            value = -math.exp(X[s][t] - Q[s][t]) * A[s][t] if is_in else 0.0
            assert float(output.elementwise_ST[s, t]) == pytest.approx(value, abs=1e-6)
