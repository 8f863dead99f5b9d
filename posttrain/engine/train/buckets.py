"""Length buckets for the training forward: rows of similar length share one model forward.

One forward over a right-padded batch computes every row out to the longest row; an RL batch
whose lengths spread evenly over 64..1024 tokens spends about half of that on padding. Instead,
rows are grouped into buckets, each forward padded only to its own longest row, and the
per-bucket results go back into the batch's [S, T] layout, so callers cannot tell the
difference.

The grouping minimises padded tokens + `overhead_tokens` per forward, where the overhead is the
fixed cost of one forward (Python, per-layer kernel launches, small-matrix inefficiency)
expressed in tokens of work: another bucket is worth it only when the padding it removes costs
more than one more forward. For this cost some optimal grouping is contiguous in length order
(a row of a longer bucket that is shorter than a row of a shorter bucket can swap places with it
without raising either bucket's longest row), so a dynamic programme over rows sorted by length
finds it exactly. The optimum pads no row by more than `overhead_tokens` (splitting its bucket
just above that row would otherwise be cheaper), so a 32k-token row is never padded to a bucket
far above it, whatever lengths share its batch.

There is no cap on a bucket's tokens: every bucket's activations stay alive until the one
backward over the whole batch's loss, so splitting a bucket would not lower peak memory, and
their sum never exceeds the single padded forward's (bucketing only removes padding).

Legend: S = samples, T = longest sample, B = rows of one bucket, L = longest row of a bucket.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

# (adapter key, batch rows it applies to, or None for every row): the engine's row routing.
Routing = list[tuple[str, Sequence[int] | None]]


def plan_buckets(lengths_S: Sequence[int], overhead_tokens: int) -> list[list[int]]:
    """Batch row indices of each bucket, buckets from short to long rows, rows ascending within
    a bucket; every row is in exactly one bucket. Rows of equal length are never split apart.

    Works on distinct lengths (with their counts), so the search is over at most
    max_batch_size values, and stops early once a longer bucket cannot win."""
    per_length = Counter(lengths_S)
    distinct = sorted(per_length)
    counts = [per_length[length] for length in distinct]
    # best[j]: (cost, forwards) of bucketing the rows of the j shortest distinct lengths; ties
    # go to fewer forwards, so equal lengths (and overhead 0) make one bucket.
    best: list[tuple[int, int]] = [(0, 0)]
    split_at: list[int] = [0]
    real_tokens = 0  # of the rows of distinct[:end]
    for end in range(1, len(distinct) + 1):
        width = distinct[end - 1]
        real_tokens += counts[end - 1] * width
        rows, padded = 0, 0
        choice: tuple[int, int] | None = None
        choice_start = end
        for start in range(end - 1, -1, -1):  # the last bucket is rows of distinct[start:end]
            rows += counts[start]
            padded += counts[start] * (width - distinct[start])
            # Any grouping costs at least its real tokens, and this bucket's padding only grows
            # as it takes shorter rows: past this point no start can beat the choice.
            if choice is not None and real_tokens + padded + overhead_tokens > choice[0]:
                break
            cost, forwards = best[start]
            candidate = (cost + rows * width + overhead_tokens, forwards + 1)
            if choice is None or candidate <= choice:
                choice, choice_start = candidate, start
        assert choice is not None
        best.append(choice)
        split_at.append(choice_start)
    return _buckets_from_splits(lengths_S, distinct, split_at)


def _buckets_from_splits(
    lengths_S: Sequence[int], distinct: list[int], split_at: list[int]
) -> list[list[int]]:
    """Walk the programme's choices back from the longest length to row-index buckets."""
    ranges: list[tuple[int, int]] = []
    end = len(distinct)
    while end > 0:
        ranges.append((split_at[end], end))
        end = split_at[end]
    buckets = []
    for start, end in reversed(ranges):
        low, high = distinct[start], distinct[end - 1]
        buckets.append([row for row, n in enumerate(lengths_S) if low <= n <= high])
    return buckets


def bucket_routing(routing: Routing, rows_B: Sequence[int]) -> list[tuple[str, list[int] | None]]:
    """The batch's routing re-expressed for one bucket: each adapter's rows become positions in
    the bucket. An adapter with no rows in the bucket is left out; None (every row) stays None,
    and so does a set covering the whole bucket (a plain add is cheaper than index_add)."""
    position = {row: index for index, row in enumerate(rows_B)}
    local: list[tuple[str, list[int] | None]] = []
    for key, rows in routing:
        if rows is None:
            local.append((key, None))
            continue
        positions = sorted(position[row] for row in rows if row in position)
        if positions:
            local.append((key, None if len(positions) == len(rows_B) else positions))
    return local


def assemble(pieces_BL: Sequence[Tensor], buckets: Sequence[Sequence[int]], width: int) -> Tensor:
    """The batch's [S, width] tensor from each bucket's [B, L] rows: each piece right-padded
    with zeros to `width`, rows put back in batch order. Built from differentiable ops (pad,
    cat, index_select), so gradients flow back into every bucket's forward."""
    stacked = torch.cat([F.pad(piece, (0, width - piece.shape[1])) for piece in pieces_BL])
    order = [row for bucket in buckets for row in bucket]
    if order == sorted(order):  # already in batch order (always so for one bucket)
        return stacked
    inverse = torch.empty(len(order), dtype=torch.int64)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return stacked.index_select(0, inverse.to(stacked.device))
