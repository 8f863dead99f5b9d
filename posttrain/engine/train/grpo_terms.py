"""GRPO's pieces beside its clipped surrogate: the ratio (token or GSPO sequence), the k3 KL
term and the reductions by agg_type (../shared/reference/losses.md 9.2-9.4).

Each reduction returns the scalar that is back-propagated and the per-token share of it (the
elementwise loss Tinker reports): the per-token loss times the token's coefficient c_it, so
that the shares sum to the loss (up to float rounding; the loss itself is reduced as before).

Not here: the surrogate and the metrics (losses.py).

Legend: S = samples in the request, T = longest sample (padded positions have valid_ST False).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.types import GrpoAggregation, GrpoRatioType

# (per-token loss, inclusion m, valid positions) -> (loss, its per-token share [S, T])
Aggregation = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def grpo_log_ratio(
    x_ST: Tensor, q_ST: Tensor, included_ST: Tensor, ratio_type: GrpoRatioType
) -> Tensor:
    """log rho of losses.md 9.3 (x and q already 0 at excluded positions).

    TOKEN: x - q. SEQUENCE (GSPO-token): value lambda_i, the sample's mean of x - q over its
    included tokens, at each included token; written x - sg(x) + sg(lambda_i) so that
    d rho_it / d x_it = s_i = exp(lambda_i) and nothing flows to the sample's other tokens.
    """
    log_ratio_ST = x_ST - q_ST
    if ratio_type == GrpoRatioType.TOKEN:
        return log_ratio_ST
    num_included_S = included_ST.sum(dim=1).clamp(min=1)
    mean_log_ratio_S = log_ratio_ST.detach().sum(dim=1) / num_included_S
    return torch.where(included_ST, x_ST - x_ST.detach() + mean_log_ratio_S[:, None], 0.0)


def k3_kl(reference_ST: Tensor, x_ST: Tensor) -> Tensor:
    """k3 estimate of KL(pi || ref) per token (losses.md 9.2): exp(u) - u - 1, u = ref - x.

    u is clamped to [-10, 10] (XORL) so a token the reference finds far likelier cannot
    overflow exp; where the clamp is active the term has no gradient."""
    u_ST = (reference_ST - x_ST).clamp(-10.0, 10.0)
    return torch.exp(u_ST) - u_ST - 1.0


def _fixed_horizon(
    per_token_ST: Tensor, included_ST: Tensor, valid_ST: Tensor
) -> tuple[Tensor, Tensor]:
    """sum / (S * H), H = the request's longest sample (all its positions counted)."""
    num_samples, horizon = valid_ST.shape[0], int(valid_ST.sum(dim=1).max())
    denominator = max(num_samples * horizon, 1)
    return per_token_ST.sum() / denominator, per_token_ST.detach() / denominator


def _token_mean(
    per_token_ST: Tensor, included_ST: Tensor, valid_ST: Tensor
) -> tuple[Tensor, Tensor]:
    """sum / max(M, 1), M = included tokens of the request."""
    denominator = max(int(included_ST.sum()), 1)
    return per_token_ST.sum() / denominator, per_token_ST.detach() / denominator


def _sequence_mean(
    per_token_ST: Tensor, included_ST: Tensor, valid_ST: Tensor
) -> tuple[Tensor, Tensor]:
    """Mean over samples with n_i > 0 of each sample's mean over its included tokens."""
    num_included_S = included_ST.sum(dim=1)
    per_sample_S = per_token_ST.sum(dim=1) / num_included_S.clamp(min=1)
    num_counted = max(int((num_included_S > 0).sum()), 1)
    share_ST = per_token_ST.detach() / num_included_S.clamp(min=1)[:, None] / num_counted
    return per_sample_S.sum() / num_counted, share_ST


# losses.md 9.4; per_token_ST is already 0 at excluded positions.
GRPO_AGGREGATIONS: dict[GrpoAggregation, Aggregation] = {
    GrpoAggregation.FIXED_HORIZON: _fixed_horizon,
    GrpoAggregation.TOKEN_MEAN: _token_mean,
    GrpoAggregation.SEQUENCE_MEAN: _sequence_mean,
}
