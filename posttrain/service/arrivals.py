"""Sample submissions received but not yet queued, so a worker can wait for them to arrive.

tinker-cookbook's RL loop submits one `num_samples=1` sample operation per rollout, all at
once. Without waiting, the worker starts the first to arrive alone and the others queue up
behind a pass that costs nearly what a pass of all of them would (decode passes on small
batches are fixed-cost): 64 such operations took two passes or more instead of one. So a worker
about to run a sample pass first waits, up to a short limit, while sample POSTs of sessions on
its resource are still being received; they join the pass. A loop that submits one operation
at a time never waits: nothing else is arriving.

Imports: nothing from posttrain.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Arrivals:
    """Per session, sample submissions the API is handling. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: Counter[str] = Counter()

    @contextmanager
    def arriving(self, session_id: str) -> Iterator[None]:
        with self._lock:
            self._count[session_id] += 1
        try:
            yield
        finally:
            with self._lock:
                self._count[session_id] -= 1
                if self._count[session_id] <= 0:
                    del self._count[session_id]

    def count(self, counts_for: Callable[[str], bool]) -> int:
        """Submissions in flight of the sessions `counts_for` accepts."""
        with self._lock:
            return sum(n for session_id, n in self._count.items() if counts_for(session_id))
