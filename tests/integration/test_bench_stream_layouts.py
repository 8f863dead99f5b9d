"""bench/stream_layouts.py runs end to end on its smoke settings: it states its threads and
settings, prints each way's layouts, prefills, blocks and estimate with the ratios, finds that
every way returned the same tokens, and prints JSON of every number.

A smoke test of the script, not of its numbers: nothing here asserts on wall-clock times. The
counts are the CPU's and the machine's alike (arrivals are counted in blocks), so their order
is asserted: placeholders make the fewest layouts, appending joins the most (one per join)."""

from __future__ import annotations

import json
import re

import pytest
from helpers import run_bench


@pytest.mark.slow
def test_stream_layouts_quick_run_counts_each_ways_layouts_and_prints_json():
    out = run_bench("stream_layouts.py", "--quick")
    assert "OMP_NUM_THREADS=1, torch threads 1," in out, out
    assert "tiny, static passes, blocks of 2, 8 prompt tokens, 4-12 new, 1 LoRA session(s)" in out
    for way in ("placeholders", "padding", "append"):
        line = (
            rf"^ +{way}: +\d+ layouts, +\d+ eager prefills, +\d+ step runs \(\d+ made\), +\d+"
            rf" blocks of \d+\.\d rows; CPU \d+\.\d\d s; H200 estimate \d+\.\d s"
        )
        assert re.search(line, out, re.M), (way, out)
    assert re.search(r"^  placeholders / append: H200 estimate \d+\.\d\dx the time", out, re.M)
    report = json.loads(out.strip().splitlines()[-1])
    (row,) = report["rows"]
    ways = {way: row[way] for way in ("placeholders", "padding", "append")}
    assert row["ops"] == 6 and row["per_block"] == 1
    assert ways["padding"]["same_tokens_ops"] == ways["append"]["same_tokens_ops"] == 6
    layouts = [ways[w]["layouts"] for w in ("placeholders", "padding", "append")]
    assert layouts == sorted(layouts) and layouts[0] < layouts[2], layouts
    assert ways["append"]["layouts"] == 6  # one per operation: every join appends
    assert ways["append"]["prefill_steps"] == 0 and ways["placeholders"]["prefill_steps"] == 5
    for way, found in ways.items():
        estimate = (
            found["blocks"] * 0.104
            + (found["layouts"] + found["prefill_steps_made"]) * 0.176
            + found["prefills"] * 0.088
            + found["prefill_steps"] * 0.015
        )
        assert found["h200_estimate_s"] == pytest.approx(estimate), way
    ratio = ways["placeholders"]["h200_estimate_s"] / ways["append"]["h200_estimate_s"]
    assert row["placeholders_over_append_h200_estimate_s"] == pytest.approx(ratio, rel=1e-12)
