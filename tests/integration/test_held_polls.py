"""Held polls (service/operations/completion.py): an operation GET waits for its operation to
finish, up to `--poll-hold-seconds`, so the SDK's first poll carries the result; meanwhile other
requests are answered at once, held GETs cost no thread each, and a shutdown ends them cleanly."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess
from helpers import API_KEY, open_session, sft_sample

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
TERMINAL = ("TRAINING_OPERATION_STATUS_COMPLETED", "TRAINING_OPERATION_STATUS_FAILED")
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
# 64 samples of 480 tokens from the tiny model: seconds of work per operation on a CPU.
HEAVY = {
    "model_inputs": [{"chunks": [{"encoded_text": {"tokens": [3, 4, 5, 6]}}]}],
    "num_samples": 64,
    "sampling_params": {"max_tokens": 480, "temperature": 1.0, "seed": 1},
}


def server_with_hold(tmp_path: Path, seconds: float) -> ServerProcess:
    # The access log is what these tests count requests in.
    return ServerProcess.started(tmp_path, "--poll-hold-seconds", str(seconds), "--access-log")


def post(client: httpx.Client, session_id: str, kind: str, body: dict) -> dict:
    response = client.post(
        f"/v1/rl/training-sessions/{session_id}/operations/{kind}",
        json=body,
        headers={"Idempotency-Key": str(uuid.uuid4())},
    )
    assert response.status_code == 200, response.text
    return response.json()


def op_url(session_id: str, kind: str, op_id: str) -> str:
    return f"/v1/rl/training-sessions/{session_id}/operations/{kind}/{op_id}"


def metric(client: httpx.Client, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", client.get("/metrics").text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def threads_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]


def operation_gets(log: str, op_id: str) -> int:
    return len(re.findall(rf'"GET [^"]*/operations/[a-z-]+/{op_id} HTTP', log))


def requests_of(log: str, method: str, session_id: str, kind: str) -> int:
    return len(re.findall(rf'"{method} [^"]*/{session_id}/operations/{kind}[/ ]', log))


@pytest.fixture(scope="module")
def short_hold(tmp_path_factory: pytest.TempPathFactory):
    proc = server_with_hold(tmp_path_factory.mktemp("hold"), 1.0)
    yield proc
    proc.stop()


def test_the_sdks_first_poll_carries_the_result(tmp_path):
    # A hold far longer than the operations take, whatever the machine's load: the first GET
    # of each answers it done (a 1 s hold failed this on a loaded 2-core machine).
    proc = server_with_hold(tmp_path, 30.0)
    resources, session = open_session(proc.base_url)
    with resources, session:
        sample = sft_sample([5, 6, 7, 8, 9, 10], 2)
        assert session.trainer.forward_backward(samples=[sample], loss=CE).loss > 0
        assert session.trainer.optim_step(adam_params={"learning_rate": 1e-3}).step == 1
        sid = session.session_id
    log = proc.log()
    proc.stop()
    # The SDK GETs once right after the POST and sleeps 0.5 s only when that GET is not final:
    # one GET per operation means it never slept.
    for kind in ("forward-backward", "optim-step"):
        assert requests_of(log, "POST", sid, kind) == 1
        assert requests_of(log, "GET", sid, kind) == 1


def test_a_held_get_answers_the_current_status_once_the_hold_passes(short_hold):
    resources, session = open_session(short_hold.base_url)
    with (
        resources,
        session,
        httpx.Client(base_url=short_hold.base_url, headers=HEADERS, timeout=60) as client,
    ):
        sid = session.session_id
        heavy = [post(client, sid, "sample", HEAVY) for _ in range(2)]
        quick = post(
            client, sid, "forward-backward", {"samples": [sft_sample([5, 6, 7], 1)], "loss": CE}
        )
        # Queued behind seconds of sampling, the forward-backward is still PENDING after the
        # 1 s hold: the GET answers that, and the client polls again.
        first = client.get(op_url(sid, "forward-backward", quick["id"]))
        assert first.json()["status"] == "TRAINING_OPERATION_STATUS_PENDING"
        # A held GET closes its connection (a client's pool then keeps one connection per
        # operation in flight, not two); an answer at once keeps it alive.
        assert first.headers["connection"] == "close"
        # Held GETs until it is done: every answer is a status, the last one COMPLETED.
        for _ in range(600):
            status = client.get(op_url(sid, "forward-backward", quick["id"])).json()["status"]
            if status in TERMINAL:
                break
        assert status == "TRAINING_OPERATION_STATUS_COMPLETED"
        for op in heavy:  # finished before it, in submission order
            answer = client.get(op_url(sid, "sample", op["id"]))
            assert answer.json()["status"] == status
            assert answer.headers.get("connection") != "close"
        # A terminal operation's GET is not held: it answers at once whatever the hold.
        assert operation_gets(short_hold.log(), heavy[0]["id"]) == 1


def test_held_gets_cost_no_thread_each_leave_other_requests_unblocked_and_end_at_shutdown(
    tmp_path,
):
    # The hold outlasts the held client's read timeout: only the release at shutdown lets the
    # held GETs answer in time.
    proc = server_with_hold(tmp_path, 50.0)
    try:
        resources, session = open_session(proc.base_url)
        _, other = resources, resources.create_session(interval=0.2)
        client = httpx.Client(base_url=proc.base_url, headers=HEADERS, timeout=120)
        sid = session.session_id
        for _ in range(3):
            post(client, sid, "sample", HEAVY)
        waiting = post(
            client, sid, "forward-backward", {"samples": [sft_sample([5, 6, 7], 1)], "loss": CE}
        )
        url = op_url(sid, "forward-backward", waiting["id"])
        threads_before = threads_of(proc.process.pid)  # type: ignore[union-attr]
        count = 200

        async def hold_many() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=count + 10)
            async with httpx.AsyncClient(
                base_url=proc.base_url, headers=HEADERS, timeout=30, limits=limits
            ) as held_client:
                held = [asyncio.create_task(held_client.get(url)) for _ in range(count)]
                for _ in range(2000):
                    await asyncio.sleep(0.01)
                    if await asyncio.to_thread(metric, client, "posttrain_held_polls") >= count:
                        break
                assert metric(client, "posttrain_held_polls") == count
                # No thread per held GET.
                threads = threads_of(proc.process.pid)  # type: ignore[union-attr]
                assert threads - threads_before < count // 4, (threads_before, threads)
                # Other requests are answered meanwhile, while every held GET still waits.
                other_op = await asyncio.to_thread(
                    post, client, other.session_id, "optim-step", {"adam_params": {}}
                )
                assert other_op["status"] in ("TRAINING_OPERATION_STATUS_PENDING",)
                assert (await held_client.get(f"/v1/rl/training-sessions/{sid}")).status_code == 200
                assert (await held_client.get("/")).status_code == 200
                assert (await held_client.get("/v1/rl/supported-models")).status_code == 200
                assert not any(task.done() for task in held)
                # Shutdown: every held GET answers the current status, and the server exits.
                proc.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
                return await asyncio.gather(*held)

        answers = asyncio.run(hold_many())
        assert all(answer.status_code == 200 for answer in answers)
        assert {answer.json()["status"] for answer in answers} == {
            "TRAINING_OPERATION_STATUS_PENDING"
        }
        # A stop by SIGTERM that completed is a success.
        assert proc.process.wait(timeout=60) == 0  # type: ignore[union-attr]
        proc.process = None
        assert "posttrain: stopped (SIGTERM)" in proc.log()
    finally:
        proc.stop()


@pytest.mark.parametrize("hold", [30.0, 0.0])
def test_a_sample_post_sent_beside_another_of_its_session_answers_done(tmp_path, hold):
    """The SDK checks a POST's answer before it polls: a sample POST held until its operation
    is done is never polled. A POST sent alone is answered at once (a loop that submits one by
    one and collects later keeps submitting while its operations run). A hold of 0 holds
    nothing."""
    proc = server_with_hold(tmp_path, hold)
    try:
        resources, session = open_session(proc.base_url)
        with resources, session:
            sid = session.session_id
            url = f"/v1/rl/training-sessions/{sid}/operations/sample"
            quick = {
                "model_inputs": [{"chunks": [{"encoded_text": {"tokens": [3, 4, 5]}}]}],
                "num_samples": 2,
                "sampling_params": {"max_tokens": 6, "temperature": 1.0, "seed": 5},
            }
            body = json.dumps(quick).encode()

            async def scenario() -> tuple[httpx.Response, httpx.Response]:
                async with httpx.AsyncClient(
                    base_url=proc.base_url, headers=HEADERS, timeout=60
                ) as client:
                    release = asyncio.Event()

                    async def slow_body():  # a POST whose body is still arriving
                        yield body[:10]
                        await release.wait()
                        yield body[10:]

                    def key() -> dict[str, str]:
                        return {"Idempotency-Key": str(uuid.uuid4())}

                    slow = asyncio.create_task(client.post(url, content=slow_body(), headers=key()))

                    def unanswered() -> float:
                        with httpx.Client(base_url=proc.base_url, headers=HEADERS) as probe:
                            return metric(probe, "posttrain_sample_posts_unanswered")

                    for _ in range(3000):
                        await asyncio.sleep(0.01)
                        if await asyncio.to_thread(unanswered) >= 1:
                            break
                    assert await asyncio.to_thread(unanswered) == 1
                    beside = await client.post(url, json=quick, headers=key())
                    release.set()
                    return beside, await slow

            beside, alone = asyncio.run(scenario())
            assert beside.status_code == 200 and alone.status_code == 200, beside.text
            done = beside.json()
            with httpx.Client(base_url=proc.base_url, headers=HEADERS, timeout=60) as client:
                if not hold:  # answered at once, as submitted
                    assert done["status"] in (
                        "TRAINING_OPERATION_STATUS_PENDING",
                        "TRAINING_OPERATION_STATUS_RUNNING",
                    )
                    assert beside.headers.get("connection") != "close"
                    for _ in range(600):  # unheld polls: the client polls until it is done
                        done = client.get(op_url(sid, "sample", done["id"])).json()
                        if done["status"] in TERMINAL:
                            break
                        time.sleep(0.05)
                else:
                    assert beside.headers["connection"] == "close"  # held, like a held GET
                assert done["status"] == "TRAINING_OPERATION_STATUS_COMPLETED"
                # What the POST answered is what a GET answers: the whole result.
                polled = client.get(op_url(sid, "sample", done["id"]))
                assert polled.json() == done
                (result,) = done["output"]["results"]
                assert [len(seq["tokens"]) for seq in result["sequences"]] == [6, 6]
                # Answered at once: its operation had not run yet (nothing was held).
                assert alone.json()["status"] in (
                    "TRAINING_OPERATION_STATUS_PENDING",
                    "TRAINING_OPERATION_STATUS_RUNNING",
                )
                assert alone.headers.get("connection") != "close"
                assert metric(client, "posttrain_sample_posts_unanswered") == 0
                assert metric(client, "posttrain_held_polls") == 0
    finally:
        proc.stop()


def test_sdk_samples_sent_together_return_what_each_returns_alone(tmp_path):
    """tinker-cookbook's shape: one-sample operations under asyncio.gather. Those whose POSTs
    were held return the result their POST answered; every one equals the same request run
    alone."""
    proc = server_with_hold(tmp_path, 30.0)
    try:
        resources, session = open_session(proc.base_url)
        with resources, session:
            prompt = {"chunks": [{"encoded_text": {"tokens": [3, 4, 5, 6]}}]}

            def params(seed: int) -> dict:
                return {"max_tokens": 8, "temperature": 1.0, "seed": seed}

            async def together() -> list:
                return await asyncio.gather(
                    *(
                        session.generator.sample_async(
                            prompt, num_samples=1, sampling_params=params(seed)
                        )
                        for seed in range(8)
                    )
                )

            gathered = asyncio.run(together())
            alone = [
                session.generator.sample(prompt, num_samples=1, sampling_params=params(seed))
                for seed in range(8)
            ]
            for seed, (one, other) in enumerate(zip(gathered, alone, strict=True)):
                assert [s.tokens for s in one.sequences] == [s.tokens for s in other.sequences]
                for mine, theirs in zip(one.sequences, other.sequences, strict=True):
                    assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-5), seed
            assert len({tuple(r.sequences[0].tokens) for r in gathered}) > 1  # seeds differ
            sid = session.session_id
        log = proc.log()
        assert requests_of(log, "POST", sid, "sample") == 16
    finally:
        proc.stop()
