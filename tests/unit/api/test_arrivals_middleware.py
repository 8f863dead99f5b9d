"""The arrivals middleware (api/arrivals.py) counts a sample POST unanswered until its answer
leaves: by the time the client holds the answer's last byte, the POST no longer counts, so the
client's next sample POST is not taken for one sent beside it (and held)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from posttrain.api.arrivals import ArrivalsMiddleware
from posttrain.service.operations.arrivals import Arrivals

SESSION = "sess-1"


def scope(arrivals: Arrivals, method: str, path: str) -> dict:
    app = SimpleNamespace(state=SimpleNamespace(services=SimpleNamespace(arrivals=arrivals)))
    return {"type": "http", "method": method, "path": path, "app": app}


async def answer_in_two_chunks(scope: dict, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{", "more_body": True})
    await send({"type": "http.response.body", "body": b"}"})


def counts_as_sent(arrivals: Arrivals, app, method: str, path: str) -> list[tuple[str, int]]:
    """What the client could see: the unanswered count as each message reaches it."""
    seen: list[tuple[str, int]] = []

    async def send(message: dict) -> None:
        seen.append((message["type"], arrivals.unanswered(SESSION)))

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    asyncio.run(ArrivalsMiddleware(app)(scope(arrivals, method, path), receive, send))
    return seen


@pytest.mark.parametrize(
    "path",
    [
        f"/v1/rl/training-sessions/{SESSION}/operations/sample",
        f"/v1/rl/training-sessions/{SESSION}:sample",
    ],
)
def test_a_sample_post_counts_unanswered_until_its_last_byte_is_sent(path):
    arrivals = Arrivals()
    seen = counts_as_sent(arrivals, answer_in_two_chunks, "POST", path)
    assert seen == [
        ("http.response.start", 1),
        ("http.response.body", 1),
        ("http.response.body", 0),  # counted answered before the last bytes leave
    ]
    assert arrivals.unanswered() == 0
    assert arrivals.count(lambda session_id: True) == 0  # no longer arriving either


def test_a_sample_post_that_ends_without_an_answer_stops_counting():
    arrivals = Arrivals()

    async def dropped(scope: dict, receive, send) -> None:
        raise ConnectionResetError("the client went away")

    with pytest.raises(ConnectionResetError):
        counts_as_sent(
            arrivals, dropped, "POST", f"/v1/rl/training-sessions/{SESSION}/operations/sample"
        )
    assert arrivals.unanswered() == 0
    assert arrivals.count(lambda session_id: True) == 0


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", f"/v1/rl/training-sessions/{SESSION}/operations/sample/op-1"),
        ("POST", f"/v1/rl/training-sessions/{SESSION}/operations/forward-backward"),
    ],
)
def test_other_requests_are_not_counted(method, path):
    arrivals = Arrivals()
    seen = counts_as_sent(arrivals, answer_in_two_chunks, method, path)
    assert [count for _, count in seen] == [0, 0, 0]
