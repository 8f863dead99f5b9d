"""Every example in examples/ runs against a real server with small settings and does its job.

Each example is run the way a user runs it, as a script with `--base-url`, and judged by what
it prints.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers import API_KEY

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, base_url: str, *args: str, python: str = sys.executable) -> str:
    env = {**os.environ, "TOGETHER_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(
        [python, str(EXAMPLES / name), "--base-url", base_url, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return completed.stdout


def numbers(pattern: str, text: str) -> list[float]:
    return [float(m) for m in re.findall(pattern, text)]


def test_sft_example_lowers_the_loss(shared_server):
    out = run_example(
        "sft.py", shared_server.base_url, "--steps", "10", "--num-problems", "16",
        "--batch-size", "16",
    )  # fmt: skip
    losses = numbers(r"loss/token (\d+\.\d+)", out)
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < losses[0], losses
    assert re.search(r"held-out greedy accuracy: \d+\.\d% -> \d+\.\d%", out), out


def test_grpo_example_trains_on_groups_with_a_reward_spread(shared_server):
    out = run_example(
        "grpo.py", shared_server.base_url, "--steps", "3", "--prompts", "4", "--group-size", "4"
    )
    rewards = numbers(r"mean reward (\d+\.\d+)", out)
    trained = numbers(r"trained samples +(\d+)", out)
    assert len(rewards) == 3 and all(0.0 <= r <= 1.0 for r in rewards)
    # Partial credit makes nearly every group's rewards differ; at most 4 x 4 samples a step.
    assert any(t > 0 for t in trained) and all(t <= 16 for t in trained), out


def test_tinker_shim_example_runs_the_same_loop(shared_server):
    out = run_example(
        "tinker_shim.py", shared_server.base_url, "--steps", "2", "--prompts", "3",
        "--group-size", "4",
    )  # fmt: skip
    rewards = numbers(r"mean reward (\d+\.\d+)", out)
    trained = numbers(r"trained samples +(\d+)", out)
    assert len(rewards) == 2 and any(t > 0 for t in trained), out


def test_tinker_native_example_runs_the_loop_on_the_tinker_038_sdk(shared_server, tinker_python):
    out = run_example(
        "tinker_native.py", shared_server.base_url, "--steps", "2", "--prompts", "3",
        "--group-size", "4", python=tinker_python,
    )  # fmt: skip
    rewards = numbers(r"mean reward (\d+\.\d+)", out)
    trained = numbers(r"trained samples +(\d+)", out)
    assert len(rewards) == 2 and any(t > 0 for t in trained), out
    # Leaving the `with` block closed the SDK's session: its runs' and samplers' posttrain
    # sessions (named after the Tinker ids, e.g. tc-...:train:0) are stopped, none left running.
    sessions = httpx.get(
        f"{shared_server.base_url}/v1/rl/training-sessions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    ).json()["data"]
    tinker = {
        s["display_name"]: s["status"]
        for s in sessions
        if re.fullmatch(r"tc-\S+:(train|sample):\d+", s.get("display_name") or "")
    }
    assert tinker and set(tinker.values()) == {"TRAINING_SESSION_STATUS_STOPPED"}, tinker


def test_custom_loss_example_starts_at_log_2_and_learns_the_preferences(shared_server):
    out = run_example("custom_loss.py", shared_server.base_url, "--steps", "4", "--pairs", "8")
    losses = numbers(r"dpo loss (\d+\.\d+)", out)
    margins = numbers(r"mean margin ([+-]\d+\.\d+)", out)
    # Step 1 scores the policy that is also the reference: margin 0, loss exactly log 2.
    assert losses[0] == round(math.log(2), 4) and margins[0] == 0.0
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0], out
    assert margins[-1] > 0


def test_rl_step_example_samples_trains_syncs_and_samples_again(shared_server):
    out = run_example("rl_step.py", shared_server.base_url)
    assert "policy v0 samples" in out and "policy v1 samples" in out, out
    drift = numbers(r"logprob max \|diff\| = (\S+)", out)
    assert drift and drift[0] < 1e-4


def test_checkpoint_example_resumes_exactly_and_exports_a_working_merged_model(
    shared_server, tmp_path
):
    out = run_example(
        "checkpoint_and_export.py", shared_server.base_url, "--steps", "3", "--out",
        str(tmp_path / "export"),
    )  # fmt: skip
    assert re.search(r"training checkpoint ckpt-\S+ at step 3", out), out
    assert "probe logprob max |diff| 0.0e+00" in out, out
    assert re.search(r"resumed session \S+: step 3,", out), out
    assert re.search(r"next 2 losses: .* same True", out), out
    assert (tmp_path / "export" / "model.safetensors").exists()
    assert re.search(r"transformers '.*' server '.*' \(answer .*\) match True", out), out


@pytest.mark.parametrize(
    "name", sorted(path.name for path in EXAMPLES.glob("*.py") if not path.name.startswith("_"))
)
def test_help_shows_the_defaults_without_loading_torch_transformers_or_the_sdk(name):
    """`--help` answers at once: the heavy imports wait until the arguments are parsed."""
    code = (
        "import runpy, sys\n"
        f"sys.path.insert(0, {str(EXAMPLES)!r})\n"
        f"sys.argv = [{str(EXAMPLES / name)!r}, '--help']\n"
        "try:\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as done:\n"
        "    assert done.code in (0, None), done.code\n"
        "print(sorted(m for m in ('torch', 'transformers', 'together') if m in sys.modules))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    *help_lines, loaded = completed.stdout.strip().splitlines()
    assert loaded == "[]", loaded
    help_text = " ".join(" ".join(help_lines).split())
    assert "--base-url URL" in help_text
    assert "(default: " in help_text
