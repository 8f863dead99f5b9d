"""Concurrent replays of one Idempotency-Key: many clients racing the same POST (a retrying
SDK, a load balancer replaying, a user's loop restarted) make one operation, and its effect
happens once. Through the official SDK against a real server."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
from helpers import low_level, open_session, sft_sample

REPLAYS = 400
CLIENTS = 32
TOKENS = [1, 40, 41, 42, 50, 60, 70]
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}


def race(base_url: str, submit: Callable[[object, str], object]) -> list:
    """REPLAYS submissions under one key from CLIENTS threads at once: each call is the
    official SDK's POST with that Idempotency-Key, and each thread is a client of its own.
    (One SDK client shared by 32 threads once failed inside httpcore with EBADF, a race in its
    connection pool, not the server's answer: separate clients are also what really races.)"""
    key = str(uuid.uuid4())
    clients = threading.local()

    def one(_: int) -> object:
        if not hasattr(clients, "ops"):
            clients.ops = low_level(base_url).post_training.operations
        return submit(clients.ops, key)

    with ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(one, range(REPLAYS)))


def test_concurrent_replays_of_one_key_make_one_operation_and_one_step(shared_server):
    _, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 3})
    sid = session.session_id
    url = shared_server.base_url
    fbs = race(
        url,
        lambda ops, key: ops.forward_backward(
            sid, idempotency_key=key, loss=CE, samples=[sft_sample(TOKENS, 2)]
        ),
    )
    steps = race(
        url,
        lambda ops, key: ops.optim_step(
            sid, idempotency_key=key, adam_params={"learning_rate": 1e-2}
        ),
    )
    for answers in (fbs, steps):
        assert len(answers) == REPLAYS and len({a.id for a in answers}) == 1

    # One optim-step ran, over one forward-backward's gradients: the next step is the second,
    # and the server recorded one forward-backward and two optim-steps.
    done = session.trainer.optim_step(adam_params={"learning_rate": 1e-2}, interval=0.05)
    assert done.step == 2
    assert session.retrieve().step == 2
    metrics = httpx.get(f"{shared_server.base_url}/metrics").text
    assert 'posttrain_operations{kind="optim-step",status="completed"} 2' in metrics
    assert 'posttrain_operations{kind="forward-backward",status="completed"} 1' in metrics
    session.stop()
