"""bench/sdk_loops.py runs end to end on its smoke settings and prints every ratio line.

A smoke test of the script, not of its numbers: nothing here asserts on wall-clock times.
"""

from __future__ import annotations

import re

import pytest
from helpers import run_bench

LOOPS = ("sft", "grpo", "shim-rl", "dpo")


@pytest.mark.slow
def test_sdk_loops_quick_run_prints_a_ratio_for_every_loop_and_the_fanout():
    out = run_bench("sdk_loops.py", "--quick")
    assert "OMP_NUM_THREADS=1" in out, out
    for loop in LOOPS:
        pattern = rf"^tiny {re.escape(loop)} +default .* ratio default/10ms \d+\.\d+x"
        assert re.search(pattern, out, re.MULTILINE), out
    fanout = re.findall(r"^tiny fanout +(default|10ms) .* ratio 8x1/1x8 \d+\.\d+x", out, re.M)
    assert fanout == ["default", "10ms"], out
    assert re.search(r"engine busy time from posttrain_\w+", out), out
