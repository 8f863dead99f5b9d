"""CompletionWatch: held requests wake when their operation is written terminal, from any
thread, and receive the terminal record."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

from posttrain.records import OperationRecord
from posttrain.service.operations.completion import CompletionWatch
from posttrain.statuses import OperationStatus
from posttrain.types import OperationKind


def record(op_id: str, status: OperationStatus) -> OperationRecord:
    return OperationRecord(
        id=op_id,
        session_id="ts-1",
        kind=OperationKind.SAMPLE,
        status=status,
        created_at=0.0,
        updated_at=0.0,
        idempotency_key="k",
        fingerprint="f",
        created_by="u",
    )


def test_a_terminal_write_from_another_thread_wakes_only_that_operations_waiters():
    watch = CompletionWatch()

    async def scenario() -> None:
        first, second, other = watch.watch("op-1"), watch.watch("op-1"), watch.watch("op-2")
        assert watch.waiting() == 3
        running = record("op-1", OperationStatus.RUNNING)
        thread = threading.Thread(target=watch.operation_written, args=(running,))
        thread.start()
        thread.join()
        await asyncio.sleep(0)
        assert not first.is_set()  # RUNNING is not terminal
        done = dataclasses.replace(running, status=OperationStatus.COMPLETED)
        thread = threading.Thread(target=watch.operation_written, args=(done,))
        thread.start()
        thread.join()
        await asyncio.wait_for(asyncio.gather(first.wait(), second.wait()), timeout=30)
        assert first.record == done and second.record == done  # no second read needed
        assert not other.is_set() and other.record is None
        assert watch.waiting() == 1
        watch.forget(first)  # forgetting an already woken waiter is harmless
        watch.forget(other)
        assert watch.waiting() == 0

    asyncio.run(scenario())


def test_close_wakes_every_waiter_and_later_watches_do_not_wait():
    watch = CompletionWatch()

    async def scenario() -> None:
        waiters = [watch.watch(f"op-{i}") for i in range(100)]
        watch.close()
        await asyncio.wait_for(asyncio.gather(*(w.wait() for w in waiters)), timeout=30)
        assert all(w.record is None for w in waiters)  # no terminal record: read it again
        late = watch.watch("op-late")
        await asyncio.wait_for(late.wait(), timeout=30)
        assert watch.waiting() == 0

    asyncio.run(scenario())


def test_a_watch_registered_from_a_worker_thread_wakes_its_loop():
    """The API registers a watch on the handler's worker thread, for the loop that will wait."""
    watch = CompletionWatch()

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        waiter = await asyncio.to_thread(watch.watch, "op-1", loop)
        assert watch.waiting() == 1 and not waiter.is_set()
        done = record("op-1", OperationStatus.FAILED)
        await asyncio.to_thread(watch.operation_written, done)
        await asyncio.wait_for(waiter.wait(), timeout=30)
        assert waiter.record == done and watch.waiting() == 0

    asyncio.run(scenario())
