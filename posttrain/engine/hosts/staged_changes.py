"""Staged changes of what a generator lane serves, and the record behind the lanes' join rule
(LanedEngine.changed_sessions; service/scheduling/sample_streams.py `_fence_allows`).

A resource with generators apart (hosts/lanes.py: hosts/replicas/engine.py, hosts/vllm/engine.py)
numbers each change of what a session's generator serves by fence. A change is a `StagedChange`:
a frozen dataclass, one class per kind (a replica process's in hosts/replicas/staged.py, a vLLM
server's in hosts/vllm/replica.py), whose `apply` is its one handler, on the generator that
applies it; so the checker sees each kind's fields and what its handler needs.

A sample joining a running lane stream brings its fence, and the lane's generator applies the
changes up to it first; so it may join only if none of the changes between the stream's fence
and its own alters a session decoding there. PIPELINE installs are left out: they switch a
session's running rows between blocks anyway.

Imports: nothing of posttrain.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

# Staged changes a resource remembers for the join rule: a stream whose fence is older than all
# of them admits no later sample (it waits for the next generation).
CHANGES_KEPT = 4096

G = TypeVar("G", contravariant=True)  # what a change's handler needs of the generator


@dataclass(frozen=True)
class StagedChange(ABC, Generic[G]):
    """One change of what a session's generator serves, at its place (`fence`) in its
    resource's order of changes."""

    fence: int
    session_id: str

    @property
    def pipeline(self) -> bool:
        """Whether it may land between two decode blocks of a running generation (a PIPELINE
        install): the join rule leaves it out."""
        return False

    @abstractmethod
    def apply(self, generator: G) -> None:
        """The change's one handler, run where the generator lives."""


class StagedChanges:
    """(fence, session, PIPELINE install) of a resource's latest staged changes. The caller
    serializes calls (its staging lock)."""

    def __init__(self, kept: int = CHANGES_KEPT) -> None:
        self._changes: deque[tuple[int, str, bool]] = deque(maxlen=kept)

    def staged(self, change: StagedChange[Any]) -> None:
        self._changes.append((change.fence, change.session_id, change.pipeline))

    def sessions(self, after: int, upto: int) -> frozenset[str] | None:
        """The sessions the changes after fence `after` up to `upto` alter, PIPELINE installs
        aside; None where some of them are forgotten."""
        changes = self._changes
        if upto > after and (not changes or changes[0][0] > after + 1):
            return None
        return frozenset(
            session
            for fence, session, pipeline in changes
            if after < fence <= upto and not pipeline
        )
