"""bench/stream.py runs end to end on its smoke settings: it states its threads, prints a row
per arrival pattern, the late-arrival and forward-backward lines, a row per agent count, and
JSON of every number.

A smoke test of the script, not of its numbers: nothing here asserts on wall-clock times.
"""

from __future__ import annotations

import json
import re

import pytest
from helpers import run_bench

from posttrain.config import BUILTIN_MODELS
from posttrain.engine.hosts.threads import intra_op_threads


@pytest.mark.slow
def test_stream_quick_run_prints_every_section_and_json():
    out = run_bench("stream.py", "--quick")
    assert "OMP_NUM_THREADS=1, usable cores" in out, out
    builtin = intra_op_threads(None, model_dirs=BUILTIN_MODELS.values())
    assert f"server intra-op threads {builtin} (built-ins), " in out, out
    for pattern in ("steady", "burst"):
        row = rf"^ *{pattern} load 2\.00x \( *\d+\.\d\d ops/s offered\): +\d+\.\d\d ops/s completed"
        assert re.search(row, out, re.M), out
    assert re.search(r"^late one-sample op: \d+\.\d\d s \(long op's remaining", out, re.M), out
    assert re.search(r"^forward-backward of another session: \d+\.\d\d s during", out, re.M), out
    agents_row = (
        r"^  2 agents x 2 turns \(2-6 new tokens each, closed loop\): +\d+\.\d\d ops/s,"
        r" +\d+\.\d tokens/s while all run \(\d+\.\d\d ops/s over the whole run;"
    )
    assert re.search(agents_row, out, re.M), out
    results = json.loads(out.strip().splitlines()[-1])
    assert set(results) == {"tiny"}
    stream, long = results["tiny"]["stream"], results["tiny"]["long"]
    agents = results["tiny"]["agents"]
    assert [(r["pattern"], r["load"]) for r in stream["rows"]] == [
        ("steady", 2.0),
        ("burst", 2.0),
    ]
    for row in stream["rows"]:
        assert row["completed_ops_s"] > 0 and row["ideal_ops_s"] > 0
        assert 0 < row["latency_median_s"] <= row["latency_p90_s"]
        assert row["offered_ops_s"] == pytest.approx(2.0 / stream["solo_op_s"])
        assert 1 <= row["tokens_per_op"] <= 4  # --quick: up to 4 new tokens, EOS may end one
    assert stream["batched_ops_s"] > 0
    for key in ("long_solo_s", "decode_block_s", "late_latency_s", "fb_solo_s", "fb_during_s"):
        assert long[key] > 0, key
    assert long["late_while_running"] in (0, 1)  # of one repetition
    assert agents["agent_tokens"] == [2, 6]
    [row] = agents["rows"]
    assert (row["agents"], row["turns"]) == (2, 2)
    assert row["completed_ops_s"] > 0
    assert row["saturated_ops_s"] > 0 and row["saturated_tokens_s"] > 0
    assert 0 < row["latency_median_s"] <= row["latency_p90_s"]
    assert 1 <= row["tokens_per_op"] <= 6  # each asks for 2 to 6 new tokens, EOS may end one
