"""bench/context_budget.py: the bytes per token and the longest context of an 8B model on one
80 GB GPU, from posttrain's memory estimate, are the ones docs/scaling.md states (the estimate
is arithmetic on shapes, so the table is exact, and a change to the estimate shows up here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_bench

SCALING = Path(__file__).resolve().parents[2] / "docs" / "scaling.md"


@pytest.mark.slow
def test_the_8b_context_budget_is_the_one_the_docs_state():
    out = run_bench("context_budget.py")
    rows = [line for line in out.splitlines() if line.startswith(("LoRA", "full"))]
    assert len(rows) == 6, out
    documented = SCALING.read_text()
    for line in rows:
        assert line in documented, f"docs/scaling.md lacks the row:\n{line}"
