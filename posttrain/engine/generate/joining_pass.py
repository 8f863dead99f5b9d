"""Prompts joining a running decode batch prefilled inside its next decode pass (chunked
prefill), instead of in a prefill pass of their own before it.

A join prefilled apart costs a whole pass through the model for its prompts (joins.start_rows)
beside the block's decode pass. Where a pass costs about the same whatever its rows (a GPU
launching one kernel after another: an eager pass of the Qwen3-0.6B shape is ~5,400 operations,
88 ms on an H200, whether it decodes 8 rows or prefills 32 prompts), and on the CPU, where a
small model's pass is mostly per-operation overhead, the join's pass is nearly all waste. Here
the joining prompts' uncached positions ride in the block's first decode pass, packed after the
decode rows' tokens, one per batch row (model/joining_pass_cache.py): that pass gives the
running rows their next token and the joining rows their first, and the joining rows join the
batch for the block's other passes (sampler.Decoding). So a stream that admits at every block
runs one pass per step, not two.

What changes for a joining operation: its first token comes out of the next decode pass rather
than out of a pass before it, so one pass later; its tokens are the same (its rows draw from
their own random streams) and its logprobs within the last bits (a matrix product's rows depend
on the row count, as for any join). A publish between the admit and that pass (PIPELINE) serves
the operation wholly on the new weights (Generation.renew).

Joins that need what a prefill pass gives apart take it (joins.start_rows): prompt logprobs and
routed experts (every position's hidden state and routes), models on the eager attention path
(Gemma 2's soft-capped scores: JoiningPassAttention is sdpa's), more prompt positions than one
prefill pass takes, and a batch decoding in static passes. There (CUDA graphs, the GPU's
default) a decode pass is a replayed graph of a few launches: the joining pass would run it
eagerly, a pass's ~5,400 dispatched operations plus the prompts' ~1,200, to save a prefill
pass of ~4,900 (bench/joining_pass.py counts them on the Qwen3-0.6B depth): no gain.

Legend: B = decode rows, G = joining prompts, N = B + the prompts' positions, V = vocab.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.engine.generate.decode_rows import LiveRows
from posttrain.engine.generate.draws import draw
from posttrain.engine.generate.joins import Generation, first_tokens
from posttrain.engine.generate.prefill import (
    PREFILL_TOKENS_PER_PASS,
    GeneratorModel,
    forward_rows,
    head_logits,
    keep_prompts,
    prompt_cache,
)
from posttrain.engine.state import WeightsVersion
from posttrain.model import attention
from posttrain.model.fanout_kv_cache import FanoutKVCache
from posttrain.model.joining_pass_cache import JoiningPassCache
from posttrain.model.kv_cache import KVCache

# Prefill joining prompts inside the next decode pass where they can (benchmarks compare
# both ways in one process: bench/closed_loop.py --prefill-apart).
JOIN_IN_DECODE_PASS = True


@dataclass(frozen=True)
class Joining:
    """Requests planned at an admit whose prompts run in the next decode pass."""

    group_ids: list[int]
    row_ids: list[int]


def joins_in_pass(
    gm: GeneratorModel, generation: Generation, group_ids: list[int], batch: LiveRows | None
) -> bool:
    """Whether these (new) groups may prefill inside the next decode pass of `batch`, the
    running batch of dynamic passes (None: none runs, or its passes are static)."""
    if not JOIN_IN_DECODE_PASS or gm.model.config._attn_implementation != attention.IMPLEMENTATION:
        return False
    if batch is None or batch.wants_routes:
        return False  # routes are recorded per decode pass, [B, 1, L, K]
    if gm.kv.recurrent is not None:
        return False  # a packed pass's one row holds many sequences, a recurrent state one
    groups = [generation.groups[g] for g in group_ids]
    if any(g.wants_prompt_logprobs or g.wants_routes or g.images for g in groups):
        return False
    return sum(len(g.prompt) for g in groups) <= PREFILL_TOKENS_PER_PASS


def decode_and_prefill(
    gm: GeneratorModel,
    batch: LiveRows,
    cache: FanoutKVCache,
    own_positions: int,
    ragged: bool,
    generation: Generation,
    joining: Joining,
    versions: Mapping[str, WeightsVersion],
) -> tuple[Tensor, Tensor, KVCache, LiveRows]:
    """One decode pass of the batch (each row's own part holds `own_positions`, the longest's
    with `ragged`) with the joining prompts' prefill packed in; returns the batch's tokens and
    logprobs [B] (on the device, as a decode step's), the prompts' cache (row i is group
    joining.group_ids[i]) and the joining rows still live after their first token."""
    generation.renew(joining.group_ids, joining.row_ids, versions)
    groups = [generation.groups[g] for g in joining.group_ids]
    prompts = prompt_cache(gm, groups)
    suffixes = [g.prompt[g.cache_hit_tokens :] for g in groups]
    joined = JoiningPassCache(
        cache, (1, own_positions + 1), ragged, prompts, [len(s) for s in suffixes]
    )
    device = batch.ones_B.device
    assert batch.last_tokens_B is not None
    prompt_tokens = torch.tensor([t for s in suffixes for t in s], dtype=torch.int64)
    tokens_N = torch.cat([batch.last_tokens_B, prompt_tokens.to(device)])
    keys_N = batch.keys + [g.adapter_key for g, s in zip(groups, suffixes, strict=True) for _ in s]
    hidden_N1H = forward_rows(gm, joined, tokens_N[:, None], torch.ones_like(tokens_N), keys_N)
    keep_prompts(gm, groups, prompts)
    rows = len(batch.live)
    last_N = torch.tensor([*range(rows), *joined.last_positions], device=device)
    keys = batch.keys + [g.adapter_key for g in groups]
    logits_MV = head_logits(gm, hidden_N1H[last_N, 0], keys)
    tokens_B, logprobs_B = draw(batch, logits_MV[:rows])
    first_logits_GV = logits_MV[rows:].float()
    fresh = first_tokens(gm, generation, joining.group_ids, joining.row_ids, first_logits_GV)
    return tokens_B, logprobs_B, prompts, fresh
