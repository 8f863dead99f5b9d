"""Memory admission: which of a group's operations run, in which passes, before anything runs.

The scheduler hands every group here between marking it RUNNING and the engine pass (the one
place operations are admitted to run). An operation whose estimated peak alone exceeds what is
free fails RESOURCE_EXHAUSTED without touching anything, so its session's weights, optimizer
state, gradients and step stay as they were; the others run, split into consecutive passes
where together they would not fit. Passes keep the group's order, so each session's order
holds (a group has at most one forward-backward per session; samples change no state).

A sample stream's pool (`pool_rows`) is sized here too, from what is free beside its first
operations. Not here: the estimate (engine/memory/estimate.py) and what is free
(engine/memory/headroom.py).

Imports: engine.interface.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from posttrain.engine.interface import Headroom
from posttrain.errors import ResourceExhausted
from posttrain.types import OperationKind

M = TypeVar("M")
MIB = 1 << 20


def plan_passes(
    kind: OperationKind,
    members: Sequence[M],
    peak_bytes: Callable[[list[M]], int],
    room: Headroom,
) -> tuple[list[list[M]], dict[int, ResourceExhausted]]:
    """Passes that each fit in `room`, and the refusal of each member (by position) that
    does not fit even alone."""
    passes: list[list[M]] = []
    refused: dict[int, ResourceExhausted] = {}
    current: list[M] = []
    for index, member in enumerate(members):
        alone = peak_bytes([member])
        if alone > room.free_bytes:
            refused[index] = refusal(kind, alone, room)
            continue
        if current and peak_bytes([*current, member]) > room.free_bytes:
            passes.append(current)
            current = []
        current.append(member)
    if current:
        passes.append(current)
    return passes, refused


# Of the memory free beside a stream's first operations, the share its pool may take: the rest
# stays for what runs between its blocks (other sessions' training) and the joins' own passes.
POOL_SHARE = 0.5


def pool_rows(limit: int, rows: int, free_bytes: int, row_bytes: int) -> int:
    """Rows a sample stream's decode cache is allocated for at its start (its pool: joins within
    it copy none of the running rows' KV): the stream's row `limit`, fewer where POOL_SHARE of
    what is free beside the first operations' estimate (`free_bytes`) holds fewer rows of
    `row_bytes` each beyond their own `rows`; never fewer than those. Joins past the pool still
    run, at the cost of a copy their admission counts (DecodeStream.join_reserve_bytes)."""
    if row_bytes <= 0:
        return max(rows, limit)
    spare = int(max(0, free_bytes) * POOL_SHARE) // row_bytes
    return max(rows, min(limit, rows + spare))


def refusal(kind: OperationKind, needed: int, room: Headroom) -> ResourceExhausted:
    return ResourceExhausted(
        f"{kind.value} would need an estimated {needed} bytes ({needed / MIB:.1f} MiB) of memory"
        f" beyond what is resident, and {room.free_bytes} bytes ({room.free_bytes / MIB:.1f}"
        f" MiB) are free ({room.bound}): it did not run, and the session's state is unchanged"
    )
