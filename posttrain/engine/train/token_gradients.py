"""dL/dx_t of a per-token loss, for the logprobs of one chunk, while that chunk is formed.

A head whose weights train (a LoRA head, train_unembed) needs dL/dlogits = g_t (onehot - p_t)
for its weight gradients, and g_t = dL/dx_t is only known once the loss is. When the loss is a
sum of per-token terms whose gradient at a token depends on that token's logprob alone (and on
batch constants: weights, advantages, sampler logprobs, normalisers counted from the masks),
g_t can be had as soon as the chunk's logprobs exist, so the head's gradients are formed in
forward from the chunk's softmax and no chunk is recomputed in backward (train/logprobs.py).

The loss function itself gives g: it runs on a batch tensor holding the chunk's logprobs at
their positions (zeros elsewhere) and autograd differentiates it. For a separable loss the
gradient at the chunk's positions is then computed by exactly the ops and values of the real
backward, so it is bitwise the gradient the chunk receives; train/logprobs.py still compares
the two in backward and recomputes the chunk where they differ, so a loss wrongly listed here
costs time, never exactness.

Legend: S = samples, T = tokens, B = rows of a bucket, C = columns of a chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.engine.train.batching import PackedBatch, member_loss_batch
from posttrain.engine.train.losses import LOSSES, LossBatch
from posttrain.types import (
    ForwardBackwardRequest,
    GrpoParams,
    GrpoRatioType,
    LossConfig,
    LossType,
)

# (batch rows, columns, logprobs): index tensors broadcasting to the logprobs' shape (a chunk's
# [B, 1] rows and [1, C] columns, or [1, N] of each for picked positions) -> dL/dx there.
TokenGradient = Callable[[Tensor, Tensor, Tensor], Tensor]

# Losses whose gradient at a token reads only that token's logprob (losses.md 2-9). GRPO's
# sequence ratio (GSPO) reads the mean over the sample and is left out.
SEPARABLE = frozenset(
    {
        LossType.CROSS_ENTROPY,
        LossType.IMPORTANCE_SAMPLING,
        LossType.PPO,
        LossType.CISPO,
        LossType.DRO,
        LossType.DPPO,
        LossType.GRPO,
    }
)


def is_separable(loss: LossConfig) -> bool:
    if loss.type not in SEPARABLE:
        return False
    params = loss.params
    return not (isinstance(params, GrpoParams) and params.ratio_type != GrpoRatioType.TOKEN)


def token_gradient(loss: LossConfig, batch: LossBatch) -> TokenGradient | None:
    """dL/dx at a chunk's positions for `loss` over `batch` ([S, T] loss inputs, the rows of
    the forward in batch order), or None when the loss is not separable."""
    if not is_separable(loss):
        return None
    loss_fn = LOSSES[loss.type]
    valid_ST = batch.valid_ST

    def gradient(rows: Tensor, columns: Tensor, logprobs_BC: Tensor) -> Tensor:
        x_ST = torch.zeros(valid_ST.shape, device=valid_ST.device)
        x_ST[rows, columns] = logprobs_BC.detach()
        # The trainer hands the loss where(valid, logprobs, 0): the same values here.
        x_ST = torch.where(valid_ST, x_ST, 0.0).requires_grad_()
        with torch.enable_grad():
            value = loss_fn(x_ST, batch, loss.params).loss
            if not value.requires_grad:  # no position is in the loss
                return torch.zeros_like(logprobs_BC)
            (g_ST,) = torch.autograd.grad(value, x_ST)
        # where's backward: padding positions receive 0 whatever the loss says of them.
        return torch.where(valid_ST, g_ST, 0.0)[rows, columns]

    return gradient


def given_gradient(gradients_ST: Tensor, valid_ST: Tensor) -> TokenGradient:
    """The token gradients of a custom forward-backward's surrogate sum g * x (api.md 1.4.3):
    the client's g itself, 0 at padding."""
    masked_ST = torch.where(valid_ST, gradients_ST, 0.0)

    def gradient(rows: Tensor, columns: Tensor, logprobs_BC: Tensor) -> Tensor:
        return masked_ST[rows, columns]

    return gradient


def needed_positions(loss: LossConfig, batch: LossBatch) -> Tensor:
    """[S, T] bool: the positions whose logprob `loss` reads (its inclusion m, losses.md 1.3).
    Every loss reads x only where m is 1 and reports 0 elsewhere, so a forward-backward need
    not run the output head at the others (an RL batch's prompt positions). m depends on the
    weights or mask alone, so the loss on zeros gives it."""
    with torch.no_grad():
        zeros_ST = torch.zeros(batch.valid_ST.shape, device=batch.valid_ST.device)
        return LOSSES[loss.type](zeros_ST, batch, loss.params).included_ST


def needed_by_members(
    merged: PackedBatch, members: list[tuple[int, ForwardBackwardRequest]]
) -> Tensor:
    """[S, T] of a shared pass: the positions whose logprobs some member's loss reads (all of
    a member's when it reports every logprob). `members`: (first row, request) each."""
    needed_ST = torch.zeros_like(merged.loss_batch.valid_ST)
    for first_row, request in members:
        rows = range(first_row, first_row + len(request.samples))
        batch = member_loss_batch(merged, rows, request.samples)
        width = batch.valid_ST.shape[1]
        needed = needed_positions(request.loss, batch)
        needed = needed | batch.valid_ST if request.report_all_logprobs else needed
        needed_ST[first_row : rows.stop, :width] = needed
    return needed_ST
