"""bench/tinker_loops.py runs end to end on its smoke settings: both clients (the tinker 0.38
SDK on /api/v1, the Together SDK's tinker shim on /v1/rl) run both loops, and every summary
line parses.

A smoke test of the script, not of its numbers: nothing here asserts on wall-clock times.
"""

from __future__ import annotations

import re

import pytest
from helpers import run_bench

SUMMARY = re.compile(
    r"^tiny (?P<loop>sl|rl)  tinker (?P<tinker>\d+\.\d+) s/step  together (?P<together>\d+\.\d+)"
    r" s/step  ratio tinker/together (?P<ratio>\d+\.\d+)x \(paired \d+\.\d+x; target <= 1\.15\)"
    r"  engine busy (?P<busy>\d+)% tinker .* sampled tokens/step (?P<tinker_tokens>\d+) tinker,"
    r" (?P<together_tokens>\d+) together  try_again \d+$",
    re.MULTILINE,
)


@pytest.mark.slow
def test_tinker_loops_quick_run_times_both_clients_on_both_loops(tinker_python):
    out = run_bench("tinker_loops.py", "--quick", "--tinker-python", str(tinker_python))
    assert "OMP_NUM_THREADS=1" in out, out
    assert "tinker 0.38.0 runs" in out, out
    assert re.search(r"engine busy time from posttrain_worker_busy_seconds_total", out), out
    for loop in ("sl", "rl"):
        for client in ("tinker", "together"):
            assert re.search(rf"^  rep 1 {loop} {client} +\d+\.\d+ s/step", out, re.M), out
    lines = {m["loop"]: m for m in SUMMARY.finditer(out)}
    assert set(lines) == {"sl", "rl"}, out
    for match in lines.values():
        tinker, together = float(match["tinker"]), float(match["together"])
        assert tinker > 0 and together > 0
        # The ratio is of the unrounded medians, printed to 2 places; the medians are printed to
        # 3, so a fast step (0.045 s) moves the recomputed ratio by more than 1%: bound it by
        # the rounding of all three numbers.
        low = (tinker - 5e-4) / (together + 5e-4) - 5e-3
        high = (tinker + 5e-4) / (together - 5e-4) + 5e-3
        assert low <= float(match["ratio"]) <= high, match.group(0)
        assert 0 < int(match["busy"]) <= 100
    # The same work on both sides: sl samples nothing; rl samples 2 prompts x 2 samples x up to
    # 4 tokens on each (fewer where a sample ends at EOS).
    assert lines["sl"]["tinker_tokens"] == lines["sl"]["together_tokens"] == "0"
    for side in ("tinker_tokens", "together_tokens"):
        assert 0 < int(lines["rl"][side]) <= 16
