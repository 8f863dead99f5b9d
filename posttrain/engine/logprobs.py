"""Per-token log-probabilities in float32: the one function training, scoring and sampling share.

A sampler's logprob of a token and a forward pass over the same tokens therefore agree up to
the numerics of the two forward passes. The log-softmax runs over chunks of positions so the full
[tokens, vocab] float32 tensor of a batch never exists at once. Under autograd a chunk's
[tokens, vocab] values are not kept for backward either:

- a frozen bias-free linear head (a LoRA session without train_unembed): the gradient of each
  logprob with respect to its hidden state is computed in forward, while the chunk's softmax is
  at hand, and kept instead ([tokens, hidden], the size of the hidden states). Backward is then
  a scale, so the head costs the same two matmuls as a naive full log-softmax;
- any other head (LoRA on the head, full-weight training): each chunk is recomputed in backward
  (activation checkpointing), one head matmul more, because its weights' gradients need the
  softmax and the loss's gradient together.

Legend: B = rows, T = tokens, C = tokens of a chunk, V = vocab, H = hidden size.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from posttrain.model.lora import LoraLinear


def log_softmax_float32(logits_BV: Tensor) -> Tensor:
    """Log-softmax over the vocabulary in float32, whatever dtype the model computes in."""
    return torch.log_softmax(logits_BV.float(), dim=-1)


def _chunk_logprobs(head: nn.Module, hidden_BCH: Tensor, targets_BC: Tensor) -> Tensor:
    logprobs_BCV = log_softmax_float32(head(hidden_BCH))
    return logprobs_BCV.gather(-1, targets_BC.unsqueeze(-1)).squeeze(-1)


class _FrozenHeadLogprobs(torch.autograd.Function):
    """logprob of each target under a frozen linear head, its hidden-state gradient computed in
    forward:  d logp_t / d h_t = (onehot(target_t) - softmax_t) @ W."""

    @staticmethod
    def forward(ctx, hidden_BCH: Tensor, targets_BC: Tensor, weight_VH: Tensor) -> Tensor:
        # One [B, C, V] buffer, worked in place: logits, then exp(logits - max), then
        # onehot - softmax. The logprob is formed as log_softmax forms it: (x - max) - log sum.
        work_BCV = F.linear(hidden_BCH, weight_VH).float()
        index_BC1 = targets_BC.unsqueeze(-1)
        max_BC1 = work_BCV.amax(dim=-1, keepdim=True)
        picked_BC1 = work_BCV.gather(-1, index_BC1) - max_BC1
        sum_BC1 = work_BCV.sub_(max_BC1).exp_().sum(dim=-1, keepdim=True)
        logprobs_BC = (picked_BC1 - sum_BC1.log()).squeeze(-1)
        residual_BCV = work_BCV.mul_(-sum_BC1.reciprocal())
        residual_BCV.scatter_add_(-1, index_BC1, torch.ones_like(index_BC1, dtype=torch.float32))
        # Cast as autograd would cast the float32 logits' gradient back to the head's dtype.
        ctx.save_for_backward(residual_BCV.to(weight_VH.dtype) @ weight_VH)
        return logprobs_BC

    @staticmethod
    def backward(ctx, grad_BC: Tensor) -> tuple[Tensor, None, None]:
        (unit_BCH,) = ctx.saved_tensors
        grad_BCH = grad_BC.unsqueeze(-1) * unit_BCH.float()
        return grad_BCH.to(unit_BCH.dtype), None, None


def _frozen_weight(head: nn.Module) -> Tensor | None:
    """W when head(x) is x @ W.T with W frozen (so only the hidden states need gradients)."""
    if isinstance(head, LoraLinear):
        if head.adapts():
            return None
        head = head.base
    if isinstance(head, nn.Linear) and head.bias is None and not head.weight.requires_grad:
        return head.weight
    return None


def target_logprobs(
    head: nn.Module,
    hidden_BTH: Tensor,
    targets_BT: Tensor,
    *,
    chunk_tokens: int,
    recompute_context: Callable[[], AbstractContextManager[object]] = nullcontext,
) -> Tensor:
    """logprob of targets_BT[b, t] under the distribution the head gives at hidden_BTH[b, t].

    Returns float32 [B, T]. `head` is the output projection (with its adapters routed);
    `recompute_context` is entered around a chunk's recomputation in backward, which runs after
    the caller's forward has returned (e.g. to route the head's adapters again)."""
    chunk = max(1, chunk_tokens // max(1, hidden_BTH.shape[0]))
    training = torch.is_grad_enabled() and hidden_BTH.requires_grad
    weight = _frozen_weight(head) if training else None
    pieces: list[Tensor] = []
    for start in range(0, hidden_BTH.shape[1], chunk):
        hidden_BCH = hidden_BTH[:, start : start + chunk]
        targets_BC = targets_BT[:, start : start + chunk]
        if not training:
            pieces.append(_chunk_logprobs(head, hidden_BCH, targets_BC))
        elif weight is not None:
            pieces.append(_FrozenHeadLogprobs.apply(hidden_BCH, targets_BC, weight))
        else:
            pieces.append(
                checkpoint(
                    _chunk_logprobs,
                    head,
                    hidden_BCH,
                    targets_BC,
                    use_reentrant=False,
                    context_fn=lambda: (nullcontext(), recompute_context()),
                )
            )
    return torch.cat(pieces, dim=1)
