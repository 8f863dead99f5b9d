"""bench/process_boundary.py runs on one repetition and prints a row per operation with both
engines' medians. A smoke test of the script, not of its numbers (no wall-clock asserts)."""

from __future__ import annotations

import re

import pytest
from helpers import run_bench


@pytest.mark.slow
def test_process_boundary_bench_prints_every_operation():
    out = run_bench("process_boundary.py", "--reps", "1", "--sample-tokens", "4")
    operations = ("forward-backward, 8 tokens", "optim-step", "publish", "sample, 4 tokens")
    for operation in (*operations, "forward-backward, 32 x 128 tokens"):
        number = r"(-?\d+\.\d\d)"
        match = re.search(
            rf"^{re.escape(operation)} +{number} +{number} +{number} +{number}$", out, re.M
        )
        assert match and float(match.group(1)) > 0 and float(match.group(2)) > 0, out
    assert "worker process start and model load" in out, out
