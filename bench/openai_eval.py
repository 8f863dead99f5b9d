"""lm-eval through the OpenAI surface while a session trains beside it (a benchmark, not a timed
test; issue 46).

What: the unmodified lm-evaluation-harness CLI (`python -m lm_eval --model local-completions`)
scores --prompts two-digit additions (the demo's task, posttrain/demo/task.py: its held-out
problems, written with a task yaml to a temporary directory) against a real `posttrain serve`
(posttrain/demo/server.py) on the built-in model, while a training loop runs on a session of
the same model resource: the demo's warm-up step through the together SDK (cross-entropy
forward-backward + optim-step on --train-batch problems), back to back in a thread of this
process. lm-eval's `model` is a second session of that resource resumed from a training
checkpoint of the trained one (frozen; weights-synced once): the eval and the training share
the scheduler and the engine, not a session's order.

Task (--task): `ll`, loglikelihood (the default: what lm-eval's multiple-choice tasks lean
on): one request per prompt of echo, max_tokens 1, logprobs 1, temperature 0 over context +
answer, scored `acc` (the answer is the greedy continuation); one sample operation each
(service/openai/completions.py: at temperature 0 the drawn token is its own top-1, so no
scoring operation). `gen`, generate_until: greedy, up to 4 tokens, stopping at end of line,
scored exact_match.

How, per repetition (--reps; the two eval paths alternate which goes first):
1. quiet: --steps training steps alone.
2. openai: the lm-eval CLI run (`num_concurrent` --concurrency, `--batch_size` --batch-size:
   prompts a request), with the training loop beside it.
3. sdk: the same prompts (the token ids lm-eval sends) through the together SDK's
   `sample_batch_async` on the same eval session, --batch-size prompts an operation,
   --concurrency operations in flight, with the training loop beside it; loglikelihood as a
   Together user scores a continuation (prompt_logprobs, top-1, max_tokens 1, temperature 0).
An eval's throughput is prompts over its request window: from the first sample operation the
server stores to the last one finished, read off GET /metrics every 50 ms, one clock for both
paths; so lm-eval's own start-up (imports, task building) is left out (its whole wall time is
printed too, and the sample operations each path cost). The training steps beside an eval are
those that overlap its window.
Printed: every run, the medians, and the ratios as medians of the per-repetition ratios
(adjacent runs: robust to a shared machine's drifting load); both paths' accuracy (they score
the same work, so they agree); OMP threads, the server's intra-op threads and OpenMP waits (from
its /metrics), load average.

    python bench/openai_eval.py                 # 200 prompts, 3 reps
    python bench/openai_eval.py --task gen      # generate_until instead
    python bench/openai_eval.py --quick         # smoke run: 8 prompts, tiny steps, 1 rep

Targets (2-core CPU): (a) the OpenAI path within 1.2x of the SDK path (SDK prompts/s over
OpenAI prompts/s <= 1.2); (b) the training loop's median step time beside the lm-eval run at
most 1.5x its quiet median. Measured results: docs/benchmarks.md, "Evaluation through the
OpenAI surface beside training".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType

from together.post_training import ModelResourcesClient, SessionClient

from posttrain.config import BUILTIN_MODEL_DIR
from posttrain.demo.loop import (
    POLL_INTERVAL_S,
    DemoConfig,
    Tokens,
    model_input,
    sdk_quiet,
    split_problems,
    warmup_step,
)
from posttrain.demo.server import local_server
from posttrain.demo.task import Problem
from posttrain.engine.hosts.threads import usable_cores

API_KEY = "local-key"
WINDOW_POLL_S = 0.05
MAX_GEN_TOKENS = 4
STOP = ("<|endoftext|>", "\n")  # the stop strings lm-eval sends: the task's `until`


@dataclass(frozen=True)
class Task:
    name: str  # lm-eval's task name
    metric: str
    output_type: str


TASKS = {
    "ll": Task("bench_arith_ll", "acc", "loglikelihood"),
    "gen": Task("bench_arith_gen", "exact_match", "generate_until"),
}
YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: arithmetic.jsonl
test_split: test
output_type: {output_type}
doc_to_text: "<|im_start|>{{{{a}}}}+{{{{b}}}}="
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
{generation}metric_list:
  - metric: {metric}
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
GENERATION = f"""generation_kwargs:
  until: ["<|endoftext|>", "\\n"]
  max_gen_toks: {MAX_GEN_TOKENS}
  temperature: 0
"""


def write_task(directory: Path, task: Task, problems: list[Problem]) -> None:
    """The JSONL of `problems` and the task's yaml, which names the JSONL relative to the
    directory lm-eval runs in."""
    rows = [json.dumps({"a": p.a, "b": p.b, "answer": str(p.a + p.b)}) for p in problems]
    (directory / "arithmetic.jsonl").write_text("\n".join(rows) + "\n")
    text = YAML.format(
        name=task.name,
        output_type=task.output_type,
        metric=task.metric,
        generation=GENERATION if task.output_type == "generate_until" else "",
    )
    (directory / f"{task.name}.yaml").write_text(text)


# ------------------------------------------------------------------ what runs beside the eval


class SampleWindow:
    """From the first sample operation the server stores to the last one finished, from GET
    /metrics every WINDOW_POLL_S while the block runs."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.first: float | None = None
        self.last: float | None = None
        self.operations = 0  # sample operations stored meanwhile
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _counts(self) -> tuple[int, int, int]:
        """Sample operations (stored, completed, failed)."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as response:
            text = response.read().decode()
        pattern = r'^posttrain_operations\{kind="sample",status="(\w+)"\} (\d+)$'
        counts = {status: int(n) for status, n in re.findall(pattern, text, re.M)}
        return sum(counts.values()), counts.get("completed", 0), counts.get("failed", 0)

    def __enter__(self) -> SampleWindow:
        self._stored, self._completed, self._failed = self._counts()
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._done.is_set():
            self._observe()
            time.sleep(WINDOW_POLL_S)

    def _observe(self) -> None:
        now = time.perf_counter()
        stored, completed, failed = self._counts()
        assert failed == self._failed, f"{failed - self._failed} sample operations failed"
        if self.first is None and stored > self._stored:
            self.first = now
        self.operations = stored - self._stored
        if completed != self._completed:
            self._completed, self.last = completed, now

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self._observe()  # whatever finished since the last poll

    @property
    def seconds(self) -> float:
        assert self.first is not None and self.last is not None, "no sample operation ran"
        return max(self.last - self.first, WINDOW_POLL_S)


class TrainingLoop:
    """The demo's warm-up steps on one session, back to back in a thread while the block
    runs; each step's (start, end)."""

    def __init__(self, step: Callable[[], object]) -> None:
        self.step = step
        self.spans: list[tuple[float, float]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                start = time.perf_counter()
                self.step()
                self.spans.append((start, time.perf_counter()))
        except BaseException as exc:  # re-raised in the main thread on exit
            self.error = exc

    def __enter__(self) -> TrainingLoop:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None and exc is None:
            raise self.error

    def overlapping(self, window: SampleWindow) -> list[float]:
        """Durations of the steps that overlap the eval's window (at least the one running
        when it ended)."""
        assert window.first is not None and window.last is not None, "no sample operation ran"
        first, last = window.first, window.last
        return [end - start for start, end in self.spans if start < last and end > first]


# ------------------------------------------------------------------ the two eval paths


@dataclass
class EvalRun:
    prompts_per_s: float
    window_s: float
    operations: int
    wall_s: float
    accuracy: float
    steps_s: list[float]  # the training steps beside it


def lm_eval(
    base_url: str, model: str, directory: Path, task: Task, args: argparse.Namespace
) -> tuple[float, float]:
    """The lm-eval CLI run: (wall seconds, accuracy)."""
    model_args = ",".join(
        (
            f"model={model}",
            f"base_url={base_url}/v1/completions",
            f"tokenizer={BUILTIN_MODEL_DIR}",
            "tokenizer_backend=huggingface",
            f"num_concurrent={args.concurrency}",
            "max_retries=1",
        )
    )
    env = {
        **os.environ,
        "OPENAI_API_KEY": API_KEY,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    results = Path(tempfile.mkdtemp(dir=directory, prefix="results-"))
    command = [
        *(sys.executable, "-m", "lm_eval", "--model", "local-completions"),
        *("--model_args", model_args, "--batch_size", str(args.batch_size)),
        *("--tasks", task.name),
        *("--include_path", str(directory), "--output_path", str(results)),
    ]
    started = time.perf_counter()
    completed = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    if completed.returncode != 0:
        raise RuntimeError(f"lm_eval exited {completed.returncode}: {completed.stderr[-4000:]}")
    (path,) = results.rglob("results_*.json")
    return wall_s, json.loads(path.read_text())["results"][task.name][f"{task.metric},none"]


def sdk_eval(
    session: SessionClient,
    tokens: Tokens,
    problems: list[Problem],
    task: Task,
    args: argparse.Namespace,
) -> float:
    """The same prompts through the SDK's sample: the accuracy lm-eval's metric gives."""
    contexts = [tokens.encode(p.prompt) for p in problems]
    answers = [tokens.encode(str(p.a + p.b)) for p in problems]
    if task.output_type == "loglikelihood":
        prompts = [c + a for c, a in zip(contexts, answers, strict=True)]
        options = {"prompt_logprobs": True, "topk_prompt_logprobs": 1}
        params = {"max_tokens": 1, "temperature": 0.0}
    else:
        prompts = contexts
        options = {}
        params = {"max_tokens": MAX_GEN_TOKENS, "temperature": 0.0, "stop": list(STOP)}
    chunks = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]

    async def run() -> list:
        gate = asyncio.Semaphore(args.concurrency)

        async def one(chunk: list[list[int]]) -> list:
            async with gate:
                return await session.generator.sample_batch_async(
                    [model_input(p) for p in chunk],
                    sampling_params=params,
                    interval=POLL_INTERVAL_S,
                    **options,
                )

        return [r for results in await asyncio.gather(*map(one, chunks)) for r in results]

    results = asyncio.run(run())
    scores = []
    for context, answer, result in zip(contexts, answers, results, strict=True):
        if task.output_type == "loglikelihood":
            positions = range(len(context), len(context) + len(answer))
            top = result.topk_prompt_logprobs
            greedy = all(result.prompt_logprobs[i] == top[i].logprobs[0] for i in positions)
            scores.append(float(greedy))
        else:
            text = tokens.decode([int(t) for t in result.sequences[0].tokens])
            scores.append(float(text.split("\n")[0] == tokens.decode(answer)))
    return sum(scores) / len(scores)


@dataclass(frozen=True)
class Setup:
    """What every run shares: the server, the eval session (lm-eval's `model`), the prompts,
    and the training loop's step."""

    base_url: str
    evaluated: SessionClient
    directory: Path
    task: Task
    tokens: Tokens
    problems: list[Problem]
    train_step: Callable[[], object]


def measured(path: str, setup: Setup, args: argparse.Namespace) -> EvalRun:
    """One eval run with the training loop beside it."""
    with TrainingLoop(setup.train_step) as loop, SampleWindow(setup.base_url) as window:
        started = time.perf_counter()
        if path == "openai":
            wall_s, accuracy = lm_eval(
                setup.base_url, setup.evaluated.session_id, setup.directory, setup.task, args
            )
        else:
            accuracy = sdk_eval(setup.evaluated, setup.tokens, setup.problems, setup.task, args)
            wall_s = time.perf_counter() - started
    return EvalRun(
        len(setup.problems) / window.seconds,
        window.seconds,
        window.operations,
        wall_s,
        accuracy,
        loop.overlapping(window),
    )


def warm_up(setup: Setup, args: argparse.Namespace) -> None:
    """One untimed request down each path: the server loads the tokenizer and builds what the
    first OpenAI request of a model needs."""
    body = {"model": setup.evaluated.session_id, "prompt": setup.problems[0].prompt}
    if setup.task.output_type == "loglikelihood":
        body |= {"max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    else:
        body |= {"max_tokens": MAX_GEN_TOKENS, "temperature": 0, "stop": list(STOP)}
    request = urllib.request.Request(
        f"{setup.base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200, response.read()
    sdk_eval(setup.evaluated, setup.tokens, setup.problems[:1], setup.task, args)


def server_threads(base_url: str) -> str:
    """The server's own account of its engine threads and how idle ones wait (GET /metrics),
    whatever rule chose them."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.search(r'^posttrain_engine_threads\{wait_policy="([^"]*)"\} (\d+)$', text, re.M)
    assert found is not None, "the server's /metrics has no posttrain_engine_threads"
    return f"server intra-op threads {found.group(2)}, OpenMP waits {found.group(1)}"


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=tuple(TASKS), default="ll", help="ll or gen")
    parser.add_argument("--prompts", type=int, default=200, help="prompts lm-eval scores")
    parser.add_argument("--concurrency", type=int, default=8, help="lm-eval num_concurrent")
    parser.add_argument("--batch-size", type=int, default=1, help="lm-eval batch_size")
    parser.add_argument("--steps", type=int, default=20, help="quiet training steps per rep")
    parser.add_argument("--train-batch", type=int, default=64, help="problems a training step")
    parser.add_argument("--setup-steps", type=int, default=40, help="steps before the checkpoint")
    parser.add_argument("--reps", type=int, default=3, help="repetitions")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, one rep")
    args = parser.parse_args()
    # A SIGTERM unwinds like Ctrl-C, so the server is stopped, not orphaned.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.quick:
        args.prompts, args.steps, args.train_batch, args.setup_steps, args.reps = 8, 2, 8, 1, 1
    config = replace(DemoConfig(), warmup_batch_size=args.train_batch, seed=0)
    task = TASKS[args.task]
    what = (
        "echo, max_tokens 1, logprobs 1, temperature 0"
        if task.output_type == "loglikelihood"
        else f"greedy, max_tokens {MAX_GEN_TOKENS}, stop at end of line"
    )
    tokens = Tokens(config.base_model)
    train, heldout = split_problems(config.seed, max(args.prompts, config.num_heldout))
    problems = heldout[: args.prompts]
    rng = random.Random(1)
    lora = {"rank": config.lora_rank, "alpha": config.lora_alpha, "seed": config.seed}
    with (
        tempfile.TemporaryDirectory(prefix="openai-eval-") as scratch,
        local_server() as base_url,
    ):
        omp = os.environ.get("OMP_NUM_THREADS", "unset")
        print(
            f"usable cores {usable_cores()}, OMP_NUM_THREADS={omp}, {server_threads(base_url)};"
            f" load average at start {os.getloadavg()[0]:.2f}"
        )
        print(
            f"task {task.output_type} ({what}): {args.prompts} prompts, lm-eval num_concurrent"
            f" {args.concurrency}, batch_size {args.batch_size}; training beside it: warm-up"
            f" steps of {args.train_batch} problems; {args.reps} repetitions",
            flush=True,
        )
        directory = Path(scratch)
        write_task(directory, task, problems)
        with sdk_quiet():
            resources = ModelResourcesClient.create(
                base_url=base_url, api_key=API_KEY, base_model=config.base_model, interval=0.2
            )
            trained = resources.create_session(lora_config=lora, interval=0.2)

            def train_step() -> object:
                return warmup_step(trained, tokens, rng.sample(train, args.train_batch), config)

            for _ in range(args.setup_steps):
                train_step()
            checkpoint = trained.create_training_checkpoint(interval=POLL_INTERVAL_S)
            evaluated = resources.create_session(
                resume_from_checkpoint_id=checkpoint.id, load_optimizer=False, interval=0.2
            )
            evaluated.trainer.weights_sync(interval=POLL_INTERVAL_S)
        setup = Setup(base_url, evaluated, directory, task, tokens, problems, train_step)
        warm_up(setup, args)
        quiet: list[float] = []
        runs: dict[str, list[EvalRun]] = {"openai": [], "sdk": []}
        for rep in range(args.reps):
            steps = []
            for _ in range(args.steps):
                started = time.perf_counter()
                train_step()
                steps.append(time.perf_counter() - started)
            quiet.append(statistics.median(steps))
            for path in ("openai", "sdk") if rep % 2 == 0 else ("sdk", "openai"):
                runs[path].append(measured(path, setup, args))
            oai, sdk = runs["openai"][-1], runs["sdk"][-1]
            print(
                f"rep {rep}: openai {oai.prompts_per_s:.1f} prompts/s (window {oai.window_s:.2f}"
                f" s, {oai.operations} operations, lm-eval wall {oai.wall_s:.1f} s,"
                f" {task.metric} {oai.accuracy:.3f}), sdk {sdk.prompts_per_s:.1f} prompts/s"
                f" (window {sdk.window_s:.2f} s, {sdk.operations} operations,"
                f" {task.metric} {sdk.accuracy:.3f}); training step {quiet[-1]:.3f} s quiet,"
                f" {statistics.median(oai.steps_s):.3f} s beside lm-eval"
                f" ({len(oai.steps_s)} steps), {statistics.median(sdk.steps_s):.3f} s beside"
                f" sdk ({len(sdk.steps_s)} steps)",
                flush=True,
            )
    oai_runs, sdk_runs = runs["openai"], runs["sdk"]
    beside = [statistics.median(r.steps_s) for r in oai_runs]
    print(
        f"medians: openai {statistics.median(r.prompts_per_s for r in oai_runs):.1f} prompts/s,"
        f" sdk {statistics.median(r.prompts_per_s for r in sdk_runs):.1f} prompts/s; training"
        f" step {statistics.median(quiet):.3f} s quiet, {statistics.median(beside):.3f} s"
        " beside lm-eval"
    )
    throughput = median_ratio(
        [r.prompts_per_s for r in sdk_runs], [r.prompts_per_s for r in oai_runs]
    )
    print(f"ratio sdk/openai prompts/s: {throughput:.2f}x (target <= 1.20x)")
    print(f"ratio training step beside lm-eval/quiet: {median_ratio(beside, quiet):.2f}x"
          " (target <= 1.50x)")  # fmt: skip
    agree = all(o.accuracy == s.accuracy for o, s in zip(oai_runs, sdk_runs, strict=True))
    print(f"accuracy: openai and sdk {'agree' if agree else 'DIFFER'}")
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
