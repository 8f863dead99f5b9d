"""bench/models.py runs end to end on its smoke settings: a row for every model family with
positive throughputs and ratios to Llama, the Qwen3-MoE routed-expert replay row included.

A smoke test of the script, not of its numbers: nothing here asserts on wall-clock times.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from helpers import run_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "model"))
import families  # noqa: E402

NUMBER = r"(\d+\.\d+)"
ROW = re.compile(
    rf"^(\S+) +\d+\.\d+M +{NUMBER} +{NUMBER}x \({NUMBER}x\) +{NUMBER} +{NUMBER}x \({NUMBER}x\)"
    rf" +{NUMBER}$",
    re.MULTILINE,
)


@pytest.mark.slow
def test_models_quick_run_prints_positive_throughputs_for_every_family():
    out = run_bench("models.py", "--quick")
    assert "OMP_NUM_THREADS=1" in out, out
    rows = {match[0]: [float(v) for v in match[1:]] for match in ROW.findall(out)}
    assert set(rows) == {*families.FAMILIES, "qwen3_moe+replay"}, out
    assert all(value > 0 for values in rows.values() for value in values), out
    assert rows["llama"][1] == rows["llama"][4] == 1.0, out  # the baseline's own ratios
