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

Legend: B = rows of the layout.
"""

from __future__ import annotations

from posttrain.engine.generate.decode_graph import DecodeStep
from posttrain.engine.generate.decode_rows import LiveRows
from posttrain.engine.generate.joins import Generation
from posttrain.engine.generate.sampling_math import batch_kind
from posttrain.model.fanout_kv_cache import FanoutKVCache
from posttrain.model.kv_cache import KVCache

# Benchmarks turn it off to compare with joins that always append (a new layout each).
JOIN_INTO_PADDING = True


def keeps_layout(running: int, rows: int) -> bool:
    """With static passes, whether the batch stays as it is although only `running` of its
    `rows` still run: the finished rows ride along as padding (their tokens are dropped, and
    joins may take them) until at most half the rows run, so a batch changes shape, and a new
    pass is captured, at most log2(rows) times instead of at every finished row."""
    return running > rows // 2


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
