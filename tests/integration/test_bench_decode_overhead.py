"""bench/decode_overhead.py runs on a small shape and reports the decode step against its
matmul floor; its operation counts (machine-independent) pin what issue 16 asked of the decode
loop: no host read (a device synchronisation on a GPU) in any decode pass, no per-row
tensor operations (the count does not grow with the rows), and one results transfer per block
of decode passes (per pass on the CPU's default blocks of one; per 8 in blocks of 8, with
dynamic or static-shape passes).

A smoke test of the script: nothing here asserts on wall-clock times."""

from __future__ import annotations

import json

import pytest
from helpers import run_bench


def report(prompts: int, samples: int, *extra: str) -> dict:
    out = run_bench(
        "decode_overhead.py",
        *("--prompts", str(prompts), "--samples", str(samples)),
        *("--prompt-tokens", "8", "--new-tokens", "14", "--reps", "1"),
        *extra,
    )
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_decode_steps_read_nothing_back_and_their_op_count_does_not_grow_with_rows():
    few, many = report(2, 2), report(4, 4)
    assert few["rows"] == 4 and many["rows"] == 16
    assert few["host_reads_per_step"] == many["host_reads_per_step"] == 0
    assert few["tensor_ops_per_step"] == many["tensor_ops_per_step"] > 0
    assert few["step_ms"] > 0 and few["matmul_floor_ms"] > 0
    assert few["results_transfers_per_block"] == many["results_transfers_per_block"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_block_of_eight_decode_steps_reads_back_once(static):
    blocks = report(2, 2, "--block-steps", "8", *(["--static"] if static else []))
    assert blocks["block_steps"] == 8 and blocks["static"] == static
    assert blocks["host_reads_per_step"] == 0
    assert blocks["results_transfers_per_block"] == 1  # one transfer per 8 tokens of each row
