"""Batched generation: left-padded prefill, then decode with the model's KV cache.

Every row (prompt x num_samples) has its own torch.Generator, so a seed reproduces a row's
tokens whatever else is in the batch. The logprob reported for a sampled token is the
untempered float32 log-softmax of the same logits it was sampled from (logprobs.py), i.e. the
model's own distribution, which is what forward-backward computes for the same token.

Not here (issue 5): prefix cache, freeing finished rows, in-flight weight updates.

Legend: G = rows being generated, L = prompt length (padded), V = vocab.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from posttrain.engine.logprobs import log_softmax_float32
from posttrain.types import SamplingParams, StopReason


@dataclass
class RowState:
    generator: torch.Generator
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason | None = None


def row_seed(seed: int | None, row: int) -> int:
    """Row r of a seeded request draws from seed + r; unseeded rows from the OS."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
    return (seed + row) & ((1 << 63) - 1)


def filter_logits(logits_V: Tensor, params: SamplingParams) -> Tensor:
    """Temperature, then top-k, then top-p, on float32 logits of one row."""
    logits_V = logits_V / params.temperature
    if params.top_k > 0 and params.top_k < logits_V.shape[-1]:
        kth = torch.topk(logits_V, params.top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_V, order_V = torch.sort(logits_V, descending=True)
        cumulative_V = torch.softmax(sorted_V, dim=-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop_sorted_V = cumulative_V - torch.softmax(sorted_V, dim=-1) >= params.top_p
        drop_V = torch.zeros_like(drop_sorted_V).scatter(0, order_V, drop_sorted_V)
        logits_V = logits_V.masked_fill(drop_V, float("-inf"))
    return logits_V


def choose_token(logits_V: Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if params.temperature == 0:
        return int(torch.argmax(logits_V))
    probs_V = torch.softmax(filter_logits(logits_V, params), dim=-1)
    # Sample on the CPU generator so a seed means the same thing on every device.
    return int(torch.multinomial(probs_V.cpu(), 1, generator=generator))


def hit_stop_string(
    tokenizer: PreTrainedTokenizerBase, tokens: list[int], stop: tuple[str, ...]
) -> bool:
    """True when the generated text ends inside or after a stop string that the last token
    completed; stop strings may span token boundaries."""
    if not stop:
        return False
    longest = max(len(s) for s in stop)
    # A token decodes to at least one character for text tokens; keep a margin for tokens that
    # decode to nothing (special tokens) so a stop string is never missed.
    tail = tokenizer.decode(tokens[-(longest + 8) :])
    previous = tokenizer.decode(tokens[-(longest + 8) : -1])
    return any(s in tail and s not in previous for s in stop)


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts_G: list[list[int]],
    params: SamplingParams,
    *,
    eos_token_ids: frozenset[int],
    pad_token_id: int,
) -> list[RowState]:
    """Generate up to params.max_tokens for each row; rows stop on EOS or a stop string."""
    device = next(model.parameters()).device
    rows = [
        RowState(torch.Generator().manual_seed(row_seed(params.seed, i)), [], [])
        for i in range(len(prompts_G))
    ]
    width = max(len(p) for p in prompts_G)
    input_ids_GL = torch.full((len(prompts_G), width), pad_token_id, dtype=torch.int64)
    attention_GL = torch.zeros(len(prompts_G), width, dtype=torch.int64)
    for i, prompt in enumerate(prompts_G):
        input_ids_GL[i, width - len(prompt) :] = torch.tensor(prompt)
        attention_GL[i, width - len(prompt) :] = 1
    input_ids_GL, attention_GL = input_ids_GL.to(device), attention_GL.to(device)
    positions_GL = (attention_GL.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(
        input_ids=input_ids_GL,
        attention_mask=attention_GL,
        position_ids=positions_GL,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    next_positions_G1 = positions_GL[:, -1:] + 1
    for _step in range(params.max_tokens):
        logits_GV = out.logits[:, -1, :].float()
        logprobs_GV = log_softmax_float32(logits_GV)
        next_tokens = []
        for i, row in enumerate(rows):
            if row.stop_reason is not None:
                next_tokens.append(pad_token_id)
                continue
            token = choose_token(logits_GV[i], params, row.generator)
            row.tokens.append(token)
            row.logprobs.append(float(logprobs_GV[i, token]))
            if token in eos_token_ids or hit_stop_string(tokenizer, row.tokens, params.stop):
                row.stop_reason = StopReason.STOP
            elif len(row.tokens) >= params.max_tokens:
                row.stop_reason = StopReason.LENGTH
            next_tokens.append(token)
        if all(row.stop_reason is not None for row in rows):
            break
        attention_GL = torch.cat([attention_GL, attention_GL.new_ones(len(rows), 1)], dim=1)
        out = model(
            input_ids=torch.tensor(next_tokens, device=device).unsqueeze(1),
            attention_mask=attention_GL,
            position_ids=next_positions_G1,
            cache=cache,
            use_cache=True,
        )
        next_positions_G1 = next_positions_G1 + 1
    return rows
