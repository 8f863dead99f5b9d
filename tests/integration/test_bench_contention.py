"""bench/contention.py runs end to end on its smoke settings, states the server's threads and
prints the busy/quiet ratios.

A smoke test of the script, not of its numbers: nothing here asserts on wall-clock times.
"""

from __future__ import annotations

import re

import pytest
from helpers import run_bench

from posttrain.config import BUILTIN_MODELS
from posttrain.engine.hosts.threads import intra_op_threads


@pytest.mark.slow
def test_contention_quick_run_states_threads_and_prints_both_ratios():
    out = run_bench("contention.py", "--quick")
    builtin = intra_op_threads(None, model_dirs=BUILTIN_MODELS.values())
    assert f"server intra-op threads {builtin} (its default)" in out, out
    assert re.search(r"^rep 0: warm-up \d+\.\d+ steps/s quiet, \d+\.\d+ busy;", out, re.M), out
    ratios = r"^ratio busy/quiet: warm-up step \d+\.\d\dx, GRPO step \d+\.\d\dx$"
    assert re.search(ratios, out, re.M), out
