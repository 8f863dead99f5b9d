"""Built-in losses: a table of pure functions from per-token logprobs to a scalar and metrics.

The math is ../shared/reference/losses.md (section numbers below refer to it). Every loss sees
the whole request padded to [S, T] and returns the exact scalar that is back-propagated, plus
the inclusion mask that decides which logprobs are reported (others are reported as 0.0) and
each token's share of the loss (Tinker's `elementwise_loss`, which sums to the loss).

Reduction (losses.md 1.4): plain sums for every loss but GRPO, which normalises per agg_type
(grpo_terms.py).

Safe masking (losses.md 1.3): every input, the current logprobs included, is selected to 0 at
excluded positions *before* any arithmetic. Each per-token value and gradient coefficient there is
then exactly 0, so a NaN/inf at an excluded position (placeholder logprobs, padding) reaches
neither the loss nor the gradient; multiplying by the mask afterwards would not be enough, since
the backward of an overflowed exp is NaN even where its output is discarded.

Metrics count the positions that carry the policy (`policy_positions`): the inclusion m when a
request sends weights or mask; with neither, m = 1 everywhere (losses.md 1.3) and the metrics count
only positions whose sampler logprobs or advantages are non-zero, so a prompt sent without a mask
(logprobs and advantages 0 there, as tinker-cookbook sends it) is not reported as a policy token.
The loss itself always reduces over m.

The functions trust their inputs: every request was checked once, at the API edge, against
the loss table (posttrain/loss_specs.py: params ranges, required loss_fn_inputs, their values),
and a missing input the table requires is an internal error here, not a request error.
Non-finite results are the engine's to catch.

Legend: S = samples in the request, T = longest sample (padded positions have valid_ST False).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from posttrain.engine.train.grpo_terms import GRPO_AGGREGATIONS, grpo_log_ratio, k3_kl
from posttrain.types import (
    CispoParams,
    DppoParams,
    DroParams,
    GrpoParams,
    GspoParams,
    LossParams,
    LossType,
    PpoParams,
)


@dataclass(frozen=True)
class LossBatch:
    """Per-position inputs of one request, padded to [S, T] (float32; padding is 0).

    Optional tensors are None when the request did not send that loss_fn_inputs key."""

    valid_ST: Tensor  # bool: position t exists in sample s (t < N_s)
    weights_ST: Tensor | None = None
    mask_ST: Tensor | None = None
    sampler_logprobs_ST: Tensor | None = None  # wire key `logprobs`
    advantages_ST: Tensor | None = None
    reference_logprobs_ST: Tensor | None = None
    sequence_ratio_mask_ST: Tensor | None = None  # GSPO's ratio tokens (!= 0)


@dataclass(frozen=True)
class LossOutput:
    loss: Tensor  # scalar; exactly what is back-propagated and reported
    metrics: dict[str, float]
    included_ST: Tensor  # bool: positions whose logprobs are reported (others report 0.0)
    # Detached [S, T] share of `loss` per token (Tinker's elementwise_loss): the per-token loss
    # weighted as the reduction weights it, 0 where excluded, so it sums to `loss`.
    elementwise_ST: Tensor


LossFn = Callable[[Tensor, LossBatch, LossParams], LossOutput]

_ParamsT = TypeVar("_ParamsT", PpoParams, CispoParams, DppoParams, GrpoParams, GspoParams)


# ---------------------------------------------------------------- shared pieces


def policy_inclusion(batch: LossBatch) -> Tensor:
    """m of losses.md 1.3 for policy losses: weights or mask binarised, else every position."""
    if batch.weights_ST is not None:
        return batch.valid_ST & (batch.weights_ST != 0)
    if batch.mask_ST is not None:
        return batch.valid_ST & (batch.mask_ST != 0)
    return batch.valid_ST


def policy_positions(
    batch: LossBatch, included_ST: Tensor, sampler_ST: Tensor, advantages_ST: Tensor
) -> Tensor:
    """Positions a policy loss's metrics count (valid_tokens:sum and every token mean).

    With weights or mask: the inclusion m. With neither, every position is in the loss
    (losses.md 1.3), but a client that sends a whole sequence that way fills its prompt with
    placeholder logprobs 0 and advantages 0 (tinker-cookbook strips its mask before
    forward-backward; examples/tinker_shim.py). Those positions add nothing to the IS, PPO,
    CISPO or DPPO loss, yet counting them would report the prompt's logprobs as sampler mismatch
    and ratio, and its length as valid_tokens. So here a position counts when its sampler
    logprob or its advantage is non-zero. A sampled token's logprob is exactly 0 only when its
    probability rounds to 1 in float32; such a token still counts wherever its advantage is
    non-zero. `included_ST` is `policy_inclusion(batch)`; sampler_ST and advantages_ST are the
    request's q and A.
    """
    if batch.weights_ST is not None or batch.mask_ST is not None:
        return included_ST
    return included_ST & ((sampler_ST != 0) | (advantages_ST != 0))


def _require(tensor: Tensor | None, key: str) -> Tensor:
    assert tensor is not None, f"loss_fn_inputs[{key!r}] is required (loss_specs) but absent"
    return tensor


def _params(params: LossParams, params_type: type[_ParamsT]) -> _ParamsT:
    """The loss's params, or its defaults when the request sent none (DRO has no defaults)."""
    if params is None:
        return params_type()
    assert isinstance(params, params_type), f"expected {params_type.__name__}, got {params!r}"
    return params


def _select(included_ST: Tensor, values_ST: Tensor) -> Tensor:
    return torch.where(included_ST, values_ST, 0.0)


def _policy_inputs(
    logprobs_ST: Tensor, batch: LossBatch
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(m, counted, x, q, A): the loss's inclusion m, the positions its metrics count
    (`policy_positions`, a subset of m), and x, q, A selected to 0 wherever m is 0."""
    included_ST = policy_inclusion(batch)
    sampler_ST = _require(batch.sampler_logprobs_ST, "logprobs")
    advantages_ST = _require(batch.advantages_ST, "advantages")
    return (
        included_ST,
        policy_positions(batch, included_ST, sampler_ST, advantages_ST),
        _select(included_ST, logprobs_ST),
        _select(included_ST, sampler_ST),
        _select(included_ST, advantages_ST),
    )


def _token_mean(values_ST: Tensor, counted_ST: Tensor) -> float:
    """Mean over the counted positions of the whole request; 0.0 when none is counted."""
    count = int(counted_ST.sum())
    if count == 0:
        return 0.0
    return float(_select(counted_ST, values_ST.detach().to(torch.float64)).sum() / count)


def ratio_metrics(log_ratio_ST: Tensor, counted_ST: Tensor) -> dict[str, float]:
    """losses.md 10: token means over counted positions of the ratio and of -log ratio."""
    return {
        "loss/ratio/mean": _token_mean(torch.exp(log_ratio_ST), counted_ST),
        "loss/kl_policy/mean": _token_mean(-log_ratio_ST, counted_ST),
    }


def _policy_metrics(
    loss: Tensor, log_ratio_ST: Tensor, x_ST: Tensor, q_ST: Tensor, counted_ST: Tensor
) -> dict[str, float]:
    """Metrics every policy loss reports (losses.md 10), plus the mean |x - q| mismatch between
    the trainer's and the sampler's logprobs, which exposes sampler/trainer numerics drift.

    counted_ST is `policy_positions`: valid_tokens:sum is its count and every mean is over it."""
    return {
        "loss:sum": float(loss.detach()),
        "valid_tokens:sum": float(counted_ST.sum()),
        **ratio_metrics(log_ratio_ST.detach(), counted_ST),
        "loss/sampler_mismatch/mean": _token_mean((x_ST - q_ST).abs(), counted_ST),
    }


def _clipped_surrogate(
    ratio_ST: Tensor, advantages_ST: Tensor, low: float, high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """-min(rho A, clip(rho, lo, hi) A) of losses.md 4 and 9.2, plus where each side clipped.

    Written as a selection between -rho A and the constant -clip(rho) A: the same values as the
    min, but the clipped branch carries exactly zero gradient and a tie carries the full one.
    Returns (per-token loss, clipped high = A > 0 and rho > hi, clipped low = A < 0 and rho < lo).
    """
    ratio_d_ST = ratio_ST.detach()
    clipped_high_ST = (advantages_ST > 0) & (ratio_d_ST > high)
    clipped_low_ST = (advantages_ST < 0) & (ratio_d_ST < low)
    per_token_ST = torch.where(
        clipped_high_ST | clipped_low_ST,
        -ratio_d_ST.clamp(low, high) * advantages_ST,
        -ratio_ST * advantages_ST,
    )
    return per_token_ST, clipped_high_ST, clipped_low_ST


# ---------------------------------------------------------------- losses


def cross_entropy(logprobs_ST: Tensor, batch: LossBatch, params: LossParams) -> LossOutput:
    """losses.md 2: L = -sum_i sum_t w_it x_it, summed over all samples; dL/dx = -w.

    Fractional weights are honoured; inclusion (reported logprobs, valid_tokens:sum) is w != 0.
    logprobs_ST, weights_ST: [S, T]. Returns a scalar loss.
    """
    weights_ST = _require(batch.weights_ST, "weights")
    included_ST = batch.valid_ST & (weights_ST != 0)
    per_token_ST = -_select(included_ST, weights_ST) * _select(included_ST, logprobs_ST)
    loss = per_token_ST.sum()
    metrics = {"loss:sum": float(loss.detach()), "valid_tokens:sum": float(included_ST.sum())}
    return LossOutput(loss, metrics, included_ST, per_token_ST.detach())


def importance_sampling(logprobs_ST: Tensor, batch: LossBatch, params: LossParams) -> LossOutput:
    """losses.md 3: per included token -r A with r = exp(x - q), not clipped, not detached.

    dl/dx = -r A. Reduction: plain sum over included tokens of all samples. [S, T] -> scalar.
    """
    included_ST, counted_ST, x_ST, q_ST, advantages_ST = _policy_inputs(logprobs_ST, batch)
    log_ratio_ST = x_ST - q_ST
    per_token_ST = -torch.exp(log_ratio_ST) * advantages_ST
    loss = per_token_ST.sum()
    metrics = _policy_metrics(loss, log_ratio_ST, x_ST, q_ST, counted_ST)
    return LossOutput(loss, metrics, included_ST, per_token_ST.detach())


def ppo(logprobs_ST: Tensor, batch: LossBatch, params: LossParams) -> LossOutput:
    """losses.md 4: per included token -min(r A, clip(r, lo, hi) A), r = exp(x - q).

    lo, hi are absolute ratio bounds (default 0.8, 1.2). dl/dx = -r A, except 0 where the clip
    bites (A > 0 and r > hi, or A < 0 and r < lo); no dual clip, so A < 0 and r > hi keeps the
    full gradient. Reduction: plain sum over included tokens of all samples. [S, T] -> scalar.
    """
    ppo_params = _params(params, PpoParams)
    included_ST, counted_ST, x_ST, q_ST, advantages_ST = _policy_inputs(logprobs_ST, batch)
    log_ratio_ST = x_ST - q_ST
    per_token_ST, clipped_high_ST, clipped_low_ST = _clipped_surrogate(
        torch.exp(log_ratio_ST),
        advantages_ST,
        ppo_params.clip_low_threshold,
        ppo_params.clip_high_threshold,
    )
    loss = per_token_ST.sum()
    metrics = _policy_metrics(loss, log_ratio_ST, x_ST, q_ST, counted_ST)
    metrics["loss/clip/high_fraction"] = _token_mean(clipped_high_ST, counted_ST)
    metrics["loss/clip/low_fraction"] = _token_mean(clipped_low_ST, counted_ST)
    return LossOutput(loss, metrics, included_ST, per_token_ST.detach())


def cispo(logprobs_ST: Tensor, batch: LossBatch, params: LossParams) -> LossOutput:
    """losses.md 5: per included token -sg(clip(r, lo, hi)) A x, r = exp(x - q).

    The clipped ratio is detached, so dl/dx = -clip(r, lo, hi) A: every token keeps a gradient.
    lo, hi default 0.0, 4.0. The clip fractions are not gated by the sign of A.
    Reduction: plain sum over included tokens of all samples. [S, T] -> scalar.
    """
    cispo_params = _params(params, CispoParams)
    low, high = cispo_params.clip_low_threshold, cispo_params.clip_high_threshold
    included_ST, counted_ST, x_ST, q_ST, advantages_ST = _policy_inputs(logprobs_ST, batch)
    log_ratio_ST = x_ST - q_ST
    ratio_d_ST = torch.exp(log_ratio_ST).detach()
    per_token_ST = -ratio_d_ST.clamp(low, high) * advantages_ST * x_ST
    loss = per_token_ST.sum()
    metrics = _policy_metrics(loss, log_ratio_ST, x_ST, q_ST, counted_ST)
    metrics["loss/clip/high_fraction"] = _token_mean(ratio_d_ST > high, counted_ST)
    metrics["loss/clip/low_fraction"] = _token_mean(ratio_d_ST < low, counted_ST)
    return LossOutput(loss, metrics, included_ST, per_token_ST.detach())


def dro(logprobs_ST: Tensor, batch: LossBatch, params: LossParams) -> LossOutput:
    """losses.md 6: per included token -(A x - beta/2 (x - q)^2); no ratio, nothing detached.

    dl/dx = -A + beta (x - q). beta is required (no default). The quadratic term does not vanish
    where A = 0. Reduction: plain sum over included tokens of all samples. [S, T] -> scalar.
    """
    assert isinstance(params, DroParams), (
        f"DRO needs DroParams (beta has no default), got {params!r}"
    )
    included_ST, counted_ST, x_ST, q_ST, advantages_ST = _policy_inputs(logprobs_ST, batch)
    log_ratio_ST = x_ST - q_ST
    per_token_ST = -(advantages_ST * x_ST - 0.5 * params.beta * log_ratio_ST.square())
    loss = per_token_ST.sum()
    metrics = _policy_metrics(loss, log_ratio_ST, x_ST, q_ST, counted_ST)
    return LossOutput(loss, metrics, included_ST, per_token_ST.detach())


def dppo(logprobs_ST: Tensor, batch: LossBatch, params: LossParams) -> LossOutput:
    """losses.md 7: per included token -A sg(r) keep x, r = exp(x - q) (Binary-TV DPPO).

    keep (detached) = [exp(x) - exp(q) <= delta_high] if A > 0, else [exp(x) - exp(q) >=
    -delta_low]: a token stops being pushed once its probability moved past the trust region in
    the direction of its advantage. dl/dx = -A r keep. No ratio truncation. The gate is applied
    by selection, so a token outside the region contributes exactly 0 whatever its ratio.
    Reduction: plain sum over included tokens of all samples. [S, T] -> scalar.
    """
    dppo_params = _params(params, DppoParams)
    included_ST, counted_ST, x_ST, q_ST, advantages_ST = _policy_inputs(logprobs_ST, batch)
    log_ratio_ST = x_ST - q_ST
    prob_change_ST = (torch.exp(x_ST) - torch.exp(q_ST)).detach()
    is_positive_ST = advantages_ST > 0
    keep_ST = torch.where(
        is_positive_ST,
        prob_change_ST <= dppo_params.delta_high,
        prob_change_ST >= -dppo_params.delta_low,
    )
    ratio_d_ST = torch.exp(log_ratio_ST).detach()
    per_token_ST = torch.where(keep_ST, -advantages_ST * ratio_d_ST * x_ST, 0.0)
    loss = per_token_ST.sum()
    metrics = _policy_metrics(loss, log_ratio_ST, x_ST, q_ST, counted_ST)
    metrics["loss/clip/high_fraction"] = _token_mean(
        is_positive_ST & (prob_change_ST > dppo_params.delta_high), counted_ST
    )
    metrics["loss/clip/low_fraction"] = _token_mean(
        (advantages_ST < 0) & (prob_change_ST < -dppo_params.delta_low), counted_ST
    )
    return LossOutput(loss, metrics, included_ST, per_token_ST.detach())


def grpo(logprobs_ST: Tensor, batch: LossBatch, params: LossParams) -> LossOutput:
    """losses.md 9: per included token l = -min(rho A, clip(rho, lo, hi) A) + beta k3, then
    normalised within the request by agg_type.

    rho is the token ratio exp(x - q) or, for ratio_type SEQUENCE, the GSPO sequence ratio
    (9.3). k3 = exp(u) - u - 1, u = clamp(ref - x, -10, 10), needs reference_logprobs when
    beta > 0. dL/dx_it = c_it (-A rho [not clipped] + beta (1 - exp(u)) [not clamped]), with
    c_it = 1/(S H) (FIXED_HORIZON, default), 1/M (TOKEN_MEAN) or 1/(S+ n_i) (SEQUENCE_MEAN).
    Defaults lo 0.8, hi 1.28, beta 0. [S, T] -> scalar.
    """
    grpo_params = _params(params, GrpoParams)
    low, high = grpo_params.clip_low_threshold, grpo_params.clip_high_threshold
    included_ST, counted_ST, x_ST, q_ST, advantages_ST = _policy_inputs(logprobs_ST, batch)
    log_ratio_ST = grpo_log_ratio(x_ST, q_ST, included_ST, grpo_params.ratio_type)
    ratio_ST = torch.exp(log_ratio_ST)
    per_token_ST, clipped_high_ST, clipped_low_ST = _clipped_surrogate(
        ratio_ST, advantages_ST, low, high
    )
    kl_ST = None
    if batch.reference_logprobs_ST is not None:
        kl_ST = k3_kl(_select(included_ST, batch.reference_logprobs_ST), x_ST)
    if grpo_params.beta > 0:
        per_token_ST = per_token_ST + grpo_params.beta * _require(kl_ST, "reference_logprobs")
    aggregate = GRPO_AGGREGATIONS[grpo_params.agg_type]
    loss, elementwise_ST = aggregate(per_token_ST, included_ST, batch.valid_ST)

    metrics = _policy_metrics(loss, log_ratio_ST, x_ST, q_ST, counted_ST)
    metrics["loss/clip/clipped_ratio/mean"] = _token_mean(
        ratio_ST.detach().clamp(low, high), counted_ST
    )
    metrics["loss/clip/high_fraction"] = _token_mean(clipped_high_ST, counted_ST)
    metrics["loss/clip/low_fraction"] = _token_mean(clipped_low_ST, counted_ST)
    if kl_ST is not None:
        metrics["loss/kl_ref/mean"] = _token_mean(kl_ST, counted_ST)
    return LossOutput(loss, metrics, included_ST, elementwise_ST)


def gspo(logprobs_ST: Tensor, batch: LossBatch, params: LossParams) -> LossOutput:
    """Tinker's gspo (GSPO-token): per included token -min(s_t A, clip(s_t, lo, hi) A), plain sum.

    s_t = exp(x_t - sg(x_t) + sg(lambda_i)): value s_i = exp(lambda_i), lambda_i the mean of
    x - q over the sample's ratio tokens M (sequence_ratio_mask != 0; none: lambda_i = 0), and
    ds_t/dx_t = s_i. Unlike GRPO SEQUENCE, M is its own set (the loss still sums over the
    inclusion m) and the reduction is a plain sum. Defaults lo 0.8, hi 1.2. [S, T] -> scalar.
    """
    gspo_params = _params(params, GspoParams)
    low, high = gspo_params.clip_low_threshold, gspo_params.clip_high_threshold
    included_ST, counted_ST, _, _, advantages_ST = _policy_inputs(logprobs_ST, batch)
    in_ratio_ST = batch.valid_ST & (
        _require(batch.sequence_ratio_mask_ST, "sequence_ratio_mask") != 0
    )
    read_ST = included_ST | in_ratio_ST
    x_ST = _select(read_ST, logprobs_ST)
    q_ST = _select(read_ST, _require(batch.sampler_logprobs_ST, "logprobs"))
    in_ratio_S = in_ratio_ST.sum(dim=1).clamp(min=1)
    mean_log_ratio_S = _select(in_ratio_ST, x_ST - q_ST).detach().sum(dim=1) / in_ratio_S
    log_ratio_ST = _select(included_ST, x_ST - x_ST.detach() + mean_log_ratio_S[:, None])
    per_token_ST, clipped_high_ST, clipped_low_ST = _clipped_surrogate(
        torch.exp(log_ratio_ST), advantages_ST, low, high
    )
    per_token_ST = _select(included_ST, per_token_ST)
    loss = per_token_ST.sum()
    metrics = _policy_metrics(loss, log_ratio_ST, x_ST, q_ST, counted_ST)
    metrics["loss/clip/high_fraction"] = _token_mean(clipped_high_ST, counted_ST)
    metrics["loss/clip/low_fraction"] = _token_mean(clipped_low_ST, counted_ST)
    return LossOutput(loss, metrics, read_ST, per_token_ST.detach())


LOSSES: dict[LossType, LossFn] = {
    LossType.CROSS_ENTROPY: cross_entropy,
    LossType.IMPORTANCE_SAMPLING: importance_sampling,
    LossType.PPO: ppo,
    LossType.CISPO: cispo,
    LossType.DRO: dro,
    LossType.DPPO: dppo,
    LossType.GRPO: grpo,
    LossType.GSPO: gspo,
}
