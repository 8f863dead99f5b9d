"""Per-token log-probabilities in float32: the one function training, scoring and sampling share.

A sampler's logprob of a token and a forward pass over the same tokens therefore agree up to
the numerics of the two forward passes. The log-softmax runs over chunks of positions so the full
[tokens, vocab] float32 tensor of a batch never exists at once; under autograd each chunk is
recomputed in backward instead of being kept.

Legend: B = rows, T = tokens, V = vocab, H = hidden size.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def log_softmax_float32(logits_BV: Tensor) -> Tensor:
    """Log-softmax over the vocabulary in float32, whatever dtype the model computes in."""
    return torch.log_softmax(logits_BV.float(), dim=-1)


def _chunk_logprobs(head: nn.Module, hidden_BCH: Tensor, targets_BC: Tensor) -> Tensor:
    logprobs_BCV = log_softmax_float32(head(hidden_BCH))
    return logprobs_BCV.gather(-1, targets_BC.unsqueeze(-1)).squeeze(-1)


def target_logprobs(
    head: nn.Module, hidden_BTH: Tensor, targets_BT: Tensor, *, chunk_tokens: int
) -> Tensor:
    """logprob of targets_BT[b, t] under the distribution the head gives at hidden_BTH[b, t].

    Returns float32 [B, T]. `head` is the output projection (with its adapters routed)."""
    chunk = max(1, chunk_tokens // max(1, hidden_BTH.shape[0]))
    pieces: list[Tensor] = []
    for start in range(0, hidden_BTH.shape[1], chunk):
        hidden_BCH = hidden_BTH[:, start : start + chunk]
        targets_BC = targets_BT[:, start : start + chunk]
        if torch.is_grad_enabled() and hidden_BCH.requires_grad:
            pieces.append(
                checkpoint(_chunk_logprobs, head, hidden_BCH, targets_BC, use_reentrant=False)
            )
        else:
            pieces.append(_chunk_logprobs(head, hidden_BCH, targets_BC))
    return torch.cat(pieces, dim=1)
