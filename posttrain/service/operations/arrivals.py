"""Sample submissions received but not yet queued, so a worker can wait for them to arrive.

tinker-cookbook's RL loop submits one `num_samples=1` sample operation per rollout, all at
once. Without waiting, the worker starts the first to arrive alone and the others queue up
behind a pass that costs nearly what a pass of all of them would (decode passes on small
batches are fixed-cost): 64 such operations took two passes or more instead of one. So a worker
about to run a sample pass first waits, up to a short limit, while sample POSTs of sessions on
its resource are still being received; they join the pass. A loop that submits one operation
at a time never waits: nothing else is arriving.

The same count, kept until each POST is answered, says which sample POSTs came beside others of
their session (api/routes/operations.py holds those until their operation is done).

Imports: nothing from posttrain.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from contextvars import ContextVar


class Arrival:
    """One sample submission being received; `done()` once it is queued, or once its request
    ended without queueing; `answered()` as its answer leaves. Both are idempotent."""

    def __init__(self, arrivals: Arrivals, session_id: str) -> None:
        self._arrivals = arrivals
        self._session_id = session_id
        self._done = False
        self._answered = False

    def answered(self) -> None:
        self.done()
        with self._arrivals._lock:
            if not self._answered:
                self._answered = True
                _decrement(self._arrivals._unanswered, self._session_id)

    def done(self) -> None:
        with self._arrivals._lock:
            if not self._done:
                self._done = True
                _decrement(self._arrivals._count, self._session_id)


def _decrement(counts: Counter[str], session_id: str) -> None:
    """One fewer for the session; a session at zero leaves the counter, so sums and lookups
    stay over the sessions that have requests in flight. Caller holds the lock."""
    counts[session_id] -= 1
    if counts[session_id] <= 0:
        del counts[session_id]


# The arrival of the request being handled: the API sets it, the scheduler ends it as soon as
# the operation is queued, so a worker never waits for the very operation it is about to run.
CURRENT_ARRIVAL: ContextVar[Arrival | None] = ContextVar("posttrain_arrival", default=None)


class Arrivals:
    """Per session, sample submissions the API is handling. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: Counter[str] = Counter()  # received, not yet queued
        self._unanswered: Counter[str] = Counter()  # received, not yet answered

    def start(self, session_id: str) -> Arrival:
        with self._lock:
            self._count[session_id] += 1
            self._unanswered[session_id] += 1
        return Arrival(self, session_id)

    def unanswered(self, session_id: str | None = None) -> int:
        """Sample POSTs of the session (default: of every session) received and not yet
        answered, the caller's included."""
        with self._lock:
            if session_id is None:
                return sum(self._unanswered.values())
            return self._unanswered[session_id]

    def count(self, counts_for: Callable[[str], bool]) -> int:
        """Submissions in flight of the sessions `counts_for` accepts."""
        with self._lock:
            return sum(n for session_id, n in self._count.items() if counts_for(session_id))


def end_current_arrival() -> None:
    """The current request's operation is queued: it is no longer arriving."""
    arrival = CURRENT_ARRIVAL.get()
    if arrival is not None:
        arrival.done()
