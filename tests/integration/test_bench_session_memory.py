"""bench/session_memory.py runs on the built-in model and prints the exact byte counts of
docs/benchmarks.md: per session, and for the multi-LoRA shared pass (the one place session
memory is measured).

A smoke test of the script; tensor bytes are exact, so its numbers are asserted too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "session_memory.py"


@pytest.mark.slow
def test_session_memory_prints_per_session_bytes_and_the_shared_pass_total():
    # The script's own folder, not the checkout, is on its sys.path: point it at this checkout.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--ranks", "8", "--sessions", "8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    out = completed.stdout
    assert "base weights 3.102 MiB (3252736 bytes)" in out, out
    assert "LoRA rank 8           0.304M      0.304M      0.608M      1.215M" in out, out
    assert "full weights          3.102M      3.102M      6.204M     12.408M" in out, out
    assert "all engine tensors             12.826 MiB" in out, out
    assert "base + n x (adapter + copy + AdamW) x 1.2    14.770 MiB: within" in out, out
