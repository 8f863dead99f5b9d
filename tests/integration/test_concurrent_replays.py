"""Concurrent replays of one Idempotency-Key: many clients racing the same POST (a retrying
SDK, a load balancer replaying, a user's loop restarted) make one operation, and its effect
happens once. Against a real server over HTTP."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
from helpers import API_KEY, open_session, sft_sample

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
REPLAYS = 400
CLIENTS = 32
TOKENS = [1, 40, 41, 42, 50, 60, 70]


def race(url: str, body: bytes, key: str) -> list[httpx.Response]:
    """REPLAYS POSTs of one body under one key from CLIENTS threads at once."""
    headers = {**HEADERS, "Idempotency-Key": key, "Content-Type": "application/json"}
    with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=CLIENTS)) as client:
        with ThreadPoolExecutor(CLIENTS) as pool:
            return list(
                pool.map(lambda _: client.post(url, content=body, headers=headers), range(REPLAYS))
            )


def test_concurrent_replays_of_one_key_make_one_operation_and_one_step(shared_server):
    _, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 3})
    base = f"{shared_server.base_url}/v1/rl/training-sessions/{session.session_id}/operations"
    fb_body = json.dumps(
        {"loss": {"type": "LOSS_TYPE_CROSS_ENTROPY"}, "samples": [sft_sample(TOKENS, 2)]}
    ).encode()
    step_body = json.dumps({"adam_params": {"learning_rate": 1e-2}}).encode()

    for kind, body in (("forward-backward", fb_body), ("optim-step", step_body)):
        responses = race(f"{base}/{kind}", body, str(uuid.uuid4()))
        assert {r.status_code for r in responses} == {200}, {r.text for r in responses}
        assert len({r.json()["id"] for r in responses}) == 1

    # One optim-step ran, over one forward-backward's gradients: the next step is the second,
    # and the server recorded one forward-backward and two optim-steps.
    done = session.trainer.optim_step(adam_params={"learning_rate": 1e-2}, interval=0.05)
    assert done.step == 2
    assert session.retrieve().step == 2
    metrics = httpx.get(f"{shared_server.base_url}/metrics").text
    assert 'posttrain_operations{kind="optim-step",status="completed"} 2' in metrics
    assert 'posttrain_operations{kind="forward-backward",status="completed"} 1' in metrics
    session.stop()
