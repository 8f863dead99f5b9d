"""`posttrain serve --workers process`: each model resource's engine in a worker process of its
own (engine/hosts/process/worker.py). Through the SDK against a real server: a loop gets exactly
what the in-thread engine gives; a worker killed with SIGKILL fails the operation in flight with
INTERNAL_ERROR naming the worker, the server lives on, the worker is started again and the
session carries on from its last completed operation; shutdown leaves no worker behind."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import ServerProcess
from helpers import open_session, running, sft_sample
from together import APIConnectionError
from together.post_training import SessionClient

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
FAST = 0.05
LORA = {"rank": 4, "seed": 5}
ADAM = {"learning_rate": 2e-2}
TOKENS = [1, 40, 41, 42, 50, 60, 70, 80, 33, 34]
PROMPT = {"chunks": [{"encoded_text": {"tokens": TOKENS[:4]}}]}


def workers_of(pid: int) -> list[int]:
    """The server's worker processes: its children started by multiprocessing's spawn (not
    its resource tracker)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                found.append(int(child))
    return found


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has ended


def parent_of(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    return int(next(x for x in status.splitlines() if x.startswith("PPid:")).split()[1])


def killed_pending(pid: int) -> bool:
    """Whether SIGKILL is pending for `pid` (thread or process-wide pending mask)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True  # gone meanwhile
    masks = [int(x.split()[1], 16) for x in status.splitlines() if x[:6] in ("SigPnd", "ShdPnd")]
    return any(mask & (1 << (signal.SIGKILL - 1)) for mask in masks)


def scored(session: SessionClient) -> list[float]:
    result = session.trainer.forward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
    return result.loss_fn_outputs[0].tensors["logprobs"].data


def train(session: SessionClient, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = session.trainer.forward_backward(
            samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST
        )
        losses.append(fb.metrics["loss:sum"])
        session.trainer.optim_step(adam_params=ADAM, interval=FAST)
    return losses


def loop(session: SessionClient) -> tuple:
    losses = train(session, 2)
    session.trainer.weights_sync(interval=FAST)
    sample = session.generator.sample(
        PROMPT, num_samples=2, sampling_params={"max_tokens": 6, "seed": 9}, interval=FAST
    )
    return losses, [list(s.tokens) for s in sample.sequences], scored(session)


@pytest.fixture
def process_server(tmp_path):
    proc = ServerProcess.started(tmp_path, "--poll-hold-seconds", "0", "--workers", "process")
    yield proc
    proc.stop()


def test_a_loop_through_worker_processes_equals_the_in_thread_engine(process_server, tmp_path):
    _, session = open_session(process_server.base_url, lora_config=LORA)
    through_processes = loop(session)
    (worker,) = workers_of(process_server.process.pid)

    (tmp_path / "thread").mkdir()
    in_thread = ServerProcess.started(tmp_path / "thread", "--poll-hold-seconds", "0")
    try:
        _, twin = open_session(in_thread.base_url, lora_config=LORA)
        assert loop(twin) == through_processes
    finally:
        in_thread.stop()

    process_server.stop()
    assert not alive(worker)  # shutdown stopped it


def test_a_killed_worker_fails_its_operation_and_the_session_carries_on(process_server):
    server = process_server
    _, session = open_session(server.base_url, lora_config=LORA)
    train(session, 2)
    before = scored(session)
    (worker,) = workers_of(server.process.pid)

    os.kill(worker, signal.SIGKILL)
    with pytest.raises(Exception) as info:
        session.trainer.forward_backward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
    message = str(info.value)
    assert "INTERNAL_ERROR" in message or "internal" in message.lower(), message
    assert f"pid {worker}) was killed by signal 9" in message

    assert server.process.poll() is None  # the API process lives on
    (restarted,) = workers_of(server.process.pid)
    assert restarted != worker
    assert session.retrieve().status == "TRAINING_SESSION_STATUS_RUNNING"
    assert scored(session) == before  # the state of the last completed operation
    after = train(session, 1)

    _, twin = open_session(server.base_url, lora_config=LORA)
    train(twin, 2)
    assert train(twin, 1) == after
    assert scored(twin) == scored(session)


def test_a_worker_does_not_outlive_a_killed_server(process_server):
    """Killed mid forward-backward (a long one, with no call back to the API process between
    its steps), the API process takes its worker with it (PR_SET_PDEATHSIG): a restarted
    server's new worker never shares the machine with an orphan still computing."""
    server = process_server
    _, session = open_session(server.base_url, lora_config=LORA)
    tokens = [(i * 7) % 90 + 5 for i in range(500)]

    def doomed() -> None:  # its SDK call fails once the server is gone, as it should
        with contextlib.suppress(APIConnectionError):
            session.trainer.forward_backward(
                samples=[sft_sample(tokens, 2)] * 256, loss=CE, interval=FAST
            )

    threading.Thread(target=doomed, daemon=True).start()
    while running(server.base_url, "forward-backward") < 1:
        time.sleep(0.02)
    (worker,) = workers_of(server.process.pid)
    server_pid = server.process.pid
    server.stop(kill=True)
    # No clock: once the server has died the worker is reparented at once; from then on it
    # is either gone or has SIGKILL pending (the kernel sends PR_SET_PDEATHSIG as it
    # reparents). An orphan left computing would be alive with no kill pending.
    while alive(worker) and parent_of(worker) == server_pid:
        time.sleep(0.01)
    assert not alive(worker) or killed_pending(worker)
