"""tinker-cookbook 0.6.1's supervised and DPO trainers, unmodified, against `posttrain serve`.

Each run is the cookbook's own entry point in the tinker 0.38 interpreter (tests/tinker_env.py)
with command-line overrides only: `recipes.sl_basic` (the `supervised.train` loop, with a
held-out split for its evaluator), `recipes.sl_loop` (its flat loop and its resume logic) and
`preference.train_dpo` (through tinker_cookbook/dpo_cli.py, the chz entry point the cookbook
gives its other trainers). The server serves the tiny model under the hub name the recipes
know (`--model Qwen/Qwen3-8B=posttrain/tiny-qwen3`); tinker_cookbook/seed_sl_cache.py puts
that model's tokenizer and a local conversation set where HF_HUB_OFFLINE=1 makes
`transformers` and `datasets` look, and a proxy nobody listens on keeps every other request
off the network. The assertions read what the cookbook wrote: metrics.jsonl,
checkpoints.jsonl, and the logprobs of the checkpoints it saved.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ServerProcess

pytestmark = pytest.mark.slow

HELPERS = Path(__file__).parent / "tinker_cookbook"
MODEL_NAME = "Qwen/Qwen3-8B"
TINY_MODEL_DIR = Path(__file__).resolve().parents[2] / "posttrain/model/builtin/tiny-qwen3"
API_KEY = "tml-posttrain-test"
# Shared by every chat dataset builder the runs configure.
COMMON = {
    "model_name_for_tokenizer": MODEL_NAME,
    "renderer_name": "qwen3",
    "batch_size": 2,
    "max_length": 256,
}


def conversation(a: int, b: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}."},
        ]
    }


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cookbook-sl")


@pytest.fixture(scope="module")
def cookbook_server(workdir: Path) -> Iterator[ServerProcess]:
    (workdir / "server").mkdir()
    proc = ServerProcess.started(
        workdir / "server", "--model", f"{MODEL_NAME}=posttrain/tiny-qwen3"
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def cookbook_env(tinker_python: Path, workdir: Path) -> dict[str, str]:
    """The environment of every cookbook process: offline, over a seeded HF cache."""
    conversations = write_jsonl(
        workdir / "conversations.jsonl", [conversation(a, a + 3) for a in range(12)]
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(workdir / "home"),
        "HF_HOME": str(workdir / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TINKER_API_KEY": API_KEY,
        "TINKER_TELEMETRY": "0",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        # Anything not bound for the local server goes to a port nobody listens on.
        "HTTP_PROXY": "http://127.0.0.1:9",
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    (workdir / "home").mkdir()
    seed = [HELPERS / "seed_sl_cache.py", env["HF_HOME"], MODEL_NAME, TINY_MODEL_DIR]
    seed += ["HuggingFaceH4/no_robots", conversations]
    done = subprocess.run(
        [str(tinker_python), *map(str, seed)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return env


def run_cookbook(
    python: Path, env: dict, server: ServerProcess, command: list[str], log_path: Path
) -> str:
    """Run a cookbook entry point (`-m module` or a script) with chz overrides; its output."""
    argv = [str(python), *command, f"base_url={server.base_url}", f"log_path={log_path}"]
    done = subprocess.run(
        argv, capture_output=True, text=True, env=env, cwd=log_path.parent, timeout=600
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{command[:2]} failed:\n{output[-6000:]}\n{server.log()[-3000:]}"
    return output


def score(python: Path, env: dict, server: ServerProcess, sequences, paths) -> dict:
    argv = [str(python), str(HELPERS / "score_sl_samplers.py"), server.base_url, MODEL_NAME]
    done = subprocess.run(
        [*argv, json.dumps(sequences), *paths], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def dataset_overrides(builder: str, prefix: str = "dataset_builder") -> list[str]:
    common = [f"{prefix}.common_config.{key}={value}" for key, value in COMMON.items()]
    return [f"{prefix}={builder}", *common]


def test_sl_basic_trains_evaluates_and_checkpoints(
    tinker_python, cookbook_env, cookbook_server, workdir
):
    """recipes.sl_basic on a local conversations file: 8 training rows in batches of 2, 4
    held out for the trainer's evaluator (SamplerNLLEvaluator: a snapshot sampler's
    compute_logprobs), evaluated at steps 0 and 2, checkpointed at step 2 and at the end."""
    log_path = workdir / "sl_basic"
    run_cookbook(
        tinker_python,
        cookbook_env,
        cookbook_server,
        [
            "-m",
            "tinker_cookbook.recipes.sl_basic",
            f"model_name={MODEL_NAME}",
            "lora_rank=4",
            "learning_rate=2e-2",
            "max_steps=4",
            "save_every=2",
            "eval_every=2",
            *dataset_overrides("tinker_cookbook.supervised.data:FromConversationFileBuilder"),
            f"dataset_builder.file_path={workdir / 'conversations.jsonl'}",
            "dataset_builder.test_size=4",
        ],
        log_path,
    )
    metrics = {row["step"]: row for row in read_jsonl(log_path / "metrics.jsonl")}
    assert sorted(metrics) == [0, 1, 2, 3]
    assert all(math.isfinite(row["train_mean_nll"]) for row in metrics.values())
    assert all(row["num_sequences"] == 2 for row in metrics.values())
    evaluated = {step: row["test/nll"] for step, row in metrics.items() if "test/nll" in row}
    assert sorted(evaluated) == [0, 2]
    assert all(math.isfinite(nll) for nll in evaluated.values())
    assert evaluated[2] < evaluated[0]  # two steps of training lowered the held-out loss

    records = read_jsonl(log_path / "checkpoints.jsonl")
    assert [r["name"] for r in records] == ["000002", "final"]
    assert records[0]["batch"] == 2 and records[0]["epoch"] == 0
    for record in records:
        assert record["state_path"].endswith(f"/weights/{record['name']}")
        assert record["sampler_path"].endswith(f"/sampler_weights/{record['name']}")
    # The saved sampler weights load and carry the training: they score the held-out answers
    # differently from the base model.
    sequence = [[1, *range(20, 40), 2]]
    scored = score(
        tinker_python, cookbook_env, cookbook_server, sequence, [records[1]["sampler_path"]]
    )
    trained = scored[records[1]["sampler_path"]][0]
    assert trained[0] is None and len(trained) == len(sequence[0])
    assert trained[1:] != pytest.approx(scored["base"][0][1:], abs=1e-3)


def sl_loop(python, env, server, log_path: Path) -> str:
    return run_cookbook(
        python,
        env,
        server,
        [
            "-m",
            "tinker_cookbook.recipes.sl_loop",
            f"model_name={MODEL_NAME}",
            "lora_rank=4",
            "learning_rate=2e-2",
            "batch_size=2",
            "max_length=256",
            "max_steps=3",
            "save_every=2",
        ],
        log_path,
    )


def test_sl_loop_resumes_from_its_last_state_checkpoint(
    tinker_python, cookbook_env, cookbook_server, workdir
):
    """recipes.sl_loop (its dataset: the seeded no_robots cache, 12 rows, 6 batches of 2).

    Run 1 saves state at step 2 (before training batch 2) and a final checkpoint after it.
    The run is then cut back to what it had written when it was killed right after the
    step-2 save (checkpoints.jsonl up to that record), and run 2, the same command, resumes
    from it: create_training_client_from_state_with_optimizer on a path saved by another
    session. Batch 2 then sees the same weights (the same loss) and, with the Adam moments
    restored, ends at the same weights as run 1's final checkpoint. Run 3 resumes from that
    final checkpoint (the last record) and has nothing left to train."""
    log_path = workdir / "sl_loop"
    sl_loop(tinker_python, cookbook_env, cookbook_server, log_path)
    checkpoints = log_path / "checkpoints.jsonl"
    first = read_jsonl(checkpoints)
    assert [(r["name"], r["batch"]) for r in first] == [("000002", 2), ("final", 6)]
    write_jsonl(checkpoints, first[:1])

    output = sl_loop(tinker_python, cookbook_env, cookbook_server, log_path)
    assert "Resuming from batch 2" in output
    second = read_jsonl(checkpoints)
    # Step 2 comes round again in run 2, and with it its periodic save, now in a new run.
    assert [(r["name"], r["batch"]) for r in second] == [("000002", 2)] * 2 + [("final", 6)]
    assert second[1]["state_path"] != first[0]["state_path"]
    assert second[2]["state_path"] != first[1]["state_path"]

    metrics = read_jsonl(log_path / "metrics.jsonl")
    assert [row["step"] for row in metrics] == [0, 1, 2, 2]
    assert all(math.isfinite(row["train_mean_nll"]) for row in metrics)
    assert metrics[3]["train_mean_nll"] == pytest.approx(metrics[2]["train_mean_nll"], abs=1e-6)

    # Run 3, the same command once more: the last record is run 2's final (batch 6, all the
    # batches), so it resumes from there, trains nothing and saves the same weights again.
    output = sl_loop(tinker_python, cookbook_env, cookbook_server, log_path)
    assert "Resuming from batch 6" in output
    third = read_jsonl(checkpoints)
    assert [(r["name"], r["batch"]) for r in third[3:]] == [("final", 6)]
    assert len(read_jsonl(log_path / "metrics.jsonl")) == 4

    sequences = [[1, *range(20, 36), 2], [1, *range(40, 60)]]
    paths = [first[1]["sampler_path"], second[2]["sampler_path"], third[3]["sampler_path"]]
    scored = score(tinker_python, cookbook_env, cookbook_server, sequences, paths)
    for original, resumed, again, base in zip(
        *(scored[path] for path in paths), scored["base"], strict=True
    ):
        assert resumed[1:] == pytest.approx(original[1:], abs=1e-5)
        assert again[1:] == pytest.approx(resumed[1:], abs=1e-6)
        assert original[1:] != pytest.approx(base[1:], abs=1e-3)


def test_dpo_trains_against_a_snapshot_reference(
    tinker_python, cookbook_env, cookbook_server, workdir
):
    """preference.train_dpo on a local JSONL of labeled comparisons (ComparisonBuilderFromJsonl),
    one preference written eight ways (labels A and B, completions swapped to match), so every
    batch holds the same pairs. The reference is the snapshot sampler of the initial weights
    (compute_logprobs); the policy's logprobs come from forward_backward_custom (a forward,
    then cross-entropy with the custom loss's negative gradients as weights). At step 0 the
    policy is the reference: loss ln 2 and margin 0 exactly as the two paths agree; training
    on the same pairs must then lower the loss step after step."""
    chosen = [{"role": "assistant", "content": "2 + 2 = 4."}]
    rejected = [{"role": "assistant", "content": "2 + 2 = 5."}]
    prompt = [{"role": "user", "content": "What is 2 + 2?"}]
    rows = []
    for i in range(8):
        a, b, label = (chosen, rejected, "A") if i % 2 == 0 else (rejected, chosen, "B")
        comparison = {"prompt_conversation": prompt, "completion_A": a, "completion_B": b}
        rows.append({"comparison": comparison, "label": label})
    prefs = write_jsonl(workdir / "preferences.jsonl", rows)
    log_path = workdir / "dpo"
    comparisons = "dataset_builder.comparison_builder"
    run_cookbook(
        tinker_python,
        cookbook_env,
        cookbook_server,
        [
            str(HELPERS / "dpo_cli.py"),
            f"model_name={MODEL_NAME}",
            "recipe_name=recipe_preference_dpo",
            "renderer_name=qwen3",
            "lora_rank=4",
            "learning_rate=1e-2",
            "dpo_beta=0.5",
            "max_steps=3",
            "save_every=2",
            "eval_every=0",
            *dataset_overrides(
                "tinker_cookbook.preference.dpo_datasets:DPODatasetBuilderFromComparisons"
            ),
            f"{comparisons}=tinker_cookbook.preference.preference_datasets:ComparisonBuilderFromJsonl",
            f"{comparisons}.train_path={prefs}",
        ],
        log_path,
    )
    metrics = read_jsonl(log_path / "metrics.jsonl")
    assert [row["step"] for row in metrics] == [0, 1, 2]
    assert all(row["num_pairs"] == 2 for row in metrics)
    losses = [row["dpo_loss"] for row in metrics]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)
    assert metrics[0]["margin"] == pytest.approx(0.0, abs=1e-5)
    assert losses[2] < losses[1] < losses[0]
    assert metrics[2]["accuracy"] == 1.0 and metrics[2]["margin"] > 0
    records = read_jsonl(log_path / "checkpoints.jsonl")
    assert [r["name"] for r in records] == ["000002", "final"]
    assert all(r["state_path"].startswith("tinker://") for r in records)
