"""Held polls: an operation GET that waits for the operation to finish (api.md 2.5).

The SDK GETs an operation right after its POST and then sleeps 0.5 s between polls; posttrain's
operations often finish in milliseconds, so an unheld loop mostly sleeps. A GET of a PENDING or
RUNNING operation therefore waits, up to a hold limit, for a completion notification and then
answers. Waiting is an asyncio.Event per held GET, set from whichever thread writes the
terminal record (the store calls `operation_written` after every operation write): no thread
is held per waiter, so hundreds of held GETs cost a few hundred bytes each.

Imports: types.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict

from posttrain.types import OPERATION_TERMINAL, OperationRecord


class CompletionWatch:
    """Who waits for which operation. Thread-safe: `watch`/`forget` run on the event loop,
    `operation_written` on worker and handler threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: defaultdict[str, dict[asyncio.Event, asyncio.AbstractEventLoop]] = (
            defaultdict(dict)
        )
        self._closed = False

    def watch(self, operation_id: str) -> asyncio.Event:
        """An event set when `operation_id` reaches a terminal status, or when the watch is
        closed. Call on the event loop, before reading the operation's status (a completion
        between the read and the registration would otherwise be missed)."""
        event = asyncio.Event()
        with self._lock:
            if self._closed:
                event.set()
            else:
                self._waiters[operation_id][event] = asyncio.get_running_loop()
        return event

    def forget(self, operation_id: str, event: asyncio.Event) -> None:
        with self._lock:
            waiters = self._waiters.get(operation_id)
            if waiters is not None:
                waiters.pop(event, None)
                if not waiters:
                    del self._waiters[operation_id]

    def waiting(self) -> int:
        """Held GETs right now (for /metrics and tests)."""
        with self._lock:
            return sum(len(waiters) for waiters in self._waiters.values())

    def operation_written(self, op: OperationRecord) -> None:
        if op.status in OPERATION_TERMINAL:
            with self._lock:
                waiters = self._waiters.pop(op.id, {})
            _wake(waiters)

    def close(self) -> None:
        """Server shutdown: every held GET answers now, and later ones are not held."""
        with self._lock:
            self._closed = True
            waiters: dict[asyncio.Event, asyncio.AbstractEventLoop] = {}
            for per_op in self._waiters.values():
                waiters.update(per_op)
            self._waiters.clear()
        _wake(waiters)


def _wake(waiters: dict[asyncio.Event, asyncio.AbstractEventLoop]) -> None:
    for event, loop in waiters.items():
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            pass
