"""bench/gpu_check.py runs every step of its one GPU run as a CPU dry run (--small): the
report has every number the device run records, the sampler's logprobs equal the forward
pass's, and the fused shared-prefix attention equals the explicit matmuls.

A smoke test of the script, not of its numbers: nothing here asserts on wall-clock times."""

from __future__ import annotations

import json

import pytest
from helpers import run_bench

KEYS = {
    "sampler_vs_forward_max_abs_diff",
    "fused_attention_max_abs_diff_out",
    "fused_attention_max_abs_diff_lse",
    "fb_tokens_per_s",
    "fb_tflops_per_s",
    "mfu",
    "decode_step_ms",
    "decode_tokens_per_s",
    "decode_bytes_per_step",
    "sampler_tokens_per_s",
    "generate_tokens_per_s",
    "sampler_over_generate",
    "weights_sync_ms",
    "decode_graphs_tokens_per_s",
    "decode_static_eager_tokens_per_s",
    "decode_per_token_tokens_per_s",
}


@pytest.mark.slow
def test_gpu_check_dry_run_reports_every_number_and_exact_logprobs():
    out = run_bench("gpu_check.py", "--device", "cpu", "--small")
    report = json.loads(out.strip().splitlines()[-1])
    assert KEYS <= report.keys(), out
    assert report["device"] == "cpu" and report["dtype"] == "float32"
    assert report["sampler_vs_forward_max_abs_diff"] < 1e-5, out  # float32 on the CPU
    assert report["fused_attention_max_abs_diff_out"] < 1e-5, out
    assert report["fused_attention_max_abs_diff_lse"] < 1e-5, out
    assert report["mfu"] is None  # no peak FLOP/s known for a CPU
    positive = [k for k in KEYS if k.endswith(("per_s", "_ms", "per_step", "generate"))]
    assert all(report[k] > 0 for k in positive), out
    assert "target >= 40%" in out and "target >= 3x" in out, out
