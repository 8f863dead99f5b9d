"""Sample progress: the tokens a running sample operation drew so far, for whoever watches it
(a streamed OpenAI reply, service/openai/completions.py), in memory only.

A watcher registers for an operation (`watch`) and reads its status after, as a held poll does
(service/operations/completion.py): the terminal write of the operation closes every channel
on it (the store calls `operation_written` after every operation write), handing the record
over. The sample stream that decodes the operation (service/scheduling/sample_streams.py)
asks which of its operations are watched at every decode block boundary (`watched`) and
publishes the tokens they drew since (`publish`), once per block; the engine reports an
operation followed for the first time from its first token, so a watch that starts after the
operation did misses none. Nothing is written to the store per token, and an operation no one
watches costs nothing but the look-up: its tokens are not even reported.

Where a sample does not run as a stream (a whole-batch pass, a vLLM lane), nothing is published:
the channel only closes, and the watcher reads the result whole.

Imports: records, statuses.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Collection

from posttrain.records import OperationRecord
from posttrain.statuses import OPERATION_TERMINAL


class ProgressChannel:
    """One watcher's view of one operation: the tokens published since it last took them, per
    sequence (prompt-major, then sample order), and the terminal record once closed."""

    def __init__(self, operation_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.operation_id = operation_id
        self._loop = loop
        self._lock = threading.Lock()
        self._event = asyncio.Event()  # bound to `loop` at its first wait
        self._drawn: dict[int, list[int]] = defaultdict(list)  # sequence -> tokens not taken
        self.closed = False
        self.record: OperationRecord | None = None  # the terminal record, once closed by it

    def _wake(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            pass

    def put(self, drawn: list[list[int]]) -> None:
        """From the worker thread: each sequence's tokens drawn since the last put."""
        with self._lock:
            for sequence, tokens in enumerate(drawn):
                if tokens:
                    self._drawn[sequence].extend(tokens)
        self._wake()

    def close(self, record: OperationRecord | None) -> None:
        """From any thread: the operation finished (`record`) or the server shuts down (None)."""
        with self._lock:
            self.record = record if record is not None else self.record
            self.closed = True
        self._wake()

    async def take(self) -> dict[int, list[int]]:
        """The tokens per sequence published since the last take, waiting for some unless the
        channel is closed (then possibly none)."""
        while True:
            with self._lock:
                drawn, self._drawn = dict(self._drawn), defaultdict(list)
                closed = self.closed
                self._event.clear()
            if drawn or closed:
                return drawn
            await self._event.wait()


class SampleProgress:
    """Who watches which sample operation's progress. Thread-safe: `watch` and `forget` run on
    the event loop or a handler's thread, `watched` and `publish` on resource workers,
    `operation_written` on whichever thread writes an operation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channels: defaultdict[str, set[ProgressChannel]] = defaultdict(set)
        self._closed = False

    def watch(
        self, operation_id: str, loop: asyncio.AbstractEventLoop | None = None
    ) -> ProgressChannel:
        """A channel on `operation_id`'s progress, closed by its terminal write; register
        before reading the operation's status (a completion between the two would otherwise be
        missed)."""
        channel = ProgressChannel(operation_id, loop or asyncio.get_running_loop())
        with self._lock:
            if self._closed:
                channel.close(None)
            else:
                self._channels[operation_id].add(channel)
        return channel

    def forget(self, channel: ProgressChannel) -> None:
        with self._lock:
            channels = self._channels.get(channel.operation_id)
            if channels is not None:
                channels.discard(channel)
                if not channels:
                    del self._channels[channel.operation_id]

    def watched(self, operation_ids: Collection[str]) -> set[str]:
        """Those of `operation_ids` someone watches."""
        with self._lock:
            if not self._channels:
                return set()
            return {op_id for op_id in operation_ids if op_id in self._channels}

    def publish(self, operation_id: str, drawn: list[list[int]]) -> None:
        """The tokens each sequence of the operation drew since the last publish."""
        with self._lock:
            channels = list(self._channels.get(operation_id, ()))
        for channel in channels:
            channel.put(drawn)

    def operation_written(self, op: OperationRecord) -> None:
        if op.status in OPERATION_TERMINAL:
            with self._lock:
                channels = self._channels.pop(op.id, set())
            for channel in channels:
                channel.close(op)

    def close(self) -> None:
        """Server shutdown: every channel closes now, and later ones start closed."""
        with self._lock:
            self._closed = True
            channels = [channel for per_op in self._channels.values() for channel in per_op]
            self._channels.clear()
        for channel in channels:
            channel.close(None)
