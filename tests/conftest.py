"""Shared fixtures: the built-in tiny model, and a real posttrain server in a subprocess."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from posttrain.engine.hosts.threads import bounded_openmp_spins

# This process computes references and runs in-process engines beside the servers it starts:
# its idle OpenMP threads spin briefly, then sleep, as theirs do (engine/hosts/threads.py).
bounded_openmp_spins()

import httpx  # noqa: E402
import pytest  # noqa: E402
from tinker_env import tinker_python  # noqa: E402, F401  (the fixture, for every test module)

API_KEY = "test-key"
BASE_MODEL = "posttrain/tiny-qwen3"


@pytest.fixture(autouse=True, scope="session")
def engine_thread_count() -> None:
    """Forward passes this process computes as references (a server's logprobs compared to
    1e-6) run on the intra-op thread count every engine process uses: another count sums in
    another order and moves float32 results by about 1e-6 (engine/hosts/threads.py)."""
    from posttrain.config import BUILTIN_MODELS
    from posttrain.engine.hosts.threads import use_intra_op_threads

    use_intra_op_threads(None, model_dirs=BUILTIN_MODELS.values())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """A `posttrain serve` subprocess on a free port, restartable over the same data dir."""

    data_dir: Path
    log_path: Path
    extra_args: tuple[str, ...] = ()
    # RLIMIT_AS of the server process (bytes); None: no address-space limit.
    address_space_bytes: int | None = None
    process: subprocess.Popen | None = None
    port: int = 0

    @classmethod
    def started(cls, directory: Path, *extra_args: str) -> ServerProcess:
        """A server over directory/data, logging to directory/server.log, already running."""
        proc = cls(directory / "data", directory / "server.log", tuple(extra_args))
        proc.start()
        return proc

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, keep_port: bool = False) -> None:
        """Start (or restart) the server; `keep_port` reuses the last port, so clients bound
        to its URL carry on across a restart."""
        if not (keep_port and self.port):
            self.port = free_port()
        log = self.log_path.open("ab")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "posttrain",
                "serve",
                "--port",
                str(self.port),
                "--data-dir",
                str(self.data_dir),
                "--device",
                "cpu",
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=self._limit_address_space if self.address_space_bytes else None,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"server did not start:\n{self.log()}")

    def _limit_address_space(self) -> None:
        """Runs in the child before exec: an allocation past the limit fails (ENOMEM) instead
        of growing until the kernel's OOM killer picks a process."""
        limit = self.address_space_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def stop(self, *, kill: bool = False) -> None:
        if self.process is None:
            return
        if kill:
            self.process.kill()
        else:
            self.process.terminate()
        self.process.wait(timeout=30)
        self.process = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@pytest.fixture
def server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path / "data", tmp_path / "server.log")
    proc.start()
    yield proc
    proc.stop()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(f"\n----- server log -----\n{proc.log()[-20000:]}")


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for a whole test module (tests that restart or need isolation use `server`)."""
    directory = tmp_path_factory.mktemp("shared")
    proc = ServerProcess(directory / "data", directory / "server.log")
    proc.start()
    yield proc
    proc.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
