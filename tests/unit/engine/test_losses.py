"""Built-in losses against closed forms written here from losses.md (not from the module).

Every test builds a tiny request by hand: S = 2 samples of lengths 4 and 2, padded to T = 4.
Expected values and gradients d loss / d logprobs are computed in plain Python floats.

Legend: S = samples, T = longest sample, V = vocab.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.engine.train.losses import LOSSES, LossBatch, LossOutput
from posttrain.loss_specs import LOSS_SPECS
from posttrain.types import (
    CispoParams,
    DppoParams,
    DroParams,
    GrpoAggregation,
    GrpoParams,
    GrpoRatioType,
    LossParams,
    LossType,
    PpoParams,
)

NAN, INF = math.nan, math.inf

# Current-policy logprobs x, sampler logprobs q, advantages A, reference logprobs.
# Token ratios r = exp(x - q): 1.105, 0.819, 1.822, 1.492 | 0.607, 0.670.
X = [[-0.5, -1.2, -0.3, -2.0], [-0.7, -1.5]]
Q = [[-0.6, -1.0, -0.9, -2.4], [-0.2, -1.1]]
A = [[1.0, -0.5, 2.0, -1.5], [0.8, -1.0]]
REF = [[-0.4, -1.1, -0.5, -2.2], [-0.9, -1.3]]
ALL = [[1, 1, 1, 1], [1, 1]]
MASK = [[1, 0, 1, 1], [1, 1]]  # excludes position (0, 1)

Rows = list[list[float]]


# ---------------------------------------------------------------- helpers


def padded(rows: list[list], fill: float = 0.0, dtype: torch.dtype = torch.float32) -> Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([list(row) + [fill] * (width - len(row)) for row in rows], dtype=dtype)


def make_batch(
    *,
    weights: Rows | None = None,
    mask: Rows | None = None,
    logprobs: Rows | None = Q,
    advantages: Rows | None = A,
    reference: Rows | None = None,
    pad: float = 0.0,
    dtype: torch.dtype = torch.float32,
    lengths: tuple[int, ...] = (4, 2),
) -> LossBatch:
    def tensor(rows: Rows | None) -> Tensor | None:
        return None if rows is None else padded(rows, pad, dtype)

    return LossBatch(
        valid_ST=padded([[True] * n for n in lengths], False, torch.bool),
        weights_ST=tensor(weights),
        mask_ST=tensor(mask),
        sampler_logprobs_ST=tensor(logprobs),
        advantages_ST=tensor(advantages),
        reference_logprobs_ST=tensor(reference),
    )


def run(
    loss_type: LossType,
    params: LossParams,
    batch: LossBatch,
    x: Rows = X,
    *,
    pad: float = 0.0,
) -> tuple[LossOutput, Tensor]:
    """The loss output and d loss / d logprobs_ST by autograd."""
    logprobs_ST = padded(x, pad).requires_grad_(True)
    output = LOSSES[loss_type](logprobs_ST, batch, params)
    output.loss.backward()
    assert logprobs_ST.grad is not None
    return output, logprobs_ST.grad


TokenFn = Callable[[int, int], tuple[float, float]]


def expected_sum(token: TokenFn, included: list[list[int]]) -> tuple[float, Tensor]:
    """Sum over included (s, t) of token(s, t) = (value, d value / d x_st)."""
    loss, grad = 0.0, []
    for s, row in enumerate(included):
        grad_row = []
        for t, is_included in enumerate(row):
            value, coefficient = token(s, t) if is_included else (0.0, 0.0)
            loss += value
            grad_row.append(coefficient)
        grad.append(grad_row)
    return loss, padded(grad)


def clip(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def ratio(s: int, t: int, x: Rows = X, q: Rows = Q) -> float:
    return math.exp(x[s][t] - q[s][t])


def elementwise(fn: Callable[..., float], *rows_list: Rows) -> Rows:
    """fn applied position by position to ragged rows of equal shapes."""
    return [
        [fn(*values) for values in zip(*rows, strict=True)] for rows in zip(*rows_list, strict=True)
    ]


def k3(ref: float, x: float) -> float:
    """k3 of losses.md 9.2 without the clamp: exp(ref - x) - (ref - x) - 1."""
    return math.exp(ref - x) - (ref - x) - 1


def token_mean(values: Rows, included: list[list[int]]) -> float:
    kept = [
        v
        for row, m_row in zip(values, included, strict=True)
        for v, m in zip(row, m_row, strict=True)
        if m
    ]
    return sum(kept) / len(kept) if kept else 0.0


def assert_grad(grad_ST: Tensor, expected_ST: Tensor) -> None:
    torch.testing.assert_close(grad_ST, expected_ST, rtol=1e-5, atol=1e-6)


def approx(value: float) -> object:
    return pytest.approx(value, rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------- cross-entropy (losses.md 2)


def test_cross_entropy_matches_torch_cross_entropy() -> None:
    generator = torch.Generator().manual_seed(0)
    logits_STV = torch.randn(2, 5, 11, generator=generator, requires_grad=True)
    targets_ST = torch.randint(0, 11, (2, 5), generator=generator)
    valid_ST = padded([[True] * 5, [True] * 3], False, torch.bool)
    weights_ST = torch.rand(2, 5, generator=generator) * 2 * valid_ST
    weights_ST[0, 1] = 0.0
    logprobs_ST = logits_STV.log_softmax(-1).gather(-1, targets_ST[..., None]).squeeze(-1)

    ours = LOSSES[LossType.CROSS_ENTROPY](logprobs_ST, LossBatch(valid_ST, weights_ST), None)
    per_token_ST = F.cross_entropy(
        logits_STV.reshape(-1, 11), targets_ST.reshape(-1), reduction="none"
    ).reshape(2, 5)
    expected = (weights_ST * per_token_ST).sum()

    torch.testing.assert_close(ours.loss, expected)
    (ours_grad_STV,) = torch.autograd.grad(ours.loss, logits_STV)
    (expected_grad_STV,) = torch.autograd.grad(expected, logits_STV)
    torch.testing.assert_close(ours_grad_STV, expected_grad_STV)


def test_cross_entropy_honours_fractional_weights() -> None:
    weights = [[0.5, 3.0, 0.0, 1.0], [0.25, 2.0]]
    output, grad_ST = run(LossType.CROSS_ENTROPY, None, make_batch(weights=weights))

    loss, expected_grad_ST = expected_sum(
        lambda s, t: (-weights[s][t] * X[s][t], -weights[s][t]), ALL
    )
    assert float(output.loss.detach()) == approx(loss)
    assert_grad(grad_ST, expected_grad_ST)
    assert output.included_ST.tolist() == [[True, True, False, True], [True, True, False, False]]


def test_cross_entropy_reports_sum_and_valid_tokens() -> None:
    weights = [[0.5, 3.0, 0.0, 1.0], [0.25, 2.0]]
    output, _ = run(LossType.CROSS_ENTROPY, None, make_batch(weights=weights))
    expected = -sum(
        w * x
        for w_row, x_row in zip(weights, X, strict=True)
        for w, x in zip(w_row, x_row, strict=True)
    )
    assert output.metrics == {"loss:sum": approx(expected), "valid_tokens:sum": 5.0}


def test_cross_entropy_ignores_nonfinite_logprobs_at_zero_weight_and_padding() -> None:
    weights = [[1.0, 0.0, 1.0, 1.0], [1.0, 1.0]]
    clean, clean_grad_ST = run(LossType.CROSS_ENTROPY, None, make_batch(weights=weights))
    poisoned_x = [[-0.5, NAN, -0.3, -2.0], [-0.7, -1.5]]
    batch = make_batch(weights=weights, pad=NAN)
    poisoned, poisoned_grad_ST = run(LossType.CROSS_ENTROPY, None, batch, poisoned_x, pad=-INF)

    assert float(poisoned.loss.detach()) == float(clean.loss.detach())
    assert torch.equal(poisoned_grad_ST, clean_grad_ST)
    assert poisoned.metrics == clean.metrics


def test_cross_entropy_with_all_zero_weights_is_zero() -> None:
    weights = [[0.0] * 4, [0.0] * 2]
    output, grad_ST = run(LossType.CROSS_ENTROPY, None, make_batch(weights=weights))
    assert float(output.loss.detach()) == 0.0
    assert torch.equal(grad_ST, torch.zeros(2, 4))
    assert output.metrics == {"loss:sum": 0.0, "valid_tokens:sum": 0.0}


# ---------------------------------------------------------------- importance sampling (3)


def test_importance_sampling_matches_closed_form() -> None:
    output, grad_ST = run(LossType.IMPORTANCE_SAMPLING, None, make_batch(mask=MASK))

    def token(s: int, t: int) -> tuple[float, float]:
        return -ratio(s, t) * A[s][t], -ratio(s, t) * A[s][t]

    loss, expected_grad_ST = expected_sum(token, MASK)
    assert float(output.loss.detach()) == approx(loss)
    assert_grad(grad_ST, expected_grad_ST)


# ---------------------------------------------------------------- PPO (4)


def ppo_token(lo: float, hi: float, x: Rows = X, q: Rows = Q, a: Rows = A) -> TokenFn:
    def token(s: int, t: int) -> tuple[float, float]:
        r, adv = ratio(s, t, x, q), a[s][t]
        value = -min(r * adv, clip(r, lo, hi) * adv)
        is_clipped = (adv > 0 and r > hi) or (adv < 0 and r < lo)
        return value, 0.0 if is_clipped else -r * adv

    return token


def test_ppo_matches_closed_form_on_mixed_tokens() -> None:
    output, grad_ST = run(LossType.PPO, None, make_batch(mask=MASK))  # defaults 0.8 / 1.2
    loss, expected_grad_ST = expected_sum(ppo_token(0.8, 1.2), MASK)
    assert float(output.loss.detach()) == approx(loss)
    assert_grad(grad_ST, expected_grad_ST)


def one_token_run(
    loss_type: LossType, params: LossParams, x: float, q: float, a: float
) -> tuple[float, float, dict[str, float]]:
    """(loss, d loss / d x, metrics) for a request of one single-token sample."""
    batch = make_batch(logprobs=[[q]], advantages=[[a]], lengths=(1,))
    output, grad_ST = run(loss_type, params, batch, [[x]])
    return float(output.loss.detach()), float(grad_ST[0, 0]), output.metrics


def test_ppo_clips_ratio_above_upper_bound() -> None:
    # r = e^0.5 = 1.65 > hi, A > 0: the clipped branch -hi A is selected, no gradient.
    loss, grad, metrics = one_token_run(LossType.PPO, PpoParams(0.8, 1.2), -0.5, -1.0, 2.0)
    assert loss == approx(-1.2 * 2.0)
    assert grad == 0.0
    assert metrics["loss/clip/high_fraction"] == 1.0
    assert metrics["loss/clip/low_fraction"] == 0.0


def test_ppo_clips_ratio_below_lower_bound() -> None:
    # r = e^-0.5 = 0.61 < lo, A < 0: -lo A is selected, no gradient.
    loss, grad, metrics = one_token_run(LossType.PPO, PpoParams(0.8, 1.2), -1.0, -0.5, -2.0)
    assert loss == approx(-0.8 * -2.0)
    assert grad == 0.0
    assert metrics["loss/clip/low_fraction"] == 1.0
    assert metrics["loss/clip/high_fraction"] == 0.0


def test_ppo_keeps_full_gradient_for_negative_advantage_above_upper_bound() -> None:
    # No dual clip: A < 0 and r > hi keeps -r A, unbounded.
    r = math.exp(2.0)
    loss, grad, metrics = one_token_run(LossType.PPO, PpoParams(0.8, 1.2), -0.5, -2.5, -1.0)
    assert loss == approx(r)
    assert grad == approx(r)
    assert metrics["loss/clip/high_fraction"] == 0.0


def test_ppo_keeps_full_gradient_for_positive_advantage_below_lower_bound() -> None:
    r = math.exp(-1.0)
    loss, grad, metrics = one_token_run(LossType.PPO, PpoParams(0.8, 1.2), -2.0, -1.0, 3.0)
    assert loss == approx(-3.0 * r)
    assert grad == approx(-3.0 * r)
    assert metrics["loss/clip/low_fraction"] == 0.0


def test_ppo_reports_clip_fractions() -> None:
    # Of the 6 tokens, (0, 2) has A > 0, r > 1.2 and (1, 1) has A < 0, r < 0.8.
    output, _ = run(LossType.PPO, PpoParams(0.8, 1.2), make_batch())
    assert output.metrics["loss/clip/high_fraction"] == approx(1 / 6)
    assert output.metrics["loss/clip/low_fraction"] == approx(1 / 6)


# ---------------------------------------------------------------- CISPO (5)


def cispo_token(lo: float, hi: float) -> TokenFn:
    def token(s: int, t: int) -> tuple[float, float]:
        weight = clip(ratio(s, t), lo, hi)
        return -weight * A[s][t] * X[s][t], -weight * A[s][t]

    return token


def test_cispo_matches_closed_form_with_default_bounds() -> None:
    output, grad_ST = run(LossType.CISPO, None, make_batch(mask=MASK))  # 0 / 4: no clipping
    loss, expected_grad_ST = expected_sum(cispo_token(0.0, 4.0), MASK)
    assert float(output.loss.detach()) == approx(loss)
    assert_grad(grad_ST, expected_grad_ST)


def test_cispo_clips_the_weight_on_both_sides_but_keeps_every_gradient() -> None:
    # lo 0.7 clips (1, 0) and (1, 1) (r 0.61, 0.67), hi 1.5 clips (0, 2) (r 1.82).
    output, grad_ST = run(LossType.CISPO, CispoParams(0.7, 1.5), make_batch())
    loss, expected_grad_ST = expected_sum(cispo_token(0.7, 1.5), ALL)
    assert float(output.loss.detach()) == approx(loss)
    assert_grad(grad_ST, expected_grad_ST)
    assert float(grad_ST[0, 2]) == approx(-1.5 * 2.0)
    assert float(grad_ST[1, 1]) == approx(-0.7 * -1.0)
    assert bool((grad_ST[:, :2] != 0).all())


def test_cispo_counts_clipping_regardless_of_advantage_sign() -> None:
    # r < 0.7 at (1, 0) with A > 0 and at (1, 1) with A < 0; r > 1.5 at (0, 2).
    output, _ = run(LossType.CISPO, CispoParams(0.7, 1.5), make_batch())
    assert output.metrics["loss/clip/low_fraction"] == approx(2 / 6)
    assert output.metrics["loss/clip/high_fraction"] == approx(1 / 6)


# ---------------------------------------------------------------- DRO (6)


def dro_token(beta: float) -> TokenFn:
    def token(s: int, t: int) -> tuple[float, float]:
        x, q, a = X[s][t], Q[s][t], A[s][t]
        return -(a * x - 0.5 * beta * (x - q) ** 2), -a + beta * (x - q)

    return token


def test_dro_matches_closed_form() -> None:
    output, grad_ST = run(LossType.DRO, DroParams(beta=0.3), make_batch(mask=MASK))
    loss, expected_grad_ST = expected_sum(dro_token(0.3), MASK)
    assert float(output.loss.detach()) == approx(loss)
    assert_grad(grad_ST, expected_grad_ST)


def test_dro_penalises_drift_from_sampler_where_advantage_is_zero() -> None:
    loss, grad, _ = one_token_run(LossType.DRO, DroParams(beta=2.0), -1.0, -1.5, 0.0)
    assert loss == approx(0.5 * 2.0 * 0.5**2)
    assert grad == approx(2.0 * 0.5)
    loss, grad, _ = one_token_run(LossType.DRO, DroParams(beta=0.0), -1.0, -1.5, 0.0)
    assert (loss, grad) == (0.0, 0.0)


def test_dro_gradient_matches_finite_differences() -> None:
    batch = make_batch(mask=MASK, dtype=torch.float64)
    logprobs_ST = padded(X, dtype=torch.float64).requires_grad_(True)

    def loss(x_ST: Tensor) -> Tensor:
        return LOSSES[LossType.DRO](x_ST, batch, DroParams(beta=0.7)).loss

    assert torch.autograd.gradcheck(loss, (logprobs_ST,))


# ---------------------------------------------------------------- DPPO (7)


def dppo_token(delta_low: float, delta_high: float, x: Rows = X, q: Rows = Q) -> TokenFn:
    def token(s: int, t: int) -> tuple[float, float]:
        a, change = A[s][t], math.exp(x[s][t]) - math.exp(q[s][t])
        keep = change <= delta_high if a > 0 else change >= -delta_low
        r = ratio(s, t, x, q)
        return -a * r * keep * x[s][t], -a * r * keep

    return token


def test_dppo_matches_closed_form() -> None:
    # p - pi: 0.058, -0.067, 0.334, 0.045 | -0.322, -0.110; delta_low 0.1 masks (1, 1).
    output, grad_ST = run(LossType.DPPO, DppoParams(0.1, 0.15), make_batch(mask=MASK))
    loss, expected_grad_ST = expected_sum(dppo_token(0.1, 0.15), MASK)
    assert float(output.loss.detach()) == approx(loss)
    assert_grad(grad_ST, expected_grad_ST)


def test_dppo_masks_positive_advantage_token_whose_probability_rose_past_delta_high() -> None:
    # p - pi = e^-0.3 - e^-0.9 = 0.334 > 0.15 with A > 0.
    _, grad_ST = run(LossType.DPPO, DppoParams(0.15, 0.15), make_batch())
    assert float(grad_ST[0, 2]) == 0.0
    _, grad_ST = run(LossType.DPPO, DppoParams(0.15, 0.4), make_batch())
    assert float(grad_ST[0, 2]) == approx(-2.0 * ratio(0, 2))


def test_dppo_masks_negative_advantage_token_whose_probability_fell_past_delta_low() -> None:
    # p - pi = e^-1.5 - e^-1.1 = -0.110 with A < 0.
    _, grad_ST = run(LossType.DPPO, DppoParams(0.1, 0.15), make_batch())
    assert float(grad_ST[1, 1]) == 0.0
    _, grad_ST = run(LossType.DPPO, DppoParams(0.15, 0.15), make_batch())
    assert float(grad_ST[1, 1]) == approx(1.0 * ratio(1, 1))


def test_dppo_never_masks_a_token_moving_back_towards_the_sampler() -> None:
    # A > 0 whose probability fell by 0.5, A < 0 whose probability rose by 0.5.
    delta = DppoParams(0.1, 0.1)
    x, q = math.log(0.3), math.log(0.8)
    loss, grad, metrics = one_token_run(LossType.DPPO, delta, x, q, 1.0)
    assert grad == approx(-1.0 * 0.3 / 0.8)
    assert loss == approx(-1.0 * 0.3 / 0.8 * x)
    assert metrics["loss/clip/low_fraction"] == metrics["loss/clip/high_fraction"] == 0.0
    _, grad, metrics = one_token_run(LossType.DPPO, delta, q, x, -1.0)
    assert grad == approx(0.8 / 0.3)
    assert metrics["loss/clip/low_fraction"] == metrics["loss/clip/high_fraction"] == 0.0


def test_dppo_reports_trust_region_fractions() -> None:
    output, _ = run(LossType.DPPO, DppoParams(0.1, 0.15), make_batch())
    assert output.metrics["loss/clip/high_fraction"] == approx(1 / 6)  # (0, 2)
    assert output.metrics["loss/clip/low_fraction"] == approx(1 / 6)  # (1, 1)


# ---------------------------------------------------------------- GRPO (9)


def expected_grpo(
    included: list[list[int]],
    params: GrpoParams,
    *,
    x: Rows = X,
    q: Rows = Q,
    a: Rows = A,
    ref: Rows | None = None,
) -> tuple[float, Tensor]:
    lo, hi, beta = params.clip_low_threshold, params.clip_high_threshold, params.beta
    num_samples, horizon = len(x), max(len(row) for row in x)
    n = [sum(row) for row in included]
    total, num_nonempty = sum(n), sum(1 for n_i in n if n_i > 0)
    loss, grad = 0.0, []
    for s, row in enumerate(included):
        mean_log_ratio = sum(x[s][t] - q[s][t] for t, m in enumerate(row) if m) / max(n[s], 1)
        coefficient = {
            GrpoAggregation.FIXED_HORIZON: 1 / (num_samples * horizon),
            GrpoAggregation.TOKEN_MEAN: 1 / max(total, 1),
            GrpoAggregation.SEQUENCE_MEAN: 1 / (max(num_nonempty, 1) * max(n[s], 1)),
        }[params.agg_type]
        grad_row = []
        for t, m in enumerate(row):
            if not m:
                grad_row.append(0.0)
                continue
            if params.ratio_type == GrpoRatioType.SEQUENCE:
                rho = math.exp(mean_log_ratio)
            else:
                rho = math.exp(x[s][t] - q[s][t])
            adv = a[s][t]
            pg = -min(rho * adv, clip(rho, lo, hi) * adv)
            is_clipped = (adv > 0 and rho > hi) or (adv < 0 and rho < lo)
            d_pg = 0.0 if is_clipped else -adv * rho
            kl = d_kl = 0.0
            if ref is not None:
                diff = ref[s][t] - x[s][t]
                u = clip(diff, -10.0, 10.0)
                kl = math.exp(u) - u - 1
                d_kl = 1 - math.exp(diff) if abs(diff) <= 10 else 0.0
            loss += coefficient * (pg + beta * kl)
            grad_row.append(coefficient * (d_pg + beta * d_kl))
        grad.append(grad_row)
    return loss, padded(grad)


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("ratio_type", list(GrpoRatioType))
@pytest.mark.parametrize("agg_type", list(GrpoAggregation))
def test_grpo_matches_closed_form(
    agg_type: GrpoAggregation, ratio_type: GrpoRatioType, beta: float
) -> None:
    params = GrpoParams(beta=beta, agg_type=agg_type, ratio_type=ratio_type)
    output, grad_ST = run(LossType.GRPO, params, make_batch(mask=MASK, reference=REF))
    loss, expected_grad_ST = expected_grpo(MASK, params, ref=REF)
    assert float(output.loss.detach()) == approx(loss)
    assert_grad(grad_ST, expected_grad_ST)


def test_grpo_defaults_are_fixed_horizon_token_ratio_without_kl() -> None:
    output, grad_ST = run(LossType.GRPO, None, make_batch(mask=MASK))
    loss, expected_grad_ST = expected_grpo(MASK, GrpoParams(0.8, 1.28, 0.0))
    assert float(output.loss.detach()) == approx(loss)
    assert_grad(grad_ST, expected_grad_ST)


@pytest.mark.parametrize(
    ("agg_type", "included", "expected"),
    [
        # Per-token loss -A with A = -1 in sample 0, -3 in sample 1 (r = 1, no clipping).
        (GrpoAggregation.FIXED_HORIZON, MASK, (3 * 1 + 2 * 3) / (2 * 4)),
        (GrpoAggregation.TOKEN_MEAN, MASK, (3 * 1 + 2 * 3) / 5),
        (GrpoAggregation.SEQUENCE_MEAN, MASK, (3 / 3 + 6 / 2) / 2),
        # Sample 1 fully masked: S stays 2 and H 4 for FIXED_HORIZON; S+ drops to 1.
        (GrpoAggregation.FIXED_HORIZON, [[1, 0, 1, 1], [0, 0]], 3 / (2 * 4)),
        (GrpoAggregation.TOKEN_MEAN, [[1, 0, 1, 1], [0, 0]], 3 / 3),
        (GrpoAggregation.SEQUENCE_MEAN, [[1, 0, 1, 1], [0, 0]], (3 / 3) / 1),
    ],
)
def test_grpo_aggregation_normalises_within_the_request(
    agg_type: GrpoAggregation, included: list[list[int]], expected: float
) -> None:
    advantages = [[-1.0] * 4, [-3.0] * 2]
    batch = make_batch(mask=included, logprobs=X, advantages=advantages)
    output, _ = run(LossType.GRPO, GrpoParams(agg_type=agg_type), batch)
    assert float(output.loss.detach()) == approx(expected)


def test_grpo_fixed_horizon_uses_longest_sample_not_padded_width() -> None:
    # Padded to 6 columns; the longest sample has 4 positions, so H = 4. r = 1, A = -1.
    wide_ST = padded([row + [0.0] * (6 - len(row)) for row in X])
    batch = LossBatch(
        valid_ST=torch.tensor([[t < n for t in range(6)] for n in (4, 2)]),
        sampler_logprobs_ST=wide_ST,
        advantages_ST=torch.full((2, 6), -1.0),
    )
    output = LOSSES[LossType.GRPO](wide_ST.clone().requires_grad_(True), batch, None)
    assert float(output.loss.detach()) == approx(6 / (2 * 4))


def test_grpo_sequence_ratio_is_exp_of_mean_included_log_ratio() -> None:
    params = GrpoParams(0.5, 2.0, ratio_type=GrpoRatioType.SEQUENCE)
    output, grad_ST = run(LossType.GRPO, params, make_batch(mask=MASK))
    s_0 = math.exp((0.1 + 0.6 + 0.4) / 3)  # (0, 1) is masked out of the mean
    s_1 = math.exp((-0.5 - 0.4) / 2)
    assert output.metrics["loss/ratio/mean"] == approx((3 * s_0 + 2 * s_1) / 5)
    assert output.metrics["loss/kl_policy/mean"] == approx(-(1.1 - 0.9) / 5)
    # Each token's gradient carries its own sequence's s_i (FIXED_HORIZON: c = 1/8).
    expected_grad_ST = padded([[-1.0 * s_0, 0.0, -2.0 * s_0, 1.5 * s_0], [-0.8 * s_1, s_1]])
    assert_grad(grad_ST, expected_grad_ST / 8)


def test_grpo_sequence_ratio_clips_whole_sequences() -> None:
    # s_1 = e^-0.45 = 0.64 < lo: the A < 0 token of sample 1 is clipped, the A > 0 one is not.
    params = GrpoParams(0.8, 1.28, ratio_type=GrpoRatioType.SEQUENCE)
    output, grad_ST = run(LossType.GRPO, params, make_batch())
    assert float(grad_ST[1, 1]) == 0.0
    assert float(grad_ST[1, 0]) == approx(-0.8 * math.exp(-0.45) / 8)
    assert output.metrics["loss/clip/low_fraction"] == approx(1 / 6)
    assert output.metrics["loss/clip/high_fraction"] == 0.0


@pytest.mark.parametrize("agg_type", list(GrpoAggregation))
def test_grpo_sequence_ratio_gradient_matches_finite_differences(
    agg_type: GrpoAggregation,
) -> None:
    # With one advantage per sequence, the GSPO-token reparameterisation has exactly the
    # gradient of the sequence-ratio objective it reports (losses.md 9.3).
    batch = make_batch(
        mask=MASK, advantages=[[0.7] * 4, [-1.3] * 2], reference=REF, dtype=torch.float64
    )
    params = GrpoParams(0.5, 2.0, beta=0.2, agg_type=agg_type, ratio_type=GrpoRatioType.SEQUENCE)
    logprobs_ST = padded(X, dtype=torch.float64).requires_grad_(True)

    def loss(x_ST: Tensor) -> Tensor:
        return LOSSES[LossType.GRPO](x_ST, batch, params).loss

    assert torch.autograd.gradcheck(loss, (logprobs_ST,))


def test_grpo_kl_adds_beta_times_k3() -> None:
    without, grad_without_ST = run(LossType.GRPO, GrpoParams(), make_batch(reference=REF))
    with_kl, grad_with_ST = run(LossType.GRPO, GrpoParams(beta=0.5), make_batch(reference=REF))
    kl = elementwise(k3, REF, X)
    d_kl = elementwise(lambda ref, x: 1 - math.exp(ref - x), REF, X)
    assert float((with_kl.loss - without.loss).detach()) == approx(0.5 * sum(map(sum, kl)) / 8)
    assert_grad(grad_with_ST - grad_without_ST, 0.5 * padded(d_kl) / 8)


def test_grpo_kl_clamps_log_ratio_at_ten() -> None:
    # ref - x = 12 and -11: u is clamped to +-10 and the KL term has no gradient there.
    reference = [[11.5, -13.2, -0.3, -2.0], [-0.7, -1.5]]
    params = GrpoParams(beta=1.0, agg_type=GrpoAggregation.TOKEN_MEAN)
    output, grad_ST = run(
        LossType.GRPO, params, make_batch(advantages=[[0.0] * 4, [0.0] * 2], reference=reference)
    )
    kl_high, kl_low = math.exp(10) - 10 - 1, math.exp(-10) + 10 - 1
    assert float(output.loss.detach()) == approx((kl_high + kl_low) / 6)
    assert output.metrics["loss/kl_ref/mean"] == approx((kl_high + kl_low) / 6)
    assert_grad(grad_ST, torch.zeros(2, 4))


def test_grpo_reference_logprobs_without_beta_only_feed_the_kl_ref_metric() -> None:
    plain, plain_grad_ST = run(LossType.GRPO, GrpoParams(), make_batch(mask=MASK))
    with_ref, ref_grad_ST = run(LossType.GRPO, GrpoParams(), make_batch(mask=MASK, reference=REF))
    assert float(with_ref.loss.detach()) == float(plain.loss.detach())
    assert torch.equal(ref_grad_ST, plain_grad_ST)
    assert "loss/kl_ref/mean" not in plain.metrics
    kl = elementwise(k3, REF, X)
    assert with_ref.metrics["loss/kl_ref/mean"] == approx(token_mean(kl, MASK))


def test_grpo_clip_bounds_zero_the_gradient_of_clipped_tokens() -> None:
    # Token ratios: (0, 2) A > 0, r 1.82 > 1.28; (1, 1) A < 0, r 0.67 < 0.8;
    # (0, 3) A < 0, r 1.49 > 1.28 keeps its gradient (no dual clip).
    _, grad_ST = run(LossType.GRPO, GrpoParams(), make_batch())
    assert float(grad_ST[0, 2]) == 0.0
    assert float(grad_ST[1, 1]) == 0.0
    assert float(grad_ST[0, 3]) == approx(1.5 * ratio(0, 3) / 8)


def test_grpo_reports_its_metrics() -> None:
    params = GrpoParams(beta=0.1, agg_type=GrpoAggregation.TOKEN_MEAN)
    output, _ = run(LossType.GRPO, params, make_batch(mask=MASK, reference=REF))
    ratios = elementwise(lambda x, q: math.exp(x - q), X, Q)
    kl = elementwise(k3, REF, X)
    loss, _ = expected_grpo(MASK, params, ref=REF)
    assert output.metrics == {
        "loss:sum": approx(loss),
        "valid_tokens:sum": 5.0,
        "loss/ratio/mean": approx(token_mean(ratios, MASK)),
        "loss/kl_policy/mean": approx(token_mean(elementwise(lambda x, q: q - x, X, Q), MASK)),
        "loss/sampler_mismatch/mean": approx(
            token_mean(elementwise(lambda x, q: abs(x - q), X, Q), MASK)
        ),
        "loss/clip/clipped_ratio/mean": approx(
            token_mean(elementwise(lambda r: clip(r, 0.8, 1.28), ratios), MASK)
        ),
        "loss/clip/high_fraction": approx(1 / 5),
        "loss/clip/low_fraction": approx(1 / 5),
        "loss/kl_ref/mean": approx(token_mean(kl, MASK)),
    }


# ---------------------------------------------------------------- every policy loss (1.3, 10)

POLICY_LOSSES = [
    (LossType.IMPORTANCE_SAMPLING, None),
    (LossType.PPO, PpoParams()),
    (LossType.CISPO, CispoParams(0.7, 1.5)),
    (LossType.DRO, DroParams(beta=0.3)),
    (LossType.DPPO, DppoParams(0.1, 0.15)),
    (LossType.GRPO, GrpoParams(beta=0.1, ratio_type=GrpoRatioType.TOKEN)),
    (LossType.GRPO, GrpoParams(beta=0.1, ratio_type=GrpoRatioType.SEQUENCE)),
]
POLICY_IDS = ["is", "ppo", "cispo", "dro", "dppo", "grpo-token", "grpo-sequence"]


@pytest.mark.parametrize("exclusion", ["weights", "mask", "padding"])
@pytest.mark.parametrize(("loss_type", "params"), POLICY_LOSSES, ids=POLICY_IDS)
def test_policy_loss_ignores_nonfinite_values_at_excluded_positions(
    loss_type: LossType, params: LossParams, exclusion: str
) -> None:
    keep = MASK if exclusion != "padding" else ALL
    inclusion = {} if exclusion == "padding" else {exclusion: keep}
    clean, clean_grad_ST = run(loss_type, params, make_batch(reference=REF, **inclusion))

    # x - q = 1000 overflows exp at (0, 1) unless the log ratio is selected before exp.
    def poison(rows: Rows, value: float) -> Rows:
        return [
            [value if not m else v for v, m in zip(row, m_row, strict=True)]
            for row, m_row in zip(rows, keep, strict=True)
        ]

    batch = make_batch(
        logprobs=poison(Q, -1000.0),
        advantages=poison(A, NAN),
        reference=poison(REF, INF),
        pad=NAN,
        **inclusion,
    )
    poisoned, poisoned_grad_ST = run(loss_type, params, batch, poison(X, 0.0), pad=INF)

    assert torch.isfinite(poisoned.loss)
    assert float(poisoned.loss.detach()) == approx(float(clean.loss.detach()))
    assert bool(torch.isfinite(poisoned_grad_ST).all())
    torch.testing.assert_close(poisoned_grad_ST, clean_grad_ST)
    assert poisoned.metrics == {key: approx(value) for key, value in clean.metrics.items()}


def test_policy_loss_ignores_nan_logprobs_at_excluded_positions() -> None:
    x = [[-0.5, NAN, -0.3, -2.0], [-0.7, -1.5]]
    for loss_type, params in POLICY_LOSSES:
        clean, clean_grad_ST = run(loss_type, params, make_batch(mask=MASK, reference=REF))
        nan, nan_grad_ST = run(loss_type, params, make_batch(mask=MASK, reference=REF), x, pad=NAN)
        assert float(nan.loss.detach()) == float(clean.loss.detach()), loss_type
        assert torch.equal(nan_grad_ST, clean_grad_ST), loss_type


@pytest.mark.parametrize(("loss_type", "params"), POLICY_LOSSES, ids=POLICY_IDS)
def test_policy_loss_with_nothing_included_is_zero(loss_type: LossType, params: LossParams) -> None:
    batch = make_batch(mask=[[0] * 4, [0] * 2], reference=REF)
    output, grad_ST = run(loss_type, params, batch)
    assert float(output.loss.detach()) == 0.0
    assert torch.equal(grad_ST, torch.zeros(2, 4))
    assert set(output.metrics.values()) == {0.0}
    assert not output.included_ST.any()


@pytest.mark.parametrize(("loss_type", "params"), POLICY_LOSSES, ids=POLICY_IDS)
def test_policy_loss_binarises_fractional_weights(loss_type: LossType, params: LossParams) -> None:
    weights = [[0.5, 0.0, 3.0, 1.0], [2.0, 0.25]]
    weighted, weighted_grad_ST = run(loss_type, params, make_batch(weights=weights, reference=REF))
    masked, masked_grad_ST = run(loss_type, params, make_batch(mask=MASK, reference=REF))
    assert float(weighted.loss.detach()) == float(masked.loss.detach())
    assert torch.equal(weighted_grad_ST, masked_grad_ST)
    assert weighted.metrics == masked.metrics
    assert torch.equal(weighted.included_ST, masked.included_ST)


@pytest.mark.parametrize(("loss_type", "params"), POLICY_LOSSES, ids=POLICY_IDS)
def test_policy_loss_without_weights_or_mask_includes_every_position(
    loss_type: LossType, params: LossParams
) -> None:
    unmasked, unmasked_grad_ST = run(loss_type, params, make_batch(reference=REF))
    ones, ones_grad_ST = run(loss_type, params, make_batch(mask=ALL, reference=REF))
    assert float(unmasked.loss.detach()) == float(ones.loss.detach())
    assert torch.equal(unmasked_grad_ST, ones_grad_ST)
    assert unmasked.included_ST.tolist() == [[True] * 4, [True, True, False, False]]


@pytest.mark.parametrize(("loss_type", "params"), POLICY_LOSSES[:6], ids=POLICY_IDS[:6])
def test_policy_loss_reports_token_ratio_and_mismatch_metrics(
    loss_type: LossType, params: LossParams
) -> None:
    output, _ = run(loss_type, params, make_batch(mask=MASK, reference=REF))
    log_ratios = elementwise(lambda x, q: x - q, X, Q)
    assert output.metrics["valid_tokens:sum"] == 5.0
    assert output.metrics["loss:sum"] == float(output.loss.detach())
    assert output.metrics["loss/ratio/mean"] == approx(
        token_mean(elementwise(math.exp, log_ratios), MASK)
    )
    assert output.metrics["loss/kl_policy/mean"] == approx(
        token_mean(elementwise(lambda v: -v, log_ratios), MASK)
    )
    assert output.metrics["loss/sampler_mismatch/mean"] == approx(
        token_mean(elementwise(abs, log_ratios), MASK)
    )


def test_every_loss_type_has_a_loss_and_required_inputs() -> None:
    assert set(LOSSES) == set(LossType)
    assert set(LOSS_SPECS) == set(LossType)
    assert LOSS_SPECS[LossType.CROSS_ENTROPY].required_inputs == ("target_tokens", "weights")
    for loss_type in set(LossType) - {LossType.CROSS_ENTROPY}:
        assert LOSS_SPECS[loss_type].required_inputs == ("target_tokens", "logprobs", "advantages")
