"""Memory admission: which of a group's operations run, in which passes, before anything runs.

The scheduler hands every group here between marking it RUNNING and the engine pass (the one
place operations are admitted to run). An operation whose estimated peak alone exceeds what is
free fails RESOURCE_EXHAUSTED without touching anything, so its session's weights, optimizer
state, gradients and step stay as they were; the others run, split into consecutive passes
where together they would not fit. Passes keep the group's order, so each session's order
holds (a group has at most one forward-backward per session; samples change no state).

Not here: the estimate (engine/memory/estimate.py), what is free (engine/memory/headroom.py),
and a sample stream's pool, which the stream sizes itself from what is free beside its first
operations (engine/generate/sample_stream.py pool_rows).

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


def refusal(kind: OperationKind, needed: int, room: Headroom) -> ResourceExhausted:
    return ResourceExhausted(
        f"{kind.value} would need an estimated {needed} bytes ({needed / MIB:.1f} MiB) of memory"
        f" beyond what is resident, and {room.free_bytes} bytes ({room.free_bytes / MIB:.1f}"
        f" MiB) are free ({room.bound}): it did not run, and the session's state is unchanged"
    )
