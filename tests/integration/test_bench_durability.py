"""bench/durability.py runs on its smoke settings and prints the on/off table for every
operation of a step. A smoke test of the script, not of its numbers (no wall-clock asserts)."""

from __future__ import annotations

import re

import pytest
from helpers import run_bench


@pytest.mark.slow
def test_durability_quick_run_prints_every_operation():
    out = run_bench("durability.py", "--quick")
    for operation in ("forward-backward", "optim-step", "weights-sync", "whole step"):
        match = re.search(rf"^{operation} +(\d+\.\d) +(\d+\.\d) +(\d+\.\d\d)$", out, re.M)
        assert match and all(float(v) > 0 for v in match.groups()), out
    assert "state on disk" in out, out
