"""`posttrain demo --quick` against a real server: the reward rises and every output is written.

This is the README's first command, shortened: the same warm-up then GRPO loop with fewer
steps, run as a user runs it (the `posttrain` console script) against the module's server.
The MoE built-in runs the same loop, much shortened, in-process (`--model` only chooses the
DemoConfig's base_model: tests/unit/demo/test_command.py). Two same-seed runs, one of them
beside a busy process, compute the same numbers; Ctrl-C stops the demo and the server it
started with one line.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from helpers import API_KEY, low_level

from posttrain.demo.loop import QUICK, DemoResult, run_demo

MOE_MODEL = "posttrain/tiny-qwen3-moe"


def test_quick_demo_raises_reward_and_heldout_accuracy(shared_server, tmp_path: Path):
    out_dir = tmp_path / "demo"
    env = {**os.environ, "TOGETHER_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "posttrain",
            "demo",
            "--quick",
            "--base-url",
            shared_server.base_url,
            "--out",
            str(out_dir),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]

    steps = [json.loads(line) for line in (out_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, QUICK.warmup_steps + QUICK.rl_steps + 1))
    assert [s["phase"] for s in steps].count("rl") == QUICK.rl_steps
    rewards = [s["reward"] for s in steps if s["phase"] == "rl"]
    third = max(1, len(rewards) // 3)
    first, last = sum(rewards[:third]) / third, sum(rewards[-third:]) / third
    assert last > first, rewards
    assert all(s["kl"] is not None and s["kl"] >= 0 for s in steps if s["phase"] == "rl")

    summary = json.loads((out_dir / "summary.json").read_text())
    accuracy = summary["heldout_accuracy"]
    assert accuracy["after_rl"] > accuracy["after_warmup"], summary

    png = (out_dir / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (1000, 680)

    # The closing report says where everything is.
    for name in ("demo.png", "steps.jsonl", "summary.json"):
        assert str(out_dir / name) in completed.stdout, completed.stdout
    assert "after GRPO" in completed.stdout
    # The progress bar went to stderr with the step's numbers.
    assert "reward=" in completed.stderr and "kl=" in completed.stderr


def test_the_demo_loop_runs_end_to_end_on_the_moe_built_in(shared_server, tmp_path: Path):
    config = replace(
        QUICK,
        base_model=MOE_MODEL,
        num_heldout=16,
        warmup_steps=20,
        warmup_batch_size=32,
        rl_steps=3,
        prompts_per_step=32,
    )
    result = run_demo(shared_server.base_url, API_KEY, config, tmp_path / "demo")

    phases = [s.phase for s in result.steps]
    assert phases == ["warmup"] * 20 + ["rl"] * 3
    # Per-step losses are of different batches: compare the first and last five.
    warmup_losses = [s.loss for s in result.steps if s.phase == "warmup"]
    assert sum(warmup_losses[-5:]) < sum(warmup_losses[:5]), warmup_losses
    # A step whose groups all agree trains nothing and measures no KL; some step here trains.
    kls = [s.kl for s in result.steps if s.phase == "rl" and s.kl is not None]
    assert kls and all(kl >= 0 for kl in kls), result.steps[-2:]
    for accuracy in (result.accuracy_base, result.accuracy_warmup, result.accuracy_rl):
        assert 0 <= accuracy <= 1
    assert result.summary()["config"]["base_model"] == MOE_MODEL
    resources = low_level(shared_server.base_url).post_training.model_resources.list()
    assert MOE_MODEL in {r.base_model for r in resources.data}


@contextmanager
def busy_neighbour() -> Iterator[None]:
    """A process that keeps one core busy while the block runs."""
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        process.kill()
        process.wait()


def numbers(result: DemoResult) -> dict[str, object]:
    """Everything a run computed that depends on the numerics (not the timings)."""
    return {
        "accuracy": (result.accuracy_base, result.accuracy_warmup, result.accuracy_rl),
        "steps": [(s.phase, s.step, s.loss, s.reward, s.kl, s.metrics) for s in result.steps],
        "examples": result.examples,
    }


def test_two_same_seed_demo_runs_compute_the_same_losses_and_accuracies(
    shared_server, tmp_path: Path
):
    # The demo's loop with fewer and smaller steps; the warm-up's rate is raised so that some
    # GRPO groups disagree and the GRPO steps train.
    config = replace(
        QUICK,
        seed=3,
        num_heldout=32,
        warmup_steps=40,
        warmup_batch_size=32,
        warmup_learning_rate=6e-3,
        rl_steps=4,
        prompts_per_step=16,
    )
    quiet = run_demo(shared_server.base_url, API_KEY, config, tmp_path / "quiet")
    with busy_neighbour():
        busy = run_demo(shared_server.base_url, API_KEY, config, tmp_path / "busy")

    assert numbers(busy) == numbers(quiet)
    assert any(s.kl is not None for s in quiet.steps if s.phase == "rl"), quiet.steps[-4:]
    # The comparison can fail: another seed computes other numbers from its first step.
    other = replace(config, seed=4, warmup_steps=3, rl_steps=1)
    other_seed = run_demo(shared_server.base_url, API_KEY, other, tmp_path / "other")
    assert [s.loss for s in other_seed.steps[:3]] != [s.loss for s in quiet.steps[:3]]


def server_child(pid: int) -> int:
    """The pid of the one child process of `pid` (the demo's `posttrain serve`)."""
    children = [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]
    assert len(children) == 1, children
    return children[0]


def test_ctrl_c_stops_the_demo_and_its_server_with_one_line(tmp_path: Path):
    out_dir = tmp_path / "demo"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    demo = subprocess.Popen(
        [sys.executable, "-m", "posttrain", "demo", "--quick", "--out", str(out_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    steps = out_dir / "steps.jsonl"
    # Mid-run: once the first steps are written the server runs and the SDK is polling it.
    while demo.poll() is None and not (steps.exists() and steps.read_text().count("\n") >= 2):
        time.sleep(0.1)
    assert demo.poll() is None, demo.communicate()
    server = server_child(demo.pid)

    demo.send_signal(signal.SIGINT)
    stdout, stderr = demo.communicate(timeout=60)

    assert demo.returncode == 130
    output = stdout + stderr
    assert "Traceback" not in output, output[-4000:]
    lines = [line for line in output.splitlines() if "interrupted" in line]
    assert lines == [
        f"posttrain demo: interrupted; stopped the demo and its server (steps so far: {out_dir})"
    ], output[-4000:]
    assert not Path(f"/proc/{server}").exists()  # stopped and reaped, not left running
    assert "Traceback" not in (out_dir / "server.log").read_text()
