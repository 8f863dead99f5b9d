"""`posttrain serve` as a child process on a free port, for the demo and the examples.

The child runs in a session of its own, so a Ctrl-C in the terminal reaches only its parent:
the parent decides when the server stops (after its clients have finished with it, or at once
on an interrupt: demo/command.py) instead of the server dying under a client that then retries
it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

START_TIMEOUT_S = 120
# How long a server told to stop (SIGTERM) may take to close before it is killed: at the end
# of a run it finishes what it was doing; on an interrupt the demo must be gone within seconds.
STOP_TIMEOUT_S = 30.0
INTERRUPTED_STOP_TIMEOUT_S = 1.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def is_healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/healthz", timeout=1) as response:
            status: int = response.status
            return status == 200
    except (urllib.error.URLError, OSError):
        return False


class LocalServer:
    """A started `posttrain serve` child: its URL, and a stop that never waits long."""

    def __init__(
        self, *, data_dir: Path | None, log_path: Path | None, extra_args: tuple[str, ...]
    ) -> None:
        self.log_path = log_path
        self._scratch = tempfile.mkdtemp(prefix="posttrain-")
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "posttrain",
            "serve",
            "--port",
            str(port),
            "--data-dir",
            str(data_dir or Path(self._scratch) / "data"),
            "--log-level",
            "warning",
            *extra_args,
        ]
        self._log: IO[bytes] | None = log_path.open("ab") if log_path else None
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.process = subprocess.Popen(
            command,
            stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.base_url = f"http://127.0.0.1:{port}"

    def wait_until_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not is_healthy(self.base_url):
            if self.process.poll() is not None:
                where = f"; its log is {self.log_path}" if self.log_path else ""
                raise RuntimeError(f"posttrain serve exited with {self.process.returncode}{where}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"posttrain serve did not answer within {START_TIMEOUT_S}s")
            time.sleep(0.1)

    def close(self, timeout_s: float) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout_s`; then remove the
        scratch directory. Safe to call twice."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
        shutil.rmtree(self._scratch, ignore_errors=True)


@contextmanager
def started_server(
    *, data_dir: Path | None = None, log_path: Path | None = None, extra_args: tuple[str, ...] = ()
) -> Iterator[LocalServer]:
    """Start `posttrain serve` with the built-in models; yield it once it answers; stop it on
    exit. The store goes to `data_dir` (a scratch directory when None) and the server's output
    to `log_path` (discarded when None), so it never interleaves with the caller's output."""
    server = LocalServer(data_dir=data_dir, log_path=log_path, extra_args=extra_args)
    try:
        server.wait_until_healthy()
        yield server
    finally:
        server.close(STOP_TIMEOUT_S)


@contextmanager
def local_server(
    *, data_dir: Path | None = None, log_path: Path | None = None, extra_args: tuple[str, ...] = ()
) -> Iterator[str]:
    """started_server, yielding only the base URL."""
    with started_server(data_dir=data_dir, log_path=log_path, extra_args=extra_args) as server:
        yield server.base_url
