"""`posttrain demo --quick` against a real server: the reward rises and every output is written.

This is the README's first command, shortened: the same warm-up then GRPO loop with fewer
steps, run as a user runs it (the `posttrain` console script) against the module's server.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

from helpers import API_KEY

from posttrain.demo.loop import QUICK


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
