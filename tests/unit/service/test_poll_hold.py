"""PollHold over real services and a real store (fake engine): a finished operation answers at
once, one that finishes while held answers with the record its completion handed over, and one
that outlasts the hold answers its current status; only a wait counts as held."""

from __future__ import annotations

import asyncio

from fake_engine import USER, fb, wired_fixture  # noqa: F401

from posttrain.service.operations.completion import CompletionWatch
from posttrain.service.operations.polls import PollHold
from posttrain.statuses import OperationStatus
from posttrain.types import OperationKind

FB = OperationKind.FORWARD_BACKWARD


def hold_over(wired, hold_s: float) -> PollHold:
    watch = CompletionWatch()
    wired.repo.add_operation_listener(watch.operation_written)
    return PollHold(watch, wired.operations, hold_s=hold_s)


def test_a_finished_operation_is_answered_at_once_and_a_pending_one_after_it_finishes(wired):
    polls = hold_over(wired, hold_s=60.0)
    rid = wired.resource()
    sid = wired.session(rid)
    done = wired.submit(sid, FB, fb(), "done")
    wired.drain(rid)
    release = wired.hold(rid)  # the next operation stays PENDING until released
    pending = wired.submit(sid, FB, fb(), "pending")

    async def scenario():
        finished = await polls.settled(USER, sid, FB, done)
        waiting = asyncio.ensure_future(polls.settled(USER, sid, FB, pending))
        while polls.watch.waiting() == 0:  # watched before it was read
            await asyncio.sleep(0.001)
        release.set()
        return finished, await waiting

    finished, woken = asyncio.run(scenario())
    assert (finished.op.status, finished.was_held) == (OperationStatus.COMPLETED, False)
    assert (woken.op.id, woken.op.status, woken.was_held) == (
        pending,
        OperationStatus.COMPLETED,
        True,
    )
    assert polls.watch.waiting() == 0


def test_an_operation_that_outlasts_the_hold_answers_its_current_status(wired):
    polls = hold_over(wired, hold_s=0.05)
    rid = wired.resource()
    sid = wired.session(rid)
    release = wired.hold(rid)
    pending = wired.submit(sid, FB, fb(), "pending")
    try:
        answer = asyncio.run(polls.settled(USER, sid, FB, pending))
    finally:
        release.set()
    assert (answer.op.status, answer.was_held) == (OperationStatus.PENDING, True)
    assert polls.watch.waiting() == 0
    unheld = hold_over(wired, hold_s=0.0)
    wired.drain(rid)
    answer = asyncio.run(unheld.settled(USER, sid, FB, pending))
    assert (answer.op.status, answer.was_held) == (OperationStatus.COMPLETED, False)
