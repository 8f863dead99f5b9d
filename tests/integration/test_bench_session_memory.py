"""bench/session_memory.py runs on the built-in model and prints the exact byte counts of
docs/benchmarks.md: per session, and for the multi-LoRA shared pass (the one place session
memory is measured).

A smoke test of the script; tensor bytes are exact, so its numbers are asserted too.
"""

from __future__ import annotations

import pytest
from helpers import run_bench


@pytest.mark.slow
def test_session_memory_prints_per_session_bytes_and_the_shared_pass_total():
    out = run_bench("session_memory.py", "--ranks", "8", "--sessions", "8")
    assert "base weights 3.102 MiB (3252736 bytes)" in out, out
    assert "LoRA rank 8           0.304M      0.304M      0.608M      1.215M" in out, out
    assert "full weights          3.102M      3.102M      6.204M     12.408M" in out, out
    assert "all engine tensors             12.826 MiB" in out, out
    assert "base + n x (adapter + copy + AdamW) x 1.2    14.770 MiB: within" in out, out
