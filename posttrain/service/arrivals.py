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
from collections.abc import Callable
from contextvars import ContextVar


class Arrival:
    """One sample submission being received; `done()` (idempotent) once it is queued, or once
    its request ended without queueing."""

    def __init__(self, arrivals: Arrivals, session_id: str) -> None:
        self._arrivals = arrivals
        self._session_id = session_id
        self._done = False

    def done(self) -> None:
        with self._arrivals._lock:
            if self._done:
                return
            self._done = True
            count = self._arrivals._count
            count[self._session_id] -= 1
            if count[self._session_id] <= 0:
                del count[self._session_id]


# The arrival of the request being handled: the API sets it, the scheduler ends it as soon as
# the operation is queued, so a worker never waits for the very operation it is about to run.
CURRENT_ARRIVAL: ContextVar[Arrival | None] = ContextVar("posttrain_arrival", default=None)


class Arrivals:
    """Per session, sample submissions the API is handling. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: Counter[str] = Counter()

    def start(self, session_id: str) -> Arrival:
        with self._lock:
            self._count[session_id] += 1
        return Arrival(self, session_id)

    def count(self, counts_for: Callable[[str], bool]) -> int:
        """Submissions in flight of the sessions `counts_for` accepts."""
        with self._lock:
            return sum(n for session_id, n in self._count.items() if counts_for(session_id))


def end_current_arrival() -> None:
    """The current request's operation is queued: it is no longer arriving."""
    arrival = CURRENT_ARRIVAL.get()
    if arrival is not None:
        arrival.done()
