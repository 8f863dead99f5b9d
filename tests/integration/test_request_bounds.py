"""A request is bounded before it runs: the key is checked before the body is read, bodies are
capped, and every unbounded or out-of-range input is a 4xx naming the field that changes
nothing; a step that would overflow the weights fails NON_FINITE_LOSS and leaves the session
exactly as it was; /metrics names no ids. Against a real server, through the SDK where it can
send the request and raw HTTP where it cannot."""

from __future__ import annotations

import json
import socket
import uuid
from urllib.parse import urlparse

import httpx
import pytest
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL, open_session, sft_sample
from together.post_training._operations import OperationFailedError

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
FAST = 0.05
TOKENS = [1, 40, 41, 42, 50, 60, 70, 80]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    proc = ServerProcess.started(
        tmp_path_factory.mktemp("bounds"), "--poll-hold-seconds", "0", "--max-body-mib", "1"
    )
    yield proc
    proc.stop()


def raw_exchange(base_url: str, head: str, body: bytes = b"") -> str:
    """Send a request by hand and read the reply's status line and headers; a server that
    waited for the declared body would never answer, and the socket's timeout fails the test."""
    url = urlparse(base_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    return reply.decode("latin-1")


def test_the_key_is_checked_before_the_body_is_read(server):
    # 200 MiB declared, none of it sent: the answer comes at once, from the headers alone.
    head = (
        "POST /v1/rl/model-resources HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {200 << 20}\r\n\r\n"
    )
    assert raw_exchange(server.base_url, head).startswith("HTTP/1.1 401")
    malformed = httpx.post(f"{server.base_url}/v1/rl/model-resources", content=b"{not json")
    assert malformed.status_code == 401
    assert malformed.json()["error"]["type"] == "authentication_error"


def test_bodies_over_the_limit_are_refused(server):
    head = (
        f"POST /v1/rl/model-resources HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {2 << 20}\r\n\r\n"
    )
    assert raw_exchange(server.base_url, head).startswith("HTTP/1.1 413")

    def chunks():  # no Content-Length: the limit holds on the bytes as they arrive
        yield b'{"base_model": "'
        for _ in range(24):
            yield b"x" * (100 << 10)
        yield b'"}'

    response = httpx.post(
        f"{server.base_url}/v1/rl/model-resources", content=chunks(), headers=HEADERS
    )
    assert response.status_code == 413
    assert response.json()["error"]["param"] == "body"


BAD = {
    "nested 1,000 deep": (b"[" * 1000 + b"]" * 1000, "body"),
    "a 5,000-digit number": (b'{"base_model": ' + b"9" * 5000 + b"}", "body"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_unreadable_json_is_a_400(server, case):
    body, param = BAD[case]
    response = httpx.post(f"{server.base_url}/v1/rl/model-resources", content=body, headers=HEADERS)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_out_of_range_inputs_are_400s_naming_the_field_and_change_nothing(server):
    base = server.base_url
    cost = httpx.post(
        f"{base}/v1/rl/model-resources/estimate-cost", json={"base_model": "nope"}, headers=HEADERS
    )
    assert cost.status_code == 400 and cost.json()["error"]["param"] == "base_model"
    before = httpx.get(f"{base}/v1/rl/model-resources", headers=HEADERS).json()
    replicas = httpx.post(
        f"{base}/v1/rl/model-resources",
        json={"base_model": BASE_MODEL, "compute_config": {"num_generator_replicas": 10**9}},
        headers=HEADERS,
    )
    assert replicas.status_code == 400
    assert replicas.json()["error"]["param"] == "compute_config.num_generator_replicas"
    assert httpx.get(f"{base}/v1/rl/model-resources", headers=HEADERS).json() == before

    resources, session = open_session(base)
    sessions_before = httpx.get(f"{base}/v1/rl/training-sessions", headers=HEADERS).json()
    seed = httpx.post(
        f"{base}/v1/rl/training-sessions",
        json={"model_resources_id": resources.model_resources_id, "lora_config": {"seed": 2**70}},
        headers=HEADERS,
    )
    assert seed.status_code == 400 and seed.json()["error"]["param"] == "lora_config.seed"
    assert httpx.get(f"{base}/v1/rl/training-sessions", headers=HEADERS).json() == sessions_before

    url = f"{base}/v1/rl/training-sessions/{session.session_id}/operations/sample"
    prompt = json.dumps({"chunks": [{"encoded_text": {"tokens": TOKENS}}]})
    for body, param in (
        (  # 1e400 is valid JSON that reads as inf
            f'{{"model_inputs": [{prompt}], "sampling_params": {{"temperature": 1e400}}}}',
            "sampling_params.temperature",
        ),
        (f'{{"model_inputs": [{prompt}], "num_samples": {2**40}}}', "num_samples"),
    ):
        headers = {**HEADERS, "Idempotency-Key": str(uuid.uuid4())}
        response = httpx.post(url, content=body, headers=headers)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    metrics = httpx.get(f"{base}/metrics").text
    assert 'kind="sample"' not in metrics  # no sample operation was recorded
    assert resources.model_resources_id not in metrics and session.session_id not in metrics


def test_a_step_that_would_overflow_the_weights_changes_nothing(server):
    lora = {"rank": 4, "seed": 3}
    _, session = open_session(server.base_url, lora_config=lora)

    def scored() -> list[float]:
        result = session.trainer.forward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
        return result.loss_fn_outputs[0].tensors["logprobs"].data

    session.trainer.forward_backward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
    session.trainer.optim_step(adam_params={"learning_rate": 1e-2}, interval=FAST)
    before = scored()
    session.trainer.forward_backward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
    with pytest.raises(OperationFailedError) as info:
        session.trainer.optim_step(adam_params={"learning_rate": 1e308}, interval=FAST)
    assert "NON_FINITE_LOSS" in str(info.value)
    assert scored() == before  # weights bit-identical
    # The accumulated gradients and the optimizer's moments are intact too: the sane step that
    # follows is the one a session that never saw the bad request takes.
    session.trainer.optim_step(adam_params={"learning_rate": 1e-2}, interval=FAST)
    _, twin = open_session(server.base_url, lora_config=lora)
    for _ in range(2):
        twin.trainer.forward_backward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
        twin.trainer.optim_step(adam_params={"learning_rate": 1e-2}, interval=FAST)
    twin_scored = twin.trainer.forward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
    assert scored() == twin_scored.loss_fn_outputs[0].tensors["logprobs"].data


def test_signed_urls_survive_a_restart(tmp_path):
    proc = ServerProcess.started(tmp_path, "--poll-hold-seconds", "0")
    try:
        _, session = open_session(proc.base_url)
        grant = httpx.post(
            f"{proc.base_url}/v1/rl/training-sessions/{session.session_id}/payloads/upload-url",
            headers=HEADERS,
        ).json()
        proc.stop(kill=True)
        proc.start()  # same data directory, a new port; the URL is relative to the server
        upload = httpx.put(f"{proc.base_url}{grant['upload_url']}", content=b'{"samples": []}')
        assert upload.status_code == 200, upload.text
        tampered = grant["upload_url"].replace("sig=", "sig=0")
        assert httpx.put(f"{proc.base_url}{tampered}", content=b"{}").status_code == 404
    finally:
        proc.stop()
    key_file = tmp_path / "data" / "signing.key"
    assert key_file.stat().st_mode & 0o077 == 0  # readable by its owner only
