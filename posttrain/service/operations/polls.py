"""The poll-hold policy: how long a request for an operation waits for it to finish.

A GET of a PENDING or RUNNING operation (and a sample POST sent beside others of its session,
api/routes/operations.py) is answered once the operation finishes or `hold_s` pass, so the
SDK's first poll already carries the result (service/operations/completion.py says how waiting
works).

The order is what makes it safe: the operation is watched before its status is read, so a
completion between the two wakes the wait instead of being missed. A woken request answers
with the record the completion handed over; one whose hold passed (or whose server is shutting
down) reads the operation again. Reads run on a worker thread, never on the event loop.

Imports: service.completion, service.operations, types.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import anyio.to_thread

from posttrain.records import OperationRecord
from posttrain.service.operations.completion import CompletionWatch, Waiter
from posttrain.service.operations.submit import OperationService
from posttrain.statuses import OPERATION_TERMINAL
from posttrain.types import OperationKind


@dataclass(frozen=True)
class Settled:
    op: OperationRecord
    was_held: bool  # it waited for the operation (whose answer then closes its connection)


class PollHold:
    def __init__(
        self, watch: CompletionWatch, operations: OperationService, *, hold_s: float
    ) -> None:
        self.watch = watch
        self.operations = operations
        self.hold_s = hold_s

    def is_settled(self, op: OperationRecord) -> bool:
        """Whether `op`, just read, is the answer as it stands: finished, or holds are off."""
        return op.status in OPERATION_TERMINAL or self.hold_s <= 0

    async def settled(
        self,
        user: str,
        session_id: str,
        kind: OperationKind,
        operation_id: str,
        *,
        hold_s: float | None = None,
    ) -> Settled:
        """`user`'s operation once it is finished or the hold passed (`hold_s`, else the
        configured hold); NotFound as OperationService.get raises it."""
        hold = self.hold_s if hold_s is None or self.hold_s <= 0 else hold_s

        def read() -> OperationRecord:
            return self.operations.get(user, session_id, kind, operation_id)

        if hold <= 0:
            return Settled(await anyio.to_thread.run_sync(read), was_held=False)
        loop = asyncio.get_running_loop()

        def watched() -> tuple[Waiter, OperationRecord]:
            waiter = self.watch.watch(operation_id, loop)
            try:
                return waiter, read()
            except BaseException:
                self.watch.forget(waiter)
                raise

        waiter, op = await anyio.to_thread.run_sync(watched)
        try:
            if op.status in OPERATION_TERMINAL:
                return Settled(op, was_held=False)
            try:
                await asyncio.wait_for(waiter.wait(), timeout=hold)
            except TimeoutError:
                pass  # the hold passed: answer the current status, the SDK polls again
            if waiter.record is None:  # not woken by the completion: read it again
                return Settled(await anyio.to_thread.run_sync(read), was_held=True)
            return Settled(waiter.record, was_held=True)
        finally:
            self.watch.forget(waiter)
