"""Which sessions a generator lane's staged changes alter, by fence: the record behind
LanedEngine.changed_sessions, the lanes' join rule (service/scheduling/sample_streams.py
`_fence_allows`).

A resource with generators apart (hosts/replicas/engine.py, hosts/vllm/engine.py) numbers each
change of what a session's generator serves by fence. A sample joining a running lane stream brings
its fence, and the lane's generator applies the changes up to it first; so it may join only if
none of the changes between the stream's fence and its own alters a session decoding there.
PIPELINE installs are left out: they switch a session's running rows between blocks anyway.

Imports: nothing of posttrain.
"""

from __future__ import annotations

from collections import deque

# Staged changes a resource remembers for the join rule: a stream whose fence is older than all
# of them admits no later sample (it waits for the next generation).
CHANGES_KEPT = 4096


class StagedChanges:
    """(fence, session, PIPELINE install) of a resource's latest staged changes. The caller
    serializes calls (its staging lock)."""

    def __init__(self, kept: int = CHANGES_KEPT) -> None:
        self._changes: deque[tuple[int, str, bool]] = deque(maxlen=kept)

    def staged(self, fence: int, session_id: str, pipeline: bool) -> None:
        self._changes.append((fence, session_id, pipeline))

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
