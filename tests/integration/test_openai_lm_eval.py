"""lm-evaluation-harness, unmodified, against posttrain's OpenAI-compatible completions: its
`local-completions` model runs a small local arithmetic task (tests/openai_eval/) with
loglikelihood and generate_until on a Together session, and scores each problem as the same
prompt scored through the `together` SDK on that session does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import API_KEY, open_session
from transformers import AutoTokenizer

from posttrain.config import BUILTIN_MODEL_DIR

TASKS = Path(__file__).resolve().parents[1] / "openai_eval"
TOKENIZER = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def model_input(tokens: list[int]) -> dict:
    return {"chunks": [{"encoded_text": {"tokens": tokens}}]}


def problems() -> list[tuple[str, str]]:
    lines = (TASKS / "arithmetic.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return [(f"<|im_start|>{r['a']}+{r['b']}=", r["answer"]) for r in rows]


def sdk_scores(session) -> tuple[list[float], list[float]]:
    """Per problem, (whether the answer is the greedy continuation, whether a greedy
    generation matches it exactly) through the SDK, as lm-eval defines each."""
    greedy, exact = [], []
    for prompt, answer in problems():
        tokens = encode(prompt + answer)
        scored = session.generator.sample(
            model_input(tokens),
            sampling_params={"max_tokens": 1},
            prompt_logprobs=True,
            topk_prompt_logprobs=1,
            interval=0.05,
        )
        positions = range(len(encode(prompt)), len(tokens))
        greedy.append(
            float(
                all(
                    scored.prompt_logprobs[i] == scored.topk_prompt_logprobs[i].logprobs[0]
                    for i in positions
                )
            )
        )
        drawn = session.generator.sample(
            model_input(encode(prompt)),
            sampling_params={"max_tokens": 4, "temperature": 0},
            interval=0.05,
        )
        text = TOKENIZER.decode(drawn.sequences[0].tokens, skip_special_tokens=True)
        exact.append(float(text.split("\n")[0] == answer))
    return greedy, exact


def logged(results: Path, task: str, metric: str) -> list[float]:
    """lm-eval's per-problem scores of a task (--log_samples), in the JSONL's order."""
    (path,) = results.rglob(f"samples_{task}_*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [float(row[metric]) for row in sorted(rows, key=lambda row: row["doc_id"])]


def test_lm_eval_local_completions_gives_the_sdk_accuracy(shared_server, tmp_path):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 9})
    model_args = ",".join(
        (
            f"model={session.session_id}",
            f"base_url={shared_server.base_url}/v1/completions",
            f"tokenizer={BUILTIN_MODEL_DIR}",
            "tokenizer_backend=huggingface",
            "num_concurrent=1",
            "max_retries=1",
        )
    )
    env = {
        **os.environ,
        "OPENAI_API_KEY": API_KEY,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "local-completions",
            "--model_args",
            model_args,
            "--tasks",
            "posttrain_arith_ll,posttrain_arith_gen",
            "--include_path",
            str(TASKS),
            "--output_path",
            str(tmp_path / "results"),
            "--log_samples",
        ],
        cwd=TASKS,  # the task yaml names its JSONL relative to here
        env=env,
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 0, completed.stderr[-5000:]
    (path,) = (tmp_path / "results").rglob("results_*.json")
    results = json.loads(path.read_text())["results"]
    greedy, exact = sdk_scores(session)
    assert results["posttrain_arith_ll"]["acc,none"] == sum(greedy) / len(greedy)
    assert results["posttrain_arith_gen"]["exact_match,none"] == sum(exact) / len(exact)
    # Problem by problem, not only on average.
    assert logged(tmp_path / "results", "posttrain_arith_ll", "acc") == greedy
    assert logged(tmp_path / "results", "posttrain_arith_gen", "exact_match") == exact
    assert sum(exact) > 0  # the built-in model adds some of these right
    session.stop()
    resources.stop()
