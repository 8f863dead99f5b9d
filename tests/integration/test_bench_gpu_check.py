"""bench/gpu_check.py runs every step of its one GPU run as a CPU dry run (--small): the
report has every number the device run records, the sampler's logprobs equal the forward
pass's (LoRA and full weight), the fused shared-prefix attention equals the explicit matmuls,
the FLOP counts and byte counts are the small model's, and the ratios are those of the numbers
printed beside them. A section that fails, or finds no time left in the budget, or an optional
section whose module is absent, fails, hangs or returns nothing usable, costs only its own
numbers and says why.

A smoke test of the script, not of its numbers: nothing here asserts on wall-clock times."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
from helpers import BENCH, run_bench

sys.path.append(str(BENCH))  # appended: bench/ modules never shadow the test's own imports

from gpu_check_isolated import optional_section  # noqa: E402

KEYS = {
    "sampler_vs_forward_max_abs_diff",
    "sampler_vs_forward_full_weight_max_abs_diff",
    "fused_attention_max_abs_diff_out",
    "fused_attention_max_abs_diff_lse",
    "fb_tokens_per_s",
    "fb_tflops_per_s",
    "mfu",
    "fb_full_tokens_per_s",
    "transformers_fb_full_tokens_per_s",
    "transformers_fb_lora_tokens_per_s",
    "fb_full_over_transformers",
    "fb_lora_over_transformers",
    "decode_step_ms",
    "decode_tokens_per_s",
    "decode_bytes_per_step",
    "sampler_tokens_per_s",
    "generate_tokens_per_s",
    "sampler_over_generate",
    "generate_static_tokens_per_s",
    "sampler_over_generate_static",
    "decode_graphs_tokens_per_s",
    "decode_static_eager_tokens_per_s",
    "decode_blocks_tokens_per_s",
    "decode_per_token_tokens_per_s",
    "decode_short_graphs_tokens_per_s",
    "decode_short_blocks_tokens_per_s",
    "multi_lora_batched_tokens_per_s",
    "multi_lora_one_at_a_time_tokens_per_s",
    "multi_lora_one_adapter_tokens_per_s",
    "multi_lora_batched_over_one_at_a_time",
    "stream_one_op_ops_per_s",
    "stream_32_batched_ops_per_s",
    "agents_whole_ops_s",
    "agents_joining_ops_s",
    "agents_joining_over_whole_ops_s",
    "agents_joining_over_whole_tokens_s",
    "agents_joining_over_whole_whole_run_ops_s",
    "agents_whole_latency_median_s",
    "agents_joining_latency_median_s",
    "agents_eager_whole_ops_s",
    "agents_eager_joining_ops_s",
    "agents_graphs_over_eager_joining_ops_s",
    "agents_eager_apart_ops_s",
    "agents_eager_joining_over_apart_ops_s",
    "agents_append_ops_s",
    "agents_joining_over_append_ops_s",
    "weights_sync_ms",
    "weights_sync_full_ms",
}
IN_PROCESS = (
    "correctness",
    "full_weight",
    "fb_lora",
    "fb_full",
    "fb_transformers",
    "sampling",
    "decode_paths",
    "multi_lora",
    "stream",
    "agents",
    "weights_sync",
)
# The --small model (gpu_check_common.SMALL): 2 layers of q 128x128, k and v 128x64, o 128x128,
# MLP 3 x 128x384, and the tied 512x128 head; rank-32 LoRA on all of them.
MATMUL_PARAMETERS = 2 * (128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 384) + 512 * 128
LORA_PARAMETERS = 32 * (2 * (256 + 192 + 192 + 256 + 3 * 512) + (128 + 512))
ALL_PARAMETERS = MATMUL_PARAMETERS + 2 * (2 * 128 + 2 * 64) + 128  # + the RMSNorm weights
ATTENTION_FLOPS = 6 * 2 * 2 * 32 * 32 * 2 * 64  # layers, rows, length^2, heads, head_dim


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_gpu_check_dry_run_reports_every_number_and_exact_logprobs():
    out = run_bench("gpu_check.py", "--device", "cpu", "--small", "--bandwidth-tbs", "0.05")
    report = last_json(out)
    assert KEYS <= report.keys(), out
    assert report["device"] == "cpu" and report["dtype"] == "float32"
    for section in (*IN_PROCESS, "generate_static"):
        assert report["sections"][section].startswith("ok in"), report["sections"]
    # float32 on the CPU: the sampler and the trainer agree to rounding
    assert report["sampler_vs_forward_max_abs_diff"] < 1e-5, out
    assert report["sampler_vs_forward_full_weight_max_abs_diff"] < 1e-5, out
    assert report["fused_attention_max_abs_diff_out"] < 1e-5, out
    assert report["fused_attention_max_abs_diff_lse"] < 1e-5, out
    assert report["mfu"] is None and report["fb_full_mfu"] is None  # no peak known for a CPU
    numbers = [k for k in KEYS if k not in ("mfu",) and "diff" not in k]
    assert all(report[k] > 0 for k in numbers), out
    # Captures and prefill steps: on the CPU the agents' passes are dynamic, so none.
    for way in ("agents_whole", "agents_joining", "agents_append", "stream_join"):
        assert report[f"{way}_layouts"] == report[f"{way}_prefill_steps"] == 0
    assert 1 <= report["stream_join_prefills"] <= 32  # joins ride in the decode pass here
    # The same stream on the multi_lora section's 8 adapters in turn, all 32 operations.
    assert report["stream_adapters_layouts"] == report["stream_adapters_prefill_steps"] == 0
    assert 1 <= report["stream_adapters_prefills"] <= 32
    assert report["stream_adapters_ops_per_s"] > 0 and report["stream_adapters_op_latency_s"] > 0
    assert re.search(r"^  stream, the 8 adapters in turn  \d", out, re.M), out

    # FLOPs: the small model's matmul and adapter parameters, 2 x 32 tokens; each
    # implementation of one variant is credited the same work
    assert report["fb_matmul_parameters"] == MATMUL_PARAMETERS
    assert report["fb_lora_parameters"] == LORA_PARAMETERS
    tokens = report["fb_tokens"]
    assert tokens == 64
    lora_flops = 4 * MATMUL_PARAMETERS * tokens + 6 * LORA_PARAMETERS * tokens + ATTENTION_FLOPS
    full_flops = 6 * MATMUL_PARAMETERS * tokens + ATTENTION_FLOPS
    for prefix, flops in (
        ("fb", lora_flops),
        ("transformers_fb_lora", lora_flops),
        ("fb_full", full_flops),
        ("transformers_fb_full", full_flops),
    ):
        done = report[f"{prefix}_tflops_per_s"] * 1e12 * report[f"{prefix}_seconds"]
        assert done == pytest.approx(flops, rel=1e-9), prefix
        assert report[f"{prefix}_tokens_per_s"] == pytest.approx(
            tokens / report[f"{prefix}_seconds"]
        )
    assert report["transformers_fb_lora_impl"].startswith("peft ")  # peft is a test dependency

    # ratios are the numbers beside them
    def ratio(over: str, a: str, b: str) -> None:
        assert report[over] == pytest.approx(report[a] / report[b], rel=1e-9), over

    ratio("fb_full_over_transformers", "transformers_fb_full_seconds", "fb_full_seconds")
    ratio("fb_lora_over_transformers", "transformers_fb_lora_seconds", "fb_seconds")
    ratio("sampler_over_generate", "sampler_tokens_per_s", "generate_tokens_per_s")
    ratio("sampler_over_generate_static", "sampler_tokens_per_s", "generate_static_tokens_per_s")
    ratio("stream_32_batched_over_one_op", "stream_32_batched_ops_per_s", "stream_one_op_ops_per_s")
    ratio("agents_joining_over_whole_ops_s", "agents_joining_ops_s", "agents_whole_ops_s")
    for way in ("whole", "joining"):
        over = f"agents_graphs_over_eager_{way}_ops_s"
        ratio(over, f"agents_{way}_ops_s", f"agents_eager_{way}_ops_s")
    ratio(
        "agents_eager_joining_over_apart_ops_s",
        "agents_eager_joining_ops_s",
        "agents_eager_apart_ops_s",
    )
    ratio("agents_joining_over_append_ops_s", "agents_joining_ops_s", "agents_append_ops_s")
    # the closed loop's two ways return the same tokens, but where a draw lands on a boundary
    # of the CDF within rounding (row-count dependent): the first differing tokens neighbour
    assert report["agents_ops"] == 6 and report["agents_differences_are_neighbours"] is True, out
    # --small times the multi-LoRA ways once, so the paired ratio is the plain one
    for way in ("one_at_a_time", "one_adapter"):
        ratio(
            f"multi_lora_batched_over_{way}",
            "multi_lora_batched_tokens_per_s",
            f"multi_lora_{way}_tokens_per_s",
        )
    assert report["generate_static_compiled"] is False  # transformers compiles only on CUDA

    # the bandwidth limit: every row's token per step, at 0.05 TB/s, over the step's bytes
    limit = report["decode_bandwidth_limit_tokens_per_s"]
    rows = report["decode_rows"]
    assert rows == 4  # --small: 2 prompts x 2 samples
    assert limit == pytest.approx(rows * 0.05e12 / report["decode_bytes_per_step"], rel=1e-9)
    for way in ("graphs", "blocks", "static_eager", "per_token"):
        fraction = report[f"decode_{way}_fraction_of_bound"]
        assert fraction == pytest.approx(report[f"decode_{way}_tokens_per_s"] / limit, rel=1e-9)
    static = report["generate_static_fraction_of_bound"]
    assert static == pytest.approx(report["generate_static_tokens_per_s"] / limit, rel=1e-9)

    # weights-sync copies the generator adapter (float32) or the whole float32 model
    assert report["weights_sync_bytes"] == 4 * LORA_PARAMETERS
    assert report["weights_sync_full_bytes"] == 4 * ALL_PARAMETERS

    # where this tree has a SampleStream its numbers, else the reason
    if "stream_join_ops_per_s" in report:
        assert report["stream_join_ops_per_s"] > 0 and report["stream_join_op_latency_s"] > 0
    else:
        assert report["stream_join"].startswith("skipped: "), report["stream_join"]
    for optional in ("fsdp2", "vllm"):
        assert isinstance(report[optional], dict) or report[optional].startswith("skipped: ")

    assert report["cuda_graphs_default_supported"] is None  # graphs do not replay on a CPU
    assert "no decision from a cpu run" in report["cuda_graphs_decision"]
    for text in (
        "target >= 40%",
        "target >= 3x",
        "posttrain full weight",
        "transformers LoRA r32",
        "static cache",
        "multi-LoRA",
        "32 in one call",
        "agents in a closed loop (3 agents x 2 turns",
        "full weight",
        report["cuda_graphs_decision"],
        "  fsdp2  ",
        "  vllm  ",
    ):
        assert text in out, text


@pytest.mark.slow
def test_a_spent_budget_skips_every_section_and_still_reports():
    out = run_bench("gpu_check.py", "--device", "cpu", "--small", "--budget-s", "-1")
    report = last_json(out)
    assert report["sections"]["setup"] == "ok"
    for section in IN_PROCESS:
        assert report["sections"][section].startswith("skipped: ~0 s estimated"), section
    assert report["generate_static"].startswith("skipped: ")
    assert "sampler_tokens_per_s" not in report and "fb_tokens_per_s" not in report
    assert report["fsdp2"].startswith("skipped: ") and report["vllm"].startswith("skipped: ")
    assert report["cuda_graphs_default_supported"] is None
    assert "undecided" in report["cuda_graphs_decision"]
    assert "MFU n/a" in out


def test_a_failing_section_reports_its_error_and_the_next_one_runs(tmp_path: Path):
    from gpu_check import Run

    written = tmp_path / "report.json"
    args = Namespace(budget_s=100.0, small=True, skip={"skipped_one"}, json=written)
    run = Run(args, {})

    def broken() -> dict:
        return {"partial": 1 / 0}

    run.section("broken", broken)
    run.section("skipped_one", lambda: {"never": 1})
    run.section("working", lambda: {"measured": 2.5})
    report = json.loads(written.read_text())
    assert report["sections"]["broken"] == "error: ZeroDivisionError: division by zero"
    assert report["sections"]["skipped_one"] == "skipped: --skip"
    assert report["sections"]["working"].startswith("ok in")
    assert report["measured"] == 2.5 and "never" not in report

    # at full size a section runs only if its H200 estimate fits in the budget left
    full_size = Run(Namespace(budget_s=30.0, small=False, skip=set(), json=None), {})
    full_size.section("sampling", lambda: {"never": 1})  # 92 s on the H200 run
    assert full_size.report["sections"]["sampling"] == "skipped: ~92 s estimated, 30 s left"
    full_size.section("weights_sync", lambda: {"measured": 1.0})  # 1 s there
    assert full_size.report["measured"] == 1.0 and full_size.report["pace"] == 1.0


def module(tmp_path: Path, monkeypatch, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))  # for the check that the module exists
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # for the child that runs it
    return name


RUN = [("run", ["cpu", True], {})]


def test_an_optional_section_returns_its_dict_from_a_child(tmp_path, monkeypatch):
    body = "import os\ndef run(device, small):\n    return {'pid': os.getpid(), 'small': small}\n"
    name = module(tmp_path, monkeypatch, "gpu_probe_ok", body)
    result = optional_section(name, RUN, timeout=60)
    assert isinstance(result, dict) and result["small"] is True
    assert result["pid"] != os.getpid()  # ran in a child process


def test_an_optional_section_calls_the_first_function_its_module_defines(tmp_path, monkeypatch):
    body = "def fsdp2_check(device, *, steps=4):\n    return {'device': device, 'steps': steps}\n"
    name = module(tmp_path, monkeypatch, "gpu_probe_other", body)
    calls = [*RUN, ("fsdp2_check", ["cpu"], {"steps": 1})]
    assert optional_section(name, calls, 60) == {"device": "cpu", "steps": 1}
    result = optional_section(name, RUN, 60)
    assert result.startswith("skipped: RuntimeError: exit 1: AttributeError: bench/"), result
    assert result.endswith("defines none of run"), result


@pytest.mark.slow  # waits out a 10 s timeout
def test_an_optional_section_that_fails_absent_or_slow_says_skipped(tmp_path, monkeypatch):
    assert optional_section("gpu_probe_absent", RUN, 60) == (
        "skipped: bench/gpu_probe_absent.py is absent"
    )
    raises = module(tmp_path, monkeypatch, "gpu_probe_raises", "def run(d, s):\n    1 / 0\n")
    result = optional_section(raises, RUN, 60)
    assert result.startswith("skipped: RuntimeError: exit 1: ZeroDivisionError"), result
    not_dict = module(tmp_path, monkeypatch, "gpu_probe_list", "def run(d, s):\n    return []\n")
    assert optional_section(not_dict, RUN, 60) == "skipped: run() returned list, not a dict"
    slow = module(
        tmp_path, monkeypatch, "gpu_probe_slow", "import time\ndef run(d, s):\n    time.sleep(60)\n"
    )
    assert optional_section(slow, RUN, 10) == "skipped: TimeoutError: timed out after 10 s"
    assert optional_section(slow, RUN, 5) == "skipped: 5 s of the time budget left"
    needs = optional_section(slow, RUN, 60, needs="no_such_package_here")
    assert needs == "skipped: no_such_package_here is not installed"


@pytest.mark.slow
def test_gpu_run_sh_writes_the_report_into_out(tmp_path: Path):
    """The GPU session's one command, pointed at the CPU dry run (later --device wins)."""
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": "",
    }
    completed = subprocess.run(
        [str(BENCH / "gpu_run.sh"), "--device", "cpu", "--small", "--skip", "generate_static"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "gpu_check exit 0" in completed.stdout
    # the `-m gpu` tests ran first: on the CPU each is skipped ("needs CUDA")
    assert "3 skipped" in (tmp_path / "gpu_tests.txt").read_text(), completed.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    printed = (tmp_path / "gpu_check.txt").read_text().strip().splitlines()
    assert json.loads(printed[-1]) == report
    assert report["device"] == "cpu" and report["sections"]["generate_static"] == "skipped: --skip"
    assert report["sections"]["decode_paths"].startswith("ok in")
    assert report["budget_s"] == 445  # the 470 s limit less 25
    environment = (tmp_path / "environment.txt").read_text()
    assert "torch " in environment and "transformers " in environment
