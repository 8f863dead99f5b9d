"""Joins into the padding rows of a static-pass layout, so that layout's pass (a CUDA graph on
CUDA) serves them without being made again.

Static passes (decode_graph.py) keep the rows that ended as padding until at most half of the
layout's rows run (`keeps_layout`). A join that appends its rows makes a new layout, and on
CUDA a new capture: a warm-up pass and a captured pass, each costing an eager pass's launches
(about 88 ms each on the H200 beside a replayed pass of about 13 ms), at almost every block of
a stream. So a joining prompt whose rows fit in the rows of a prompt group that no running
row reads any more takes them instead (`join_into_padding`): its prompt's KV is copied over
that group's prefix row (FanoutKVCache.refill), those rows' own parts restart empty, and the
pass's persistent tensors (last tokens, settings, position and prefix-bias rows) are written in
place (DecodeStep.refill). The captured pass reads the same addresses, so it replays on. Rows of
the group beyond the joining prompt's stay padding (restarted too, so every reader of a prefix
row holds what it reads).

It applies when every joining prompt (with rows still live after its first token) finds such a
group with at least as many rows and:
- its prompt fits the layout's prefix columns (what the pass reads of each prefix row);
- the layout routes those rows to the joining prompt's adapter (the adapter routing is made
  once per layout);
- the batch's sampling kind stays one the layout's draw serves (its code path is fixed).
Otherwise the join appends its rows and the layout is made again, as for any other change.

Rows end only as a stream runs, so while it ramps up, or grows past its layout, no padding is
free and every join would append. So a stream's layout (a Decoding with a pool) is made with
placeholder rows (`add_placeholders`): rows of no request, each on a prompt of its own (one
position of zero keys and values), up to a power of two (at least PLACEHOLDER_ROWS_AT_LEAST)
of the running rows and a join of each of their adapters, within the pool's allocated rows,
routed to the running rows' adapters in proportion. Joins take them like any padding, and a
layout grows by doubling: about log2 of the rows captures while a stream ramps up, where
appending made one per join. It shrinks only once the layout made for its running rows would
be at most a quarter of it (`keeps_layout`), so a stream whose rows hover about a power of two
does not capture at every crossing; padding rows restart in place before they pass the own
part's capacity (`rewind_padding`), so they never make the cache grow. A join that appends
anyway drops the padding first (sampler.Decoding._start): the layout is made again in any case,
so padding rows are free pool rows to a join (SampleStream.room).

Legend: B = rows of the layout.
"""

from __future__ import annotations

from collections import Counter

import torch

from posttrain.engine.generate.decode_graph import DecodeStep
from posttrain.engine.generate.decode_rows import LiveRows
from posttrain.engine.generate.joins import Generation
from posttrain.engine.generate.sampling_math import batch_kind
from posttrain.model.fanout_kv_cache import FanoutKVCache
from posttrain.model.kv_cache import KVCache, power_of_two_at_least

# Benchmarks turn them off to compare with joins that always append (a new layout each), and
# with stream layouts made for their rows only (no placeholders).
JOIN_INTO_PADDING = True
PLACEHOLDERS = True
# A stream's static layout holds at least this many rows: on a GPU a decode pass of 8 rows
# costs what one of 1 row does (its weights' reads), and a capture about 13 replayed passes.
PLACEHOLDER_ROWS_AT_LEAST = 8


def stream_layout_rows(rows: int) -> int:
    """Rows of a stream's static layout made to hold `rows` (placeholders included)."""
    return power_of_two_at_least(rows, PLACEHOLDER_ROWS_AT_LEAST)


def keeps_layout(running: int, rows: int, stream: bool) -> bool:
    """With static passes, whether the batch stays as it is although only `running` of its
    `rows` still run: the finished rows ride along as padding (their tokens are dropped, and
    joins may take them) until at most half the rows run, so a batch changes shape, and a new
    pass is captured, at most log2(rows) times instead of at every finished row. A `stream`'s
    layout (made with room: see the module docstring) stays until the one made for its
    running rows would have at most a quarter of its rows."""
    if stream:
        return stream_layout_rows(running) > rows // 4
    return running > rows // 2


def add_placeholders(
    generation: Generation, batch: LiveRows, cache: FanoutKVCache, running: list[int]
) -> int:
    """Placeholder rows after the batch's (see the module docstring), up to stream_layout_rows
    of the `running` rows and a join of each of their adapters in all, as far as the cache's
    allocated rows go: rows of no request (Generation.placeholders), each on a prefix of its
    own (FanoutKVCache.add_placeholders), their last token 0, each routed to an adapter of
    the running rows. Returns how many were added (their own parts start empty)."""
    running_rows = [generation.rows[batch.live[b]] for b in running]
    per_key = Counter(row.adapter_key for row in running_rows)
    # Room for a join of each adapter at least: a layout made exactly full would be made
    # again at the next join.
    wanted = stream_layout_rows(len(running) + len(per_key)) - len(batch.live)
    count = min(wanted, cache.own.free_rows, cache.prefix.free_rows)
    if count <= 0 or not (JOIN_INTO_PADDING and PLACEHOLDERS):
        return 0
    # Each adapter of the running rows gets one placeholder routed to it, and the rest in
    # proportion to its rows (largest remainders first): joins of each adapter find some
    # (many LoRA sessions sampling in one stream).
    shares = dict.fromkeys(per_key, 1) if count >= len(per_key) else dict.fromkeys(per_key, 0)
    spare = count - sum(shares.values())
    for key, n in per_key.items():
        shares[key] += spare * n // len(running)
    by_remainder = sorted(per_key, key=lambda key: -(spare * per_key[key] % len(running)))
    for key in by_remainder[: count - sum(shares.values())]:
        shares[key] += 1
    like = {row.adapter_key: row for row in reversed(running_rows)}  # its first running row
    group_ids, row_ids = generation.placeholders(
        [like[k] for k in per_key for _ in range(shares[k])]
    )
    cache.add_placeholders(group_ids)
    placeholders = LiveRows(generation.rows, row_ids, batch.device, batch.vocab)
    placeholders.last_tokens_B = torch.zeros(count, dtype=torch.int64, device=batch.device)
    batch.join(placeholders)
    return count


def join_into_padding(
    generation: Generation,
    batch: LiveRows,
    cache: FanoutKVCache,
    step: DecodeStep,
    running: list[int],
    group_ids: list[int],
    prefill_cache: KVCache,
    fresh: LiveRows,
) -> tuple[list[int], list[int]] | None:
    """Rows `fresh.live` (their groups `group_ids` prefilled in rows of `prefill_cache`, their
    first token drawn) take padding rows of the layout `step` runs, if they all fit (see the
    module docstring). Returns (the batch positions they took, in fresh.live order; every
    position that restarted empty), or None, having changed nothing."""
    if not JOIN_INTO_PADDING:
        return None
    rows = generation.rows
    readers: dict[int, list[int]] = {}
    for b, group in enumerate(cache.group_ids_B):
        readers.setdefault(group, []).append(b)
    live = set(running)
    free = [positions for positions in readers.values() if live.isdisjoint(positions)]
    members: dict[int, list[int]] = {}  # joining group -> its rows' indices in fresh.live
    for j, r in enumerate(fresh.live):
        members.setdefault(rows[r].group, []).append(j)
    places: dict[int, list[int]] = {}
    for group, joining in members.items():
        if len(generation.groups[group].prompt) > step.cache.prefix_columns:
            return None
        key = rows[fresh.live[joining[0]]].adapter_key
        fits = [
            positions
            for positions in free
            if len(positions) >= len(joining)
            and all(step.keys[b] == key for b in positions[: len(joining)])
        ]
        if not fits:
            return None
        places[group] = min(fits, key=len)  # the smallest that fits: keep large ones
        free.remove(places[group])
    taken = [0] * len(fresh.live)
    for group, joining in members.items():
        for j, b in zip(joining, places[group], strict=False):
            taken[j] = b
    params = [rows[r].params for r in batch.live]
    for j, b in enumerate(taken):
        params[b] = rows[fresh.live[j]].params
    kind = batch_kind(params, batch.vocab)
    if step.kind is not None and kind != step.kind:
        return None
    cache_row = {g: i for i, g in enumerate(group_ids)}
    for group, positions in places.items():
        cache.refill(positions, group, prefill_cache, cache_row[group])
    batch.refill(taken, fresh)
    restarted = sorted(b for positions in places.values() for b in positions)
    step.refill(batch, [(places[g], len(generation.groups[g].prompt)) for g in places])
    return taken, restarted


def rewind_padding(
    step: DecodeStep, own_lengths: list[int], running: list[int], steps: int
) -> None:
    """Padding rows of the layout `step` runs whose own part would pass its capacity in the
    next `steps` passes restart empty in place (their tokens are dropped, the pass's tensors
    stay): a stream's placeholders ride along for many passes, and only running rows should
    make the decode cache grow (a new layout). `own_lengths`: every row's, updated."""
    live = set(running)
    capacity = step.cache.capacity
    full = [b for b, n in enumerate(own_lengths) if b not in live and n + steps > capacity]
    if full:
        step.cache.restart(full)
        for b in full:
            own_lengths[b] = 0
