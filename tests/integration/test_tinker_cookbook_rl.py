"""tinker-cookbook 0.6.1's RL recipes, unmodified, against a real `posttrain serve` on the
Tinker wire surface: each is run as its `__main__` is (`python -m RECIPE key=value ...`, chz
overrides only) in the tinker 0.38 interpreter (tests/tinker_env.py), offline, on the tiny
models served under hub names (`Qwen/Qwen3-8B`: the dense tiny model; `Qwen/Qwen3-30B-A3B`: the
tiny MoE, a second model for KL references and teachers).

Offline means what the recipes would download is already there: tinker_cookbook/rl_offline.py
writes the tokenizer of each hub name and small `openai/gsm8k` and `zwhe99/DeepMath-103K`
datasets into a Hugging Face home read with HF_HUB_OFFLINE=1. What each recipe wrote
(metrics.jsonl, checkpoints.jsonl) is checked here, and the server's own record of the run.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess

HELPERS = Path(__file__).parent / "tinker_cookbook"
BUILTIN_DIR = Path(__file__).resolve().parents[2] / "posttrain" / "model" / "builtin"
STUDENT = "Qwen/Qwen3-8B"
SECOND = "Qwen/Qwen3-30B-A3B"
API_KEY = "tml-posttrain-test"
STATE_PATH = re.compile(r"^tinker://(?P<model_id>[^/]+)/weights/(?P<name>[^/]+)$")


@pytest.fixture(scope="module")
def hf_home(tinker_python, tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("hf-home")
    done = subprocess.run(
        [tinker_python, str(HELPERS / "rl_offline.py"), str(home)]
        + [str(BUILTIN_DIR / "tiny-qwen3"), STUDENT, SECOND],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_HOME": str(home)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return home


@pytest.fixture(scope="module")
def rl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess.started(
        tmp_path_factory.mktemp("cookbook-rl"),
        "--model",
        f"{STUDENT}=posttrain/tiny-qwen3",
        "--model",
        f"{SECOND}=posttrain/tiny-qwen3-moe",
    )
    yield proc
    proc.stop()


def recipe(
    tinker_python, module: str, server: ServerProcess, hf_home: Path, *overrides: str
) -> str:
    """Run `python -m module base_url=... overrides...`; its stdout and stderr together."""
    done = subprocess.run(
        [tinker_python, "-m", module, f"base_url={server.base_url}", *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,  # a recipe that asks about an existing log dir fails at once
        cwd=hf_home,
        env={
            "PATH": "/usr/bin:/bin",
            "TINKER_API_KEY": API_KEY,
            "TINKER_TELEMETRY": "0",
            "HF_HOME": str(hf_home),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TINKER_COOKBOOK_RUNS_DIR": str(hf_home / "runs"),
            "OMP_NUM_THREADS": "1",
        },
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{module} failed:\n{out[-6000:]}\n{server.log()[-3000:]}"
    return out


def metrics(log_path: Path) -> list[dict]:
    """metrics.jsonl, one row per step, with every value checked finite."""
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        for key, value in row.items():
            assert not isinstance(value, float) or math.isfinite(value), (key, row["step"])
    return rows


def final_checkpoint(log_path: Path) -> dict:
    """checkpoints.jsonl's last row: the recipe's final save, state and sampler weights."""
    lines = (log_path / "checkpoints.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    assert last["name"] == "final"
    found = STATE_PATH.match(last["state_path"])
    assert found and found["name"] == "final", last
    assert last["sampler_path"] == f"tinker://{found['model_id']}/sampler_weights/final"
    return {**last, "model_id": found["model_id"]}


def server_steps(server: ServerProcess, model_id: str) -> int:
    """How many optimizer steps the server ran for the training run `model_id`."""
    sessions = httpx.get(
        f"{server.base_url}/v1/rl/training-sessions",
        params={"limit": 100},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    ).json()["data"]
    (run,) = [s for s in sessions if s.get("display_name") == model_id]
    return run["step"]


def math_rl(tmp_path: Path, name: str, *overrides: str) -> tuple[Path, list[str]]:
    log_path = tmp_path / name
    return log_path, [
        "env=arithmetic",
        f"model_name={STUDENT}",
        "lora_rank=4",
        "group_size=4",
        "groups_per_batch=2",
        "max_tokens=6",
        "learning_rate=1e-3",
        "eval_every=0",
        "save_every=0",
        f"log_path={log_path}",
        *overrides,
    ]


MATH_RL = "tinker_cookbook.recipes.math_rl.train"


def test_math_rl_arithmetic_trains_then_resumes_from_its_final_state(
    tinker_python, rl_server, hf_home, tmp_path
):
    log_path, args = math_rl(tmp_path, "math-rl", "loss_fn=importance_sampling")
    out = recipe(tinker_python, MATH_RL, rl_server, hf_home, *args, "max_steps=2")
    assert "Training completed successfully" in out
    rows = metrics(log_path)
    assert [r["step"] for r in rows[:2]] == [0, 1]
    for row in rows[:2]:
        assert row["env/all/total_episodes"] == 8  # 2 groups of 4
        assert row["tokens/trained"] > 0
        # the sampler's logprobs of its own tokens are what training computes for them
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-4
    first = final_checkpoint(log_path)
    assert first["batch"] == 2
    assert server_steps(rl_server, first["model_id"]) == 2

    # Again with max_steps=3 over the same log dir: the recipe resumes from its final state
    # (weights and optimizer, as a new training run) and takes the one step left.
    out = recipe(
        tinker_python, MATH_RL, rl_server, hf_home, *args, "max_steps=3",
        "behavior_if_log_dir_exists=resume",
    )  # fmt: skip
    assert f"Resumed training from {first['state_path']}" in out
    rows = metrics(log_path)
    assert [r["step"] for r in rows if "optim/lr" in r] == [0, 1, 2]
    second = final_checkpoint(log_path)
    assert second["batch"] == 3 and second["model_id"] != first["model_id"]
    assert server_steps(rl_server, second["model_id"]) == 3  # the resumed run's count goes on


def test_math_rl_async_samples_one_step_off_policy(tinker_python, rl_server, hf_home, tmp_path):
    """max_steps_off_policy=1: rollouts run on snapshot samplers while training goes on."""
    log_path, args = math_rl(
        tmp_path, "math-rl-async", "loss_fn=importance_sampling", "max_steps_off_policy=1"
    )
    recipe(tinker_python, MATH_RL, rl_server, hf_home, *args, "max_steps=3")
    rows = [r for r in metrics(log_path) if "optim/lr" in r]
    assert [r["training_client/step"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert 0 <= row["async/staleness_min"] <= row["async/staleness_max"] <= 1
        assert row["sampling_client/step_max"] <= row["training_client/step"]
    assert server_steps(rl_server, final_checkpoint(log_path)["model_id"]) == 3


@pytest.mark.parametrize(
    ("loss_fn", "extra", "optimizer_steps"),
    [
        (
            "ppo",
            (
                "num_substeps=2",
                "loss_fn_config.clip_low_threshold=0.9",
                "loss_fn_config.clip_high_threshold=1.1",
            ),
            4,
        ),
        ("dro", ("loss_fn_config.beta=0.1",), 2),
        (
            "cispo",
            (
                "compute_post_kl=True",
                "stream_minibatch_config.groups_per_batch=2",
                "stream_minibatch_config.num_minibatches=2",
            ),
            2,
        ),
    ],
)
def test_math_rl_with_other_losses_and_update_schedules(
    tinker_python, rl_server, hf_home, tmp_path, loss_fn, extra, optimizer_steps
):
    log_path, args = math_rl(tmp_path, f"math-rl-{loss_fn}", f"loss_fn={loss_fn}", *extra)
    recipe(tinker_python, MATH_RL, rl_server, hf_home, *args, "max_steps=2")
    rows = [r for r in metrics(log_path) if "optim/lr" in r]
    assert len(rows) == 2
    if "compute_post_kl=True" in extra:  # a fresh sampler after each step scores the batch
        assert all("kl_pre_post_v1" in row for row in rows)
    assert server_steps(rl_server, final_checkpoint(log_path)["model_id"]) == optimizer_steps


def rl_basic(tinker_python, server, hf_home, log_path: Path, *overrides: str) -> list[dict]:
    """rl_basic (rl.train on gsm8k) with a KL penalty at temperature 4: at temperature 1 the
    tiny model ends its turn at once, a token every model here scores near 0."""
    builder = "dataset_builder"
    recipe(
        tinker_python,
        "tinker_cookbook.recipes.rl_basic",
        server,
        hf_home,
        f"model_name={STUDENT}",
        f"{builder}=tinker_cookbook.recipes.math_rl.math_env:Gsm8kDatasetBuilder",
        f"{builder}.batch_size=2",
        f"{builder}.group_size=4",
        f"{builder}.model_name_for_tokenizer={STUDENT}",
        f"{builder}.renderer_name=qwen3",
        "max_tokens=8",
        "lora_rank=4",
        "learning_rate=1e-3",
        "loss_fn=importance_sampling",
        "temperature=4.0",
        "kl_penalty_coef=0.5",
        f"log_path={log_path}",
        *overrides,
    )
    rows = [r for r in metrics(log_path) if "optim/lr" in r]
    assert all(row["env/all/ac_tokens_per_turn"] > 1 for row in rows)
    return rows


def test_rl_basic_kl_penalty_scores_rollouts_with_a_base_model_sampler(
    tinker_python, rl_server, hf_home, tmp_path
):
    """kl_penalty_coef > 0: a base-model sampling client scores every rollout with
    compute_logprobs, and the difference from the sampled logprobs is the penalty. math_rl's
    CLI cannot set kl_reference_config, which rl.train requires for a KL penalty;
    rl_basic's can."""
    # Against the student's own base model before any step (the LoRA starts at zero), the
    # reference's logprobs are the sampler's own, position for position.
    (row,) = rl_basic(
        tinker_python, rl_server, hf_home, tmp_path / "same", "max_steps=1",
        f"kl_reference_config.base_model={STUDENT}",
    )  # fmt: skip
    assert abs(row["kl_policy_base"]) < 1e-5
    # Against another served model: the two score the sampled tokens apart.
    log_path = tmp_path / "other"
    rows = rl_basic(
        tinker_python, rl_server, hf_home, log_path, "max_steps=2",
        f"kl_reference_config.base_model={SECOND}",
    )  # fmt: skip
    assert len(rows) == 2
    assert all(abs(row["kl_policy_base"]) > 1e-3 for row in rows)
    assert server_steps(rl_server, final_checkpoint(log_path)["model_id"]) == 2


def test_rl_loop_on_a_local_gsm8k(tinker_python, rl_server, hf_home, tmp_path):
    """rl_loop loads openai/gsm8k with load_dataset, which offline reads the seeded cache.
    Its reward needs a \\boxed{} answer, which the tiny model never writes, so every group's
    advantages are zero and rl_loop skips its training step (its own rule); what runs is
    the sampling, the snapshot sampler each batch, and the final save."""
    log_path = tmp_path / "rl-loop"
    out = recipe(
        tinker_python,
        "tinker_cookbook.recipes.rl_loop",
        rl_server,
        hf_home,
        f"model_name={STUDENT}",
        "batch_size=2",
        "group_size=4",
        "max_tokens=8",
        "lora_rank=4",
        "loss_fn=importance_sampling",
        "max_steps=2",
        "save_every=0",
        f"log_path={log_path}",
    )
    assert "Training completed" in out
    rows = metrics(log_path)
    assert [(r["step"], r["reward/total"]) for r in rows] == [(0, 0.0), (1, 0.0)]
    assert out.count("all advantages zero, skipping training step") == 2
    final = final_checkpoint(log_path)
    assert final["batch"] == 4  # 8 seeded rows in batches of 2
    assert server_steps(rl_server, final["model_id"]) == 0


def test_on_policy_distillation_from_served_models_and_a_saved_checkpoint(
    tinker_python, rl_server, hf_home, tmp_path
):
    """The teacher is a base-model sampling client of the MoE; it scores each student rollout
    with compute_logprobs, and the reverse KL is the student's advantage."""
    log_path = tmp_path / "distill"
    out = recipe(
        tinker_python,
        "tinker_cookbook.recipes.distillation.on_policy_distillation",
        rl_server,
        hf_home,
        f"model_name={STUDENT}",
        f"teacher_model={SECOND}",
        "dataset=deepmath",
        "group_size=2",
        "groups_per_batch=2",
        "max_tokens=8",
        "lora_rank=4",
        "learning_rate=1e-3",
        "max_steps=2",
        "eval_every=0",
        "save_every=0",
        f"log_path={log_path}",
    )
    assert "Training completed successfully" in out
    rows = [r for r in metrics(log_path) if "optim/lr" in r]
    assert len(rows) == 2
    for row in rows:
        assert "teacher_kl" in row
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-4
    final = final_checkpoint(log_path)
    assert server_steps(rl_server, final["model_id"]) == 2

    # One teacher per dataset (on_policy_multi_teacher): the MoE for DeepMath, and for Tulu 3
    # the run above's final sampler weights, a sampling client made from their tinker://
    # path in another client session.
    log_path = tmp_path / "distill-two-teachers"
    out = recipe(
        tinker_python,
        "tinker_cookbook.recipes.distillation.on_policy_multi_teacher",
        rl_server,
        hf_home,
        f"model_name={STUDENT}",
        f"deepmath_teacher_model={SECOND}",
        f"tulu3_teacher_model={STUDENT}",
        f"tulu3_teacher_checkpoint={final['sampler_path']}",
        "deepmath_groups_per_batch=2",
        "tulu3_groups_per_batch=2",
        "group_size=2",
        "max_tokens=8",
        "lora_rank=4",
        "max_steps=1",
        "eval_every=0",
        "save_every=0",
        f"log_path={log_path}",
    )
    assert "Training completed successfully" in out
    (row,) = [r for r in metrics(log_path) if "optim/lr" in r]
    assert row["env/all/total_episodes"] == 8  # 2 groups of 2 from each dataset
    assert {"teacher_kl/dataset_0", "teacher_kl/dataset_1"} <= set(row)
