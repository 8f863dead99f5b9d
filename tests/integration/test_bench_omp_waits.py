"""bench/omp_waits.py runs end to end on its smoke settings and prints every wait setting's
line.

A smoke test of the script, not of its numbers: nothing here asserts on wall-clock times.
"""

from __future__ import annotations

import re

import pytest
from helpers import run_bench


@pytest.mark.slow
def test_omp_waits_quick_run_prints_every_setting():
    out = run_bench("omp_waits.py", "--quick")
    for name in ("spinning", "spin 1000", "spin 10000", "passive"):
        line = rf"^{name} +forward-backward \d+\.\d+ s quiet, busy/quiet \d+\.\d\dx; decode"
        assert re.search(line, out, re.M), out
