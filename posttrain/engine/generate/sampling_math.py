"""Sampling math: from a row's float32 log-softmax and its settings to one token, its seed,
and whether a stop string has just been completed. Pure functions of their arguments; the
decode loop that calls them lives in sampler.py.

Temperature 0 is argmax (and so is a temperature too small for float32 to temper by).
Otherwise temperature, then top-k, then top-p (the smallest set of most likely tokens whose
mass reaches top_p), then one draw by inverse CDF: a uniform from the row's own torch.Generator
against the running sum of its probabilities. Each row's arithmetic depends
only on its own settings, never on which other rows share the batch.

Legend: B = rows, V = vocab, N = CDF blocks, K = tokens per block.
"""

from __future__ import annotations

import os
from typing import overload

import torch
from torch import Tensor
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from posttrain.types import SamplingParams

# Tokens per block of the two-level inverse-CDF search (draw_inverse_cdf).
CDF_BLOCK = 256
_SEED_MASK = (1 << 63) - 1

# A batch's sampling kind, decided on the host once per batch (batch_kind): every row greedy,
# every row plain (the model's own distribution), or None for a mix.
GREEDY = "greedy"
PLAIN = "plain"


def row_seed(seed: int | None, sample_index: int) -> int:
    """The generator seed of sample `sample_index` of a prompt; unseeded rows use the OS."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little") & _SEED_MASK
    # An odd multiplier spreads neighbouring seeds apart, so seed s sample 1 is not seed s+1
    # sample 0.
    return (seed * 0x9E3779B97F4A7C15 + sample_index) & _SEED_MASK


def filter_logits(logits_BV: Tensor, top_k_B: Tensor, top_p_B: Tensor) -> Tensor:
    """Top-k (top_k <= 0: off), then top-p, on tempered float32 logits; dropped tokens get
    -inf. Rows are independent: a row's result does not depend on the others."""
    vocab = logits_BV.shape[-1]
    needs_B = ((top_k_B > 0) & (top_k_B < vocab)) | (top_p_B < 1.0)
    if not bool(needs_B.any()):
        return logits_BV
    rows = needs_B.nonzero().squeeze(1)
    filtered_BV = logits_BV.clone()
    filtered_BV[rows] = _filter_rows(logits_BV[rows], top_k_B[rows], top_p_B[rows])
    return filtered_BV


def _filter_rows(logits_BV: Tensor, top_k_B: Tensor, top_p_B: Tensor) -> Tensor:
    """filter_logits on every row, whether its settings cut anything or not."""
    vocab = logits_BV.shape[-1]
    sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True)
    rank_V = torch.arange(vocab, device=logits_BV.device)
    k_B = torch.where(top_k_B > 0, top_k_B, vocab)
    sorted_BV = sorted_BV.masked_fill(rank_V[None, :] >= k_B[:, None], float("-inf"))
    probs_BV = torch.softmax(sorted_BV, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the most likely token always stays).
    drop_BV = probs_BV.cumsum(-1) - probs_BV >= top_p_B[:, None]
    sorted_BV = sorted_BV.masked_fill(drop_BV, float("-inf"))
    return torch.full_like(sorted_BV, float("-inf")).scatter(1, order_BV, sorted_BV)


@overload
def is_plain(temperature: float, top_k: int, top_p: float, vocab: int) -> bool: ...


@overload
def is_plain(temperature: Tensor, top_k: Tensor, top_p: Tensor, vocab: int) -> Tensor: ...


def is_plain(
    temperature: float | Tensor, top_k: int | Tensor, top_p: float | Tensor, vocab: int
) -> bool | Tensor:
    """Whether a row samples the model's own distribution (temperature 1, no top-k or top-p
    cut). Python numbers or tensors of them alike (a bool, or a bool tensor [B]): the one rule
    for both."""
    return (temperature == 1) & ((top_k <= 0) | (top_k >= vocab)) & (top_p >= 1)


def batch_kind(params: list[SamplingParams], vocab: int) -> str | None:
    """GREEDY when every row is greedy, PLAIN when every row is plain, else None."""
    if all(p.temperature == 0 for p in params):
        return GREEDY
    if all(is_plain(p.temperature, p.top_k, p.top_p, vocab) for p in params):
        return PLAIN
    return None


def choose_tokens(
    logprobs_BV: Tensor,
    temperature_B: Tensor,
    top_k_B: Tensor,
    top_p_B: Tensor,
    uniform_B: Tensor,
    kind: str | None = None,
) -> Tensor:
    """One token per row from its float32 log-softmax: argmax where temperature is 0, else an
    inverse-CDF draw with the row's uniform in [0, 1) from the tempered, filtered distribution.

    log-softmax differs from the logits by a per-row constant, so tempering and filtering it
    gives the same distribution. Each row's arithmetic depends only on its own settings, never
    on which other rows share the batch. `kind` (batch_kind of the rows' settings, when the
    caller knows it) skips the device-side checks that find the same."""
    if kind == GREEDY:
        return logprobs_BV.argmax(-1)
    if kind == PLAIN:
        # The common RL case: no boolean-mask copies of the [B, V] logprobs.
        return draw_inverse_cdf(logprobs_BV.exp(), uniform_B)
    vocab = logprobs_BV.shape[-1]
    tokens_B = torch.zeros(logprobs_BV.shape[0], dtype=torch.int64, device=logprobs_BV.device)
    greedy = temperature_B == 0
    plain = is_plain(temperature_B, top_k_B, top_p_B, vocab)
    if bool(greedy.any()):
        tokens_B[greedy] = logprobs_BV[greedy].argmax(-1)
    shaped = ~greedy & ~plain
    if bool(plain.all()):
        # The common RL case: no boolean-mask copies of the [B, V] logprobs.
        return draw_inverse_cdf(logprobs_BV.exp(), uniform_B)
    if bool(plain.any()):
        # The model's own distribution: exp of the log-softmax already at hand.
        tokens_B[plain] = draw_inverse_cdf(logprobs_BV[plain].exp(), uniform_B[plain])
    if bool(shaped.any()):
        tempered_BV = logprobs_BV[shaped] / temperature_B[shaped, None]
        filtered_BV = filter_logits(tempered_BV, top_k_B[shaped], top_p_B[shaped])
        drawn_B = draw_inverse_cdf(torch.softmax(filtered_BV, dim=-1), uniform_B[shaped])
        # A temperature so small that every tempered logprob overflowed to -inf (1e-40 with a
        # most likely token below -0.04) has no softmax (0/0); its limit, as the temperature
        # goes to 0, is the most likely token: greedy.
        collapsed_B = tempered_BV.amax(-1) == float("-inf")
        if bool(collapsed_B.any()):
            drawn_B[collapsed_B] = logprobs_BV[shaped][collapsed_B].argmax(-1)
        tokens_B[shaped] = drawn_B
    return tokens_B


def choose_tokens_static(
    logprobs_BV: Tensor,
    temperature_B: Tensor,
    top_k_B: Tensor,
    top_p_B: Tensor,
    uniform_B: Tensor,
    kind: str | None,
) -> Tensor:
    """choose_tokens with nothing read back to the host, so a CUDA graph can hold it: a mixed
    batch computes every way of choosing for every row (argmax, the plain draw, the tempered
    and filtered draw) and keeps each row's own, instead of indexing the rows of each kind
    (which needs their count on the host). Every row's arithmetic is choose_tokens's, so the
    tokens are the same; it costs a sort of the whole batch's logprobs per step."""
    if kind in (GREEDY, PLAIN):
        return choose_tokens(logprobs_BV, temperature_B, top_k_B, top_p_B, uniform_B, kind)
    vocab = logprobs_BV.shape[-1]
    greedy_B = temperature_B == 0
    plain_B = is_plain(temperature_B, top_k_B, top_p_B, vocab)
    argmax_B = logprobs_BV.argmax(-1)
    drawn_plain_B = draw_inverse_cdf(logprobs_BV.exp(), uniform_B)
    # Greedy rows temper by 1 here (their draw is not kept): no division by 0.
    tempered_BV = logprobs_BV / torch.where(greedy_B, 1.0, temperature_B)[:, None]
    needs_B = ((top_k_B > 0) & (top_k_B < vocab)) | (top_p_B < 1.0)
    filtered_BV = torch.where(
        needs_B[:, None], _filter_rows(tempered_BV, top_k_B, top_p_B), tempered_BV
    )
    drawn_B = draw_inverse_cdf(torch.softmax(filtered_BV, dim=-1), uniform_B)
    # As in choose_tokens: a temperature whose every tempered value is -inf is greedy.
    drawn_B = torch.where(tempered_BV.amax(-1) == float("-inf"), argmax_B, drawn_B)
    return torch.where(greedy_B, argmax_B, torch.where(plain_B, drawn_plain_B, drawn_B))


def draw_inverse_cdf(probs_BV: Tensor, uniform_B: Tensor) -> Tensor:
    """Per row, the first token whose running probability sum exceeds uniform * total.

    Two levels instead of one running sum over the whole vocabulary (a sequential scan, the
    slowest step of sampling a large vocabulary): running sums of blocks of CDF_BLOCK tokens
    find the block, then one running sum inside it finds the token. Scaling by the total keeps
    the draw exact when the float sum is not quite 1. A zero-probability token is never drawn:
    searches are right-sided (such a token's running sum equals its predecessor's) and capped
    at the last block, and the last token within it, that adds mass (the float threshold can
    round up to the total)."""
    rows, vocab = probs_BV.shape
    blocks = -(-vocab // CDF_BLOCK)
    if blocks * CDF_BLOCK != vocab:
        probs_BV = torch.nn.functional.pad(probs_BV, (0, blocks * CDF_BLOCK - vocab))
    probs_BNK = probs_BV.view(rows, blocks, CDF_BLOCK)
    cdf_BN = probs_BNK.sum(-1).cumsum(-1)
    threshold_B1 = uniform_B[:, None] * cdf_BN[:, -1:]
    block_B1 = torch.searchsorted(cdf_BN, threshold_B1, right=True)
    block_B1 = torch.minimum(block_B1, (cdf_BN < cdf_BN[:, -1:]).sum(-1, keepdim=True))
    before_B1 = torch.where(
        block_B1 > 0, cdf_BN.gather(1, (block_B1 - 1).clamp(min=0)), torch.zeros_like(threshold_B1)
    )
    inside_BK = probs_BNK.gather(1, block_B1[:, :, None].expand(-1, -1, CDF_BLOCK)).squeeze(1)
    local_cdf_BK = inside_BK.cumsum(-1)
    offset_B1 = torch.searchsorted(local_cdf_BK, threshold_B1 - before_B1, right=True)
    offset_B1 = torch.minimum(
        offset_B1, (local_cdf_BK < local_cdf_BK[:, -1:]).sum(-1, keepdim=True)
    )
    return (block_B1 * CDF_BLOCK + offset_B1).squeeze(1)


def hit_stop_string(
    tokenizer: PreTrainedTokenizerBase, tokens: list[int], stop: tuple[str, ...]
) -> bool:
    """True when the text of `tokens` contains a stop string that the last token completed;
    stop strings may span token boundaries."""
    if not stop:
        return False
    longest = max(len(s) for s in stop)
    # A text token decodes to at least one character; the margin covers tokens that decode to
    # nothing (special tokens, partial UTF-8) so a stop string is never missed.
    window = tokens[-(longest + 8) :]
    tail = tokenizer.decode(window)
    if not any(s in tail for s in stop):
        return False
    previous = tokenizer.decode(window[:-1])
    return any(s in tail and s not in previous for s in stop)
