"""`posttrain serve` as a child process on a free port, for the demo and the examples."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/healthz", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def local_server(
    *, data_dir: Path | None = None, log_path: Path | None = None, extra_args: tuple[str, ...] = ()
) -> Iterator[str]:
    """Start `posttrain serve` with the built-in model; yield its base URL; stop it on exit.

    The store goes to `data_dir` (a temporary directory when None) and the server's output to
    `log_path` (discarded when None), so it never interleaves with the caller's output."""
    with tempfile.TemporaryDirectory(prefix="posttrain-") as scratch, ExitStack() as stack:
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "posttrain",
            "serve",
            "--port",
            str(port),
            "--data-dir",
            str(data_dir or Path(scratch) / "data"),
            "--log-level",
            "warning",
            *extra_args,
        ]
        log = stack.enter_context(log_path.open("ab")) if log_path else subprocess.DEVNULL
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        base_url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not is_healthy(base_url):
                if process.poll() is not None:
                    where = f"; its log is {log_path}" if log_path else ""
                    raise RuntimeError(f"posttrain serve exited with {process.returncode}{where}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"posttrain serve did not answer within {START_TIMEOUT_S}s")
                time.sleep(0.1)
            yield base_url
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
