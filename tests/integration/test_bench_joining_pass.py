"""bench/joining_pass.py runs end to end on its smoke settings: it
states its threads, prints a row per setting with both ways, and its operation counts
(machine-independent) pin what joining_pass.py is for: a block whose joins ride in its first
decode pass dispatches fewer aten operations than one whose joins ran a prefill pass apart.

A smoke test of the script: nothing here asserts on wall-clock times."""

from __future__ import annotations

import json
import re

import pytest
from helpers import run_bench


@pytest.mark.slow
def test_a_join_inside_the_decode_pass_dispatches_fewer_operations():
    out = run_bench("joining_pass.py", "--quick")
    assert "OMP_NUM_THREADS=1, torch threads 1," in out and "dynamic passes" in out, out
    line = (
        r"^  2 join\(s\) of 8 prompt tokens a block of {} pass\(es\): +\d+\.\d -> +\d+\.\d ms a"
        r" block \(\d+\.\d\dx\), aten operations \d+ -> \d+ \(\d+\.\d\dx\)$"
    )
    for steps in (1, 2):
        assert re.search(line.format(steps), out, re.M), out
    rows = json.loads(out.strip().splitlines()[-1])["tiny"]
    assert [row["block_steps"] for row in rows] == [1, 2]
    for row in rows:
        assert 0 < row["in_pass_block_ops"] < row["apart_block_ops"], row
        ratio = row["in_pass_block_ops"] / row["apart_block_ops"]
        assert row["in_pass_over_apart_ops"] == pytest.approx(ratio, rel=1e-12)
