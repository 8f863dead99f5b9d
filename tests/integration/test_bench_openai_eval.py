"""bench/openai_eval.py runs end to end on its smoke settings: lm-eval and the SDK score the
same prompts while a session trains beside them, and both ratios are printed.

A smoke test of the script, not of its numbers: nothing here asserts on wall-clock times.
"""

from __future__ import annotations

import re

import pytest
from helpers import run_bench


@pytest.mark.slow
def test_openai_eval_quick_run_prints_both_paths_and_both_ratios():
    out = run_bench("openai_eval.py", "--quick")
    assert "OMP_NUM_THREADS=1" in out, out
    assert re.search(r"server intra-op threads \d+, OpenMP waits [\w ]+; load average", out), out
    assert "task loglikelihood (echo, max_tokens 1, logprobs 1, temperature 0): 8 prompts" in out
    rep = (
        r"^rep 0: openai \d+\.\d prompts/s \(window \d+\.\d\d s, 8 operations, lm-eval wall"
        r" \d+\.\d s, acc \d\.\d{3}\), sdk \d+\.\d prompts/s \(window \d+\.\d\d s, 8 operations,"
        r" acc \d\.\d{3}\);"
        r" training step \d+\.\d{3} s quiet, \d+\.\d{3} s beside lm-eval \(\d+ steps\),"
        r" \d+\.\d{3} s beside sdk \(\d+ steps\)$"
    )
    assert re.search(rep, out, re.M), out
    assert re.search(r"^ratio sdk/openai prompts/s: \d+\.\d\dx \(target <= 1\.20x\)$", out, re.M)
    ratio = r"^ratio training step beside lm-eval/quiet: \d+\.\d\dx \(target <= 1\.50x\)$"
    assert re.search(ratio, out, re.M), out
    assert "accuracy: openai and sdk agree" in out, out
