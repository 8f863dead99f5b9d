"""bench/scale_out.py runs on one repetition and prints its three tables: throughput per
generator layout, weights-sync latency for a LoRA adapter and a full-weight session over each
transport, and the boundary's cost for a small sample. A smoke test of the script, not of its
numbers."""

from __future__ import annotations

import re

import pytest
from helpers import run_bench


@pytest.mark.slow
def test_scale_out_bench_prints_every_table():
    out = run_bench(
        "scale_out.py", "--reps", "1", "--requests", "2", "--prompts", "1", "--tokens", "4"
    )
    for layout in ("inline", "1 replica", "2 replicas"):
        match = re.search(rf"^{layout} +(\d+\.\d+) +(\d+) +(\d+\.\d\d) +(\d+\.\d\d)$", out, re.M)
        assert match and float(match.group(1)) > 0, out
    for session in ("LoRA r32", "full weight"):
        for transport in ("broadcast", "pipe"):
            assert re.search(rf"^{session} +{transport} +\d+ +\d+\.\d\d", out, re.M), out
    # The default transport's bytes all crossed in broadcasts; the pipe's in none.
    assert re.search(r"^broadcast deliveries: Delivery\(broadcast=[1-9]\d*, piped=0,", out, re.M)
    assert re.search(r"^pipe deliveries: Delivery\(broadcast=0, piped=[1-9]", out, re.M), out
    assert re.search(r"^inline \d+\.\d\d  replica \d+\.\d\d  added -?\d+\.\d\d$", out, re.M), out
    assert "OMP_NUM_THREADS=1 torch threads=1" in out, out
