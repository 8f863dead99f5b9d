"""A real `posttrain serve`: it introduces itself once ready (URL, dashboard, data directory,
models), keeps uvicorn's start lines and the per-request log off unless `--access-log`, logs
no line per operation or engine pass at info, refuses to listen beyond loopback without an API
key unless told `--insecure-no-auth`, and a SIGINT or SIGTERM, even mid-operation, stops it
with one line, no traceback, and exit status 130 or 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import httpx
import pytest
from conftest import free_port
from helpers import API_KEY, open_session, sft_sample

from posttrain.config import BUILTIN_MODELS

# Seconds of sampling on the CPU: the stop arrives while the engine is inside a torch pass.
HEAVY = {
    "model_inputs": [{"chunks": [{"encoded_text": {"tokens": [3, 4, 5, 6]}}]}],
    "num_samples": 64,
    "sampling_params": {"max_tokens": 480, "temperature": 1.0, "seed": 1},
}


class Serve:
    """`posttrain serve` with its output read line by line as it comes."""

    def __init__(self, data_dir: Path, *flags: str) -> None:
        self.port = free_port()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "posttrain", "serve", "--port", str(self.port)]
        command += ["--data-dir", str(data_dir), "--device", "cpu", *flags]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            if line.startswith("posttrain: serving"):
                self.ready.set()
        self.ready.set()  # exited: whoever waits sees the output

    def wait_ready(self) -> str:
        assert self.ready.wait(timeout=180), self.output()
        intro = [line for line in self.lines if line.startswith("posttrain: serving")]
        assert intro, self.output()
        return intro[0].rstrip("\n")

    def stop(self, sig: signal.Signals) -> int:
        self.process.send_signal(sig)
        code = self.process.wait(timeout=120)
        self.reader.join(timeout=10)
        return code

    def output(self) -> str:
        return "".join(self.lines)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_introduces_itself_and_stops_cleanly_mid_operation(tmp_path, sig):
    server = Serve(tmp_path / "data")
    try:
        intro = server.wait_ready()
        url = f"http://127.0.0.1:{server.port}"
        assert intro == (
            f"posttrain: serving {', '.join(BUILTIN_MODELS)} at {url} (the SDK's base_url;"
            f" dashboard {url}/; data in {tmp_path / 'data'})"
        )
        _, session = open_session(url)
        with httpx.Client(base_url=url, timeout=60) as client:
            answer = client.post(
                f"/v1/rl/training-sessions/{session.session_id}/operations/sample",
                json=HEAVY,
                headers={
                    "Authorization": f"Bearer {API_KEY}",
                    "Idempotency-Key": str(uuid.uuid4()),
                },
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["status"] != "TRAINING_OPERATION_STATUS_COMPLETED"
        code = server.stop(sig)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    output = server.output()
    assert code == {signal.SIGINT: 130, signal.SIGTERM: 0}[sig], output
    assert output.endswith(f"posttrain: stopped ({sig.name})\n"), output
    for noise in ("Traceback", "terminate called", "KeyboardInterrupt", "Uvicorn running"):
        assert noise not in output, output
    # No request was logged, nor uvicorn's start lines: the introduction is the first line.
    assert output.startswith("posttrain: serving"), output
    assert "/healthz" not in output and "HTTP/1.1" not in output, output


def test_access_log_shows_each_request(tmp_path):
    server = Serve(tmp_path / "data", "--access-log")
    try:
        server.wait_ready()
        assert httpx.get(f"http://127.0.0.1:{server.port}/healthz").status_code == 200
        code = server.stop(signal.SIGTERM)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    output = server.output()
    assert code == 0, output
    assert '"GET /healthz HTTP/1.1" 200' in output, output
    assert "Application startup complete" in output, output


def test_a_training_loop_logs_nothing_at_info_after_the_introduction(tmp_path):
    server = Serve(tmp_path / "data", "--log-level", "info")
    try:
        server.wait_ready()
        _, session = open_session(f"http://127.0.0.1:{server.port}", lora_config={"rank": 4})
        samples = [sft_sample([3, 4, 5, 6, 7, 8], 3)]
        for _ in range(10):  # 20 operations
            session.trainer.forward_backward(
                samples=samples, loss={"type": "LOSS_TYPE_CROSS_ENTROPY"}
            )
            session.trainer.optim_step(adam_params={"learning_rate": 1e-3})
        code = server.stop(signal.SIGTERM)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    output = server.output()
    assert code == 0, output
    lines = output.splitlines()
    assert lines[0].startswith("posttrain: serving") and lines[-1] == "posttrain: stopped (SIGTERM)"
    assert lines[1:-1] == [], output


def test_listening_beyond_loopback_without_a_key_is_refused_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSTTRAIN_")}
    done = subprocess.run(
        [sys.executable, "-m", "posttrain", "serve", "--host", "0.0.0.0"]
        + ["--port", str(free_port()), "--data-dir", str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 2, done
    assert done.stdout == ""
    assert done.stderr.startswith("posttrain: --host 0.0.0.0 listens beyond loopback"), done
    assert "--api-key" in done.stderr and "--insecure-no-auth" in done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_insecure_no_auth_serves_beyond_loopback_without_a_key(tmp_path):
    # Loopback without a key is what every other server of the tests runs.
    server = Serve(tmp_path / "data", "--host", "0.0.0.0", "--insecure-no-auth")
    try:
        assert server.wait_ready().startswith("posttrain: serving")
        assert httpx.get(f"http://127.0.0.1:{server.port}/healthz").status_code == 200
        code = server.stop(signal.SIGTERM)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    assert code == 0, server.output()
