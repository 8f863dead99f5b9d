"""bench/closed_loop.py runs end to end on its smoke settings: it states its threads, prints a
row per agent count with both ways and their ratios (and, with --prefill-apart, joining with
each join prefilled apart; with --static, the layouts each way made), finds that the ways
returned the same tokens for every operation, and prints JSON of every number.

A smoke test of the script, not of its numbers: nothing here asserts on wall-clock times.
"""

from __future__ import annotations

import json
import re

import pytest
from helpers import run_bench


@pytest.mark.slow
def test_closed_loop_quick_run_prints_both_ways_the_same_tokens_and_json():
    out = run_bench("closed_loop.py", "--quick", "--prefill-apart")
    assert "OMP_NUM_THREADS=1, torch threads 1," in out, out
    row = (
        r"^  3 agents x 2 turns \(2-8 new tokens, \d+ per op\): while all run +\d+\.\d\d -> +"
        r"\d+\.\d\d ops/s \(\d+\.\d\dx\), tokens/s \d+\.\d\dx; whole run \d+\.\d\dx; latency"
        r" median \d+ -> \d+ ms; same tokens: yes$"
    )
    assert re.search(row, out, re.M), out
    apart = (
        r"^    prefill inside the decode pass / apart: ops/s +\d+\.\d\d -> +\d+\.\d\d"
        r" \(\d+\.\d\dx\), whole run \d+\.\d\dx, latency median \d+ -> \d+ ms; same tokens"
        r" 6 of 6 ops$"
    )
    assert re.search(apart, out, re.M), out
    blocks = (
        r"^    decode blocks whole -> joining \d+ -> \d+ \(\d+\.\d\dx\) of \d+\.\d -> \d+\.\d"
        r" rows, \d+\.\d -> \d+\.\d ms a block \(\d+\.\d\dx\)$"
    )
    assert re.search(blocks, out, re.M), out
    results = json.loads(out.strip().splitlines()[-1])
    assert set(results) == {"tiny"}
    (found,) = results["tiny"]["rows"]
    assert found["agents"] == 3 and found["turns"] == 2 and found["same_tokens"] is True
    assert 1 <= found["tokens_per_op"] <= 8  # EOS may end a row before its max_tokens
    for key in ("ops_s", "tokens_s", "whole_run_ops_s"):
        ratio = found[f"joining_{key}"] / found[f"whole_{key}"]
        assert found[f"joining_over_whole_{key}"] == pytest.approx(ratio, rel=1e-12), key
        ratio = found[f"joining_{key}"] / found[f"apart_{key}"]
        assert found[f"joining_over_apart_{key}"] == pytest.approx(ratio, rel=1e-12), key
    # Every operation's first token and every later one come from sampler.Decoding blocks:
    # each way ran some, over at most the agents' rows.
    for way in ("whole", "joining", "apart"):
        assert found[f"{way}_blocks"] >= 1 and 0 < found[f"{way}_rows_per_block"] <= 3, way


@pytest.mark.slow
def test_closed_loop_on_static_passes_counts_the_layouts_each_way_makes():
    """--static: the GPU default's decode passes (eager here), joins into padding rows against
    joins that always append; every way counts its layouts (on CUDA, graph captures)."""
    out = run_bench("closed_loop.py", "--quick", "--static")
    assert "decode blocks of 1, static passes," in out, out
    layouts = (
        r"^    static layouts made \(on CUDA: graph captures\) whole \d+, joining \d+, joins"
        r" appending \d+; eager prefill passes whole \d+, joining \d+ \(\+ \d+ through prefill"
        r" steps\), appending \d+; joining / appending: ops/s \d+\.\d\dx, ms a block"
        r" \d+\.\d\dx; same tokens 6 of 6 ops$"
    )
    assert re.search(layouts, out, re.M), out
    (found,) = json.loads(out.strip().splitlines()[-1])["tiny"]["rows"]
    assert found["same_tokens"] is True
    # Each way made a layout at least for its first batch; appending joins make one per join.
    assert 1 <= found["joining_layouts"] <= found["append_layouts"], found
    assert found["whole_layouts"] >= 1
    # Joins beside a running batch prefill through steps; appending, each prefills eagerly.
    assert found["joining_prefill_steps"] >= 1 and found["append_prefill_steps"] == 0, found
    assert found["joining_prefills"] < found["append_prefills"], found
