"""bench/side_by_side.py runs end to end on its smoke settings and prints a ratio for every row.

A smoke test of the script, not of its numbers: nothing here asserts on wall-clock times.
"""

from __future__ import annotations

import re

import pytest
from helpers import run_bench

ROWS = ("fixed-frozen", "fixed-head", "variable-rl", "sampling")


@pytest.mark.slow
def test_side_by_side_quick_run_prints_a_ratio_for_every_row():
    out = run_bench("side_by_side.py", "--quick")
    assert "OMP_NUM_THREADS=1" in out, out
    medians = out.split("\nmedians")[1]
    for row in ROWS:
        pattern = rf"^tiny +{row} +posttrain +\d+ tokens/s +peft +\d+ tokens/s +ratio \d+\.\d+x"
        assert re.search(pattern, medians, re.MULTILINE), out
