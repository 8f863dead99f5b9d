"""`posttrain serve` listens before it imports torch and restores sessions (api/listen.py): a
client that connects while the server is still starting is queued and answered, not refused,
so an SDK retrying across a restart has the whole start-up inside one request's timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from conftest import free_port


def test_a_client_that_connects_during_start_up_is_answered(tmp_path):
    port = free_port()
    log_path = tmp_path / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "posttrain", "serve", "--port", str(port)]
    command += ["--data-dir", str(tmp_path / "data"), "--device", "cpu"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        while True:
            assert process.poll() is None, log_path.read_text()
            try:
                client = socket.create_connection(("127.0.0.1", port), timeout=120)
                break
            except ConnectionRefusedError:
                time.sleep(0.01)
        # The server introduces itself once the app's start-up (imports, restore) is done;
        # before this change the port opened only after it, so a connection could never
        # precede it.
        assert "posttrain: serving" not in log_path.read_text()
        with client:
            client.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := client.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_a_port_already_taken_is_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "posttrain", "serve", "--port", str(port)]
            + ["--data-dir", str(tmp_path / "data")],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode != 0
    assert f"127.0.0.1:{port} is in use; give another --port" in done.stderr, done.stderr
