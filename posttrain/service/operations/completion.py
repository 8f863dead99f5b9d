"""Held polls: an operation GET that waits for the operation to finish (api.md 2.5).

The SDK GETs an operation right after its POST and then sleeps 0.5 s between polls; posttrain's
operations often finish in milliseconds, so an unheld loop mostly sleeps. A GET of a PENDING or
RUNNING operation therefore waits, up to a hold limit, for a completion notification and then
answers (and so does a sample POST sent beside others of its session: api/routes/operations.py).
Waiting is an asyncio.Event per held request, set from whichever thread writes the terminal
record (the store calls `operation_written` after every operation write), which hands the
record over: no thread is held per waiter, so hundreds of held requests cost a few hundred
bytes each, and a woken request answers without reading the store again.

Imports: types.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict

from posttrain.records import OperationRecord
from posttrain.statuses import OPERATION_TERMINAL


class Waiter:
    """One held request's wait for one operation: `wait()` returns once the operation is
    terminal (`record` is then its terminal record, so the request need not read it again) or
    once the watch closes (`record` stays None)."""

    def __init__(self, operation_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.operation_id = operation_id
        self._loop = loop
        self._event = asyncio.Event()  # bound to `loop` at its first wait (Python >= 3.10)
        self.record: OperationRecord | None = None

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()

    def wake(self, record: OperationRecord | None) -> None:
        """From any thread: `record` is set before the event, which the loop sets."""
        if record is not None:
            self.record = record
        try:
            self._loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            pass


class CompletionWatch:
    """Who waits for which operation. Thread-safe: `watch` and `forget` run on the event loop
    or on a handler's worker thread, `operation_written` on worker and handler threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: defaultdict[str, set[Waiter]] = defaultdict(set)
        self._closed = False

    def watch(self, operation_id: str, loop: asyncio.AbstractEventLoop | None = None) -> Waiter:
        """A waiter woken when `operation_id` reaches a terminal status, or when the watch is
        closed; `loop` is the event loop that will wait (default: the running one). Register
        before reading the operation's status: a completion between the read and the
        registration would otherwise be missed."""
        waiter = Waiter(operation_id, loop or asyncio.get_running_loop())
        with self._lock:
            if self._closed:
                waiter.wake(None)
            else:
                self._waiters[operation_id].add(waiter)
        return waiter

    def forget(self, waiter: Waiter) -> None:
        with self._lock:
            waiters = self._waiters.get(waiter.operation_id)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[waiter.operation_id]

    def waiting(self) -> int:
        """Held requests right now (for /metrics and tests)."""
        with self._lock:
            return sum(len(waiters) for waiters in self._waiters.values())

    def operation_written(self, op: OperationRecord) -> None:
        if op.status in OPERATION_TERMINAL:
            with self._lock:
                waiters = self._waiters.pop(op.id, set())
            for waiter in waiters:
                waiter.wake(op)

    def close(self) -> None:
        """Server shutdown: every held request answers now, and later ones are not held."""
        with self._lock:
            self._closed = True
            waiters = [waiter for per_op in self._waiters.values() for waiter in per_op]
            self._waiters.clear()
        for waiter in waiters:
            waiter.wake(None)
