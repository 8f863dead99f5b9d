"""Per-token log-probabilities in float32: the one function training, scoring and sampling share.

A sampler's logprob of a token and a forward pass over the same tokens therefore agree up to
the numerics of the two forward passes. The log-softmax runs over chunks of positions so the full
[tokens, vocab] float32 tensor of a batch never exists at once. Under autograd a chunk's
[tokens, vocab] values are not kept for backward either:

- a frozen bias-free linear head (a LoRA session without train_unembed): the gradient of each
  logprob with respect to its hidden state is computed in forward, while the chunk's softmax is
  at hand, and kept instead ([tokens, hidden], the size of the hidden states). Backward is then
  a scale, so the head costs the same two matmuls as a naive full log-softmax;
- a LoRA head (train_unembed) of one adapter on every row, when the caller knows each token's
  loss gradient g_t as soon as the chunk's logprobs exist (a per-token loss,
  train/token_gradients.py): the adapter's gradients and the hidden states' are formed in
  forward from g_t (onehot - softmax_t) and kept ([R, H] + [V, R] summed over the chunks,
  [tokens, H]);
  backward hands them on after checking that the gradient it receives is that g exactly
  (else it recomputes the chunk), so this head too costs two head matmuls;
- any other head (several sessions' adapters, dropout on the head, full-weight training, a
  loss whose token gradient is not local): each chunk is recomputed in backward (activation
  checkpointing), one head matmul more, because its weights' gradients need the softmax and the
  loss's gradient together.

Legend: B = rows, T = tokens, C = tokens of a chunk, V = vocab, H = hidden size, R = rank,
N = B * C.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from posttrain.model.lora import AdapterWeights, LoraLinear

# (first column of a chunk, its logprobs [B, C]) -> dL/dlogprobs [B, C]; see token_gradients.py.
ChunkGradient = Callable[[int, Tensor], Tensor]

# Chunks by the path that formed their gradients: "frozen", "trained" (formed in forward),
# "recomputed" (a trained chunk whose received gradient was not the predicted one) and
# "checkpoint". Read by tests, so a per-token loss is seen to take the fast path.
chunk_paths: Counter[str] = Counter()


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
    def forward(ctx: Any, hidden_BCH: Tensor, targets_BC: Tensor, weight_VH: Tensor) -> Tensor:
        # One [B, C, V] buffer, worked in place: logits, then exp(logits - max), then
        # onehot - softmax. The logprob is formed as log_softmax forms it: (x - max) - log sum.
        work_BCV = F.linear(hidden_BCH, weight_VH).float()
        logprobs_BC, residual_BCV = _softmax_residual(work_BCV, targets_BC)
        # Cast as autograd would cast the float32 logits' gradient back to the head's dtype.
        ctx.save_for_backward(residual_BCV.to(weight_VH.dtype) @ weight_VH)
        return logprobs_BC

    @staticmethod
    def backward(ctx: Any, grad_BC: Tensor) -> tuple[Tensor, None, None]:
        (unit_BCH,) = ctx.saved_tensors
        grad_BCH = grad_BC.unsqueeze(-1) * unit_BCH.float()
        return grad_BCH.to(unit_BCH.dtype), None, None


def _softmax_residual(logits_BCV: Tensor, targets_BC: Tensor) -> tuple[Tensor, Tensor]:
    """(logprobs [B, C], onehot - softmax [B, C, V]) from float32 logits, worked in place."""
    index_BC1 = targets_BC.unsqueeze(-1)
    max_BC1 = logits_BCV.amax(dim=-1, keepdim=True)
    picked_BC1 = logits_BCV.gather(-1, index_BC1) - max_BC1
    sum_BC1 = logits_BCV.sub_(max_BC1).exp_().sum(dim=-1, keepdim=True)
    logprobs_BC = (picked_BC1 - sum_BC1.log()).squeeze(-1)
    residual_BCV = logits_BCV.mul_(-sum_BC1.reciprocal())
    residual_BCV.scatter_add_(-1, index_BC1, torch.ones_like(index_BC1, dtype=torch.float32))
    return logprobs_BC, residual_BCV


def _lora_logits(
    hidden: Tensor, weight: Tensor, lora_A: Tensor, lora_B: Tensor, scale: float
) -> Tensor:
    """The head's logits exactly as LoraLinear.forward forms them for one adapter on every row."""
    out = F.linear(hidden, weight)
    delta = ((hidden.to(lora_A.dtype) @ lora_A.t()) @ lora_B.t()).to(out.dtype)
    return out.add_(delta, alpha=scale)


class _HeadAdapterGradients:
    """The adapter gradients of all of one call's chunks, summed as they are formed, so a
    trained head keeps one [R, H] + [V, R] pair, not one per chunk. The chunk whose backward
    runs last hands the sum to autograd; the others hand on nothing for the adapter."""

    def __init__(self) -> None:
        self.grad_A: Tensor | None = None
        self.grad_B: Tensor | None = None
        self.pending = 0

    def add(self, grad_A: Tensor, grad_B: Tensor, sign: float = 1.0) -> None:
        if self.grad_A is None or self.grad_B is None:
            self.grad_A, self.grad_B = grad_A * sign, grad_B * sign
        else:
            self.grad_A.add_(grad_A, alpha=sign)
            self.grad_B.add_(grad_B, alpha=sign)


def _fused_grads(
    hidden_BCH: Tensor,
    targets_BC: Tensor,
    weight_VH: Tensor,
    lora_A: Tensor,
    lora_B: Tensor,
    scale: float,
    gradient: Callable[[Tensor], Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(logprobs, g, dh, dA, dB) of one chunk, g = gradient(logprobs) the loss's token
    gradients, by the formulas of _TrainedHeadLogprobs."""
    # The order of autograd's own backward of the recomputed chunk, so both agree to float32
    # rounding: softmax as exp(logprobs), dlogits = g onehot - g softmax, the scale applied
    # to dlogits before the adapter's matmuls (as add_'s alpha is in backward).
    work_BCV = _lora_logits(hidden_BCH, weight_VH, lora_A, lora_B, scale).float()
    index_BC1 = targets_BC.unsqueeze(-1)
    work_BCV.sub_(work_BCV.amax(dim=-1, keepdim=True))
    log_sum_BC1 = torch.logsumexp(work_BCV, dim=-1, keepdim=True)
    logprobs_BCV = work_BCV.sub_(log_sum_BC1)
    logprobs_BC = logprobs_BCV.gather(-1, index_BC1).squeeze(-1)
    g_BC = gradient(logprobs_BC)
    g_BC1 = g_BC.unsqueeze(-1)
    dlogits_BCV = logprobs_BCV.exp_().mul_(-g_BC1).scatter_add_(-1, index_BC1, g_BC1)
    dlogits_NV = dlogits_BCV.flatten(0, 1)
    hidden_NH = hidden_BCH.flatten(0, 1).to(lora_A.dtype)
    scaled_NV = dlogits_NV * scale
    through_B_NR = scaled_NV @ lora_B
    grad_A = through_B_NR.t() @ hidden_NH
    grad_B = scaled_NV.t() @ (hidden_NH @ lora_A.t())
    del scaled_NV
    # Cast as autograd would cast the float32 logits' gradient back to the head's dtype.
    grad_NH = (dlogits_NV.to(weight_VH.dtype) @ weight_VH).to(lora_A.dtype)
    grad_NH.add_(through_B_NR @ lora_A)
    grad_BCH = grad_NH.view_as(hidden_BCH).to(hidden_BCH.dtype)
    return logprobs_BC, g_BC, grad_BCH, grad_A, grad_B


class _TrainedHeadLogprobs(torch.autograd.Function):
    """logprob of each target under a frozen linear head plus one LoRA adapter, all gradients
    formed in forward from the token gradients g (see the module docstring):

        dlogits_t = g_t (onehot_t - softmax_t)          dB = s dlogits^T (h A^T)
        dh_t = dlogits_t (W + s B A)                    dA = s (dlogits B)^T h
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden_BCH: Tensor,
        targets_BC: Tensor,
        weight_VH: Tensor,
        lora_A: Tensor,
        lora_B: Tensor,
        scale: float,
        gradient: ChunkGradient,
        start: int,
        summed: _HeadAdapterGradients,
    ) -> Tensor:
        logprobs_BC, g_BC, grad_BCH, grad_A, grad_B = _fused_grads(
            hidden_BCH, targets_BC, weight_VH, lora_A, lora_B, scale,
            lambda logprobs: gradient(start, logprobs),
        )  # fmt: skip
        summed.add(grad_A, grad_B)
        summed.pending += 1
        ctx.save_for_backward(hidden_BCH, targets_BC, weight_VH, lora_A, lora_B, g_BC)
        ctx.grad_BCH = grad_BCH
        ctx.scale = scale
        ctx.summed = summed
        return logprobs_BC

    @staticmethod
    def backward(ctx: Any, grad_BC: Tensor) -> tuple[Tensor | None, ...]:
        hidden, targets, weight, lora_A, lora_B, g_BC = ctx.saved_tensors
        summed: _HeadAdapterGradients = ctx.summed
        grad_h, grad_A, grad_B = ctx.grad_BCH, None, None
        del ctx.grad_BCH, ctx.summed  # free them with the graph's other buffers
        if not torch.equal(grad_BC, g_BC):
            chunk_paths["recomputed"] += 1
            # Take this chunk's predicted share back out of the sum and give its true one.
            _, _, _, predicted_A, predicted_B = _fused_grads(
                hidden, targets, weight, lora_A, lora_B, ctx.scale, lambda _: g_BC
            )
            summed.add(predicted_A, predicted_B, sign=-1.0)
            grad_h, grad_A, grad_B = _recomputed_lora_grads(
                hidden, targets, weight, lora_A, lora_B, ctx.scale, grad_BC
            )
        summed.pending -= 1
        if summed.pending == 0:  # the last chunk: the sum of every chunk's share
            assert summed.grad_A is not None and summed.grad_B is not None
            grad_A = summed.grad_A if grad_A is None else grad_A + summed.grad_A
            grad_B = summed.grad_B if grad_B is None else grad_B + summed.grad_B
            summed.grad_A = summed.grad_B = None
        return grad_h, None, None, grad_A, grad_B, None, None, None, None


def _recomputed_lora_grads(
    hidden: Tensor,
    targets: Tensor,
    weight: Tensor,
    lora_A: Tensor,
    lora_B: Tensor,
    scale: float,
    grad_BC: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dh, dA, dB) of a chunk for an arbitrary upstream gradient, by autograd on the chunk."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (hidden, lora_A, lora_B)]
        logits = _lora_logits(leaves[0], weight, leaves[1], leaves[2], scale)
        logprobs = log_softmax_float32(logits).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        grad_h, grad_A, grad_B = torch.autograd.grad(logprobs, leaves, grad_BC)
        return grad_h, grad_A, grad_B


def _lone_adapter(head: nn.Module) -> tuple[Tensor, AdapterWeights] | None:
    """(W, the adapter) when head(x) is x @ W.T plus one dropout-free adapter on every row,
    W frozen and bias-free: the shape _TrainedHeadLogprobs handles."""
    if not isinstance(head, LoraLinear) or len(head.routing) != 1:
        return None
    key, rows = head.routing[0]
    adapter = head.adapters.get(key)
    base = head.base
    if adapter is None or rows is not None or adapter.dropout > 0:
        return None
    if base.bias is not None or base.weight.requires_grad:
        return None
    return base.weight, adapter


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
    gradient: ChunkGradient | None = None,
) -> Tensor:
    """logprob of targets_BT[b, t] under the distribution the head gives at hidden_BTH[b, t].

    Returns float32 [B, T]. `head` is the output projection (with its adapters routed);
    `recompute_context` is entered around a chunk's recomputation in backward, which runs after
    the caller's forward has returned (e.g. to route the head's adapters again). `gradient`,
    when the loss is per-token, gives each chunk's dL/dlogprobs as soon as they exist, so a
    trained LoRA head needs no recomputation."""
    chunk = max(1, chunk_tokens // max(1, hidden_BTH.shape[0]))
    training = torch.is_grad_enabled() and hidden_BTH.requires_grad
    weight = _frozen_weight(head) if training else None
    lone = _lone_adapter(head) if training and weight is None and gradient else None
    summed = _HeadAdapterGradients()
    pieces: list[Tensor] = []
    for start in range(0, hidden_BTH.shape[1], chunk):
        hidden_BCH = hidden_BTH[:, start : start + chunk]
        targets_BC = targets_BT[:, start : start + chunk]
        if not training:
            pieces.append(_chunk_logprobs(head, hidden_BCH, targets_BC))
        elif weight is not None:
            chunk_paths["frozen"] += 1
            # Function.apply is unannotated in torch; it returns what forward returns.
            frozen = _FrozenHeadLogprobs.apply(  # type: ignore[no-untyped-call]
                hidden_BCH, targets_BC, weight
            )
            pieces.append(frozen)
        elif lone is not None:
            chunk_paths["trained"] += 1
            base, adapter = lone
            trained = _TrainedHeadLogprobs.apply(  # type: ignore[no-untyped-call]
                hidden_BCH,
                targets_BC,
                base,
                adapter.lora_A,
                adapter.lora_B,
                adapter.scale,
                gradient,
                start,
                summed,
            )
            pieces.append(trained)
        else:
            chunk_paths["checkpoint"] += 1
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
