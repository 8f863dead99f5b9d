"""The same SL and RL training loops through the tinker 0.38 SDK on posttrain's Tinker surface
(/api/v1) and through the Together SDK's tinker shim on its Together surface (/v1/rl): seconds
per step of each, their ratio, and how much of the tinker client's wall time the engine is busy
(a benchmark, not a timed test).

One real `posttrain serve` per model serves both clients, each at its SDK's default settings
(polling, retries, chunking; tinker's telemetry too, which the server acknowledges and drops):

- tinker: tinker==0.38.0 in its own interpreter (tests/tinker_env.py builds `.venv-tinker`; the
  Together SDK pins tinker 0.23.1, so the two cannot share a process), running
  bench/tinker_loop_client.py as a subprocess that times each step itself and reports JSON.
- together: together==3.1.1's `together.post_training.tinker` shim (the tinker 0.23.1 API), in
  this process; its ServiceClient provisions a model resource per training client.

Each side has one LoRA training run (rank 8) per loop, and both get the same token ids:

1. sl: forward_backward (cross_entropy, 8 datums of 128 random tokens, weight 1 on every
   token) and optim_step submitted back to back, then both awaited.
2. rl: save_weights_and_get_sampling_client (a sampler of the current weights; tinker's
   default kind is "snapshot"), then 8 prompts (16 random tokens) sampled as 8 futures of
   num_samples=4, up to 16 new tokens at temperature 1, all submitted before the first is
   awaited; then forward_backward (importance_sampling with the sampled logprobs and
   group-relative advantages of bench/sdk_loops.py's toy reward, the prompt positions zero)
   and optim_step, submitted back to back and awaited.

The two clients are two users of the server (a keys file), so the /metrics and the dashboard
tell their objects apart; the Tinker surface provisions its own resources either way.

Per loop: one untimed warm-up step of each client, then --reps repetitions of --steps steps of
each, the order of the two clients alternating between repetitions. Printed: every run, then
per loop the median seconds per step of each client (over all its steps), the ratio
tinker/together (ratio of medians, and the median of per-repetition ratios, whose runs are
adjacent in time), the tokens sampled per step (the same work on both sides), the tinker SDK's
try_again retries, and the engine's busy time as a share of each client's wall time: the delta
over a run of `posttrain_worker_busy_seconds_total` on GET /metrics (seconds the resource
worker threads spent running jobs, summed over its labels) over that run's wall time (the
fallback of bench/sdk_loops.py applies where the server lacks the counter).

Targets: tinker/together <= 1.15 (seconds per step) on both loops; engine busy >= 80% of the
tinker client's wall time on qwen3-40m.

Models: `tiny` is the built-in posttrain/tiny-qwen3; `qwen3-40m` the random 38M-parameter Qwen3
of bench/sampling.py (seed 0), saved to a temporary directory and served with `--model DIR`.

    OMP_NUM_THREADS=1 python bench/tinker_loops.py         # both models
    python bench/tinker_loops.py --models qwen3-40m --reps 5 --server-log /tmp/tl.log
    python bench/tinker_loops.py --quick                   # smoke run

--quick: the tiny model, 1 step x 1 repetition, small shapes (its numbers say nothing; it
checks the script runs). --server-log keeps the server's output at --log-level info, where
every engine pass logs its time. The server and the tinker client inherit this process's
environment, OMP_NUM_THREADS included.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import together.post_training.tinker as shim
import torch
from sdk_loops import (
    ADAM,
    API_KEY,
    BUSY_COUNTER,
    RANK,
    BusyProbe,
    policy_inputs,
    random_tokens,
    served_model,
    toy_reward,
)

from posttrain.demo.server import started_server

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "tests"))
from tinker_env import ensure_tinker_env  # noqa: E402  (tests/, put on the path above)

CLIENT = BENCH / "tinker_loop_client.py"
TINKER_KEY = "tml-bench-key"  # the tinker SDK sends keys that start with tml-
LOOPS = ("sl", "rl")
SEED = 2


@dataclass(frozen=True)
class Sizes:
    sl_datums: int
    sl_tokens: int
    rl_prompts: int
    rl_prompt_tokens: int
    rl_samples: int
    rl_new_tokens: int


FULL = Sizes(sl_datums=8, sl_tokens=128, rl_prompts=8, rl_prompt_tokens=16, rl_samples=4,
             rl_new_tokens=16)  # fmt: skip
QUICK = Sizes(sl_datums=2, sl_tokens=16, rl_prompts=2, rl_prompt_tokens=8, rl_samples=2,
              rl_new_tokens=4)  # fmt: skip


@dataclass(frozen=True)
class Work:
    """The token ids both clients train and sample on."""

    sl_tokens: list[list[int]]  # each sl_tokens + 1 long: inputs [:-1], targets [1:]
    rl_prompts: list[list[int]]
    sizes: Sizes

    @classmethod
    def random(cls, vocab: int, sizes: Sizes) -> Work:
        rng = random.Random(0)
        sl = [random_tokens(rng, vocab, sizes.sl_tokens + 1) for _ in range(sizes.sl_datums)]
        rl = [random_tokens(rng, vocab, sizes.rl_prompt_tokens) for _ in range(sizes.rl_prompts)]
        return cls(sl, rl, sizes)


@dataclass(frozen=True)
class Run:
    """Some steps of one loop by one client."""

    seconds: list[float]  # per step, as the client timed it
    sampled_tokens: list[int]  # per step (0 in sl)
    try_again: int = 0  # the tinker SDK's retrieve_future retries
    busy_seconds: float = 0.0

    @property
    def wall(self) -> float:
        return sum(self.seconds)

    @property
    def per_step(self) -> float:
        return self.wall / len(self.seconds)

    @property
    def busy_share(self) -> float:
        return self.busy_seconds / self.wall


class Client(Protocol):
    name: str

    def run(self, loop: str, steps: int) -> Run: ...


# ------------------------------------------------------------------ together (the shim)


class TogetherClient:
    """The shim's TrainingClients in this process, one per loop."""

    name = "together"

    def __init__(self, base_url: str, base_model: str, work: Work) -> None:
        self.work = work
        service = shim.ServiceClient(base_url=base_url, api_key=API_KEY)
        with contextlib.redirect_stdout(io.StringIO()):  # provisioning progress
            self.runs = {
                name: service.create_lora_training_client(base_model, rank=RANK, seed=SEED + i)
                for i, name in enumerate(LOOPS)
            }
        self.sl_data = [
            shim.Datum(
                model_input=shim.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "weights": [1.0] * (len(tokens) - 1),
                },
            )
            for tokens in work.sl_tokens
        ]
        self.adam = shim.AdamParams(learning_rate=ADAM["learning_rate"])
        sizes = work.sizes
        self.params = shim.SamplingParams(max_tokens=sizes.rl_new_tokens, temperature=1.0)

    def run(self, loop: str, steps: int) -> Run:
        step = self.sl_step if loop == "sl" else self.rl_step
        seconds, sampled = [], []
        for _ in range(steps):
            start = time.perf_counter()
            sampled.append(step())
            seconds.append(time.perf_counter() - start)
        return Run(seconds, sampled)

    def sl_step(self) -> int:
        training = self.runs["sl"]
        forward_backward = training.forward_backward(self.sl_data, "cross_entropy")
        optim_step = training.optim_step(self.adam)
        forward_backward.result()
        optim_step.result()
        return 0

    def rl_step(self) -> int:
        training = self.runs["rl"]
        sampler = training.save_weights_and_get_sampling_client()
        futures = [
            sampler.sample(
                shim.ModelInput.from_ints(prompt),
                num_samples=self.work.sizes.rl_samples,
                sampling_params=self.params,
            )
            for prompt in self.work.rl_prompts
        ]
        data, sampled = [], 0
        for prompt, future in zip(self.work.rl_prompts, futures, strict=True):
            sequences = future.result().sequences
            completions = [[int(t) for t in s.tokens] for s in sequences]
            rewards = [toy_reward(tokens) for tokens in completions]
            mean = sum(rewards) / len(rewards)
            for sequence, tokens, reward in zip(sequences, completions, rewards, strict=True):
                logprobs = [float(lp) for lp in sequence.logprobs]
                inputs, loss_fn_inputs = policy_inputs(prompt, tokens, logprobs, reward - mean)
                data.append(
                    shim.Datum(
                        model_input=shim.ModelInput.from_ints(inputs),
                        loss_fn_inputs=loss_fn_inputs,
                    )
                )
                sampled += len(tokens)
        forward_backward = training.forward_backward(data, "importance_sampling")
        optim_step = training.optim_step(self.adam)
        forward_backward.result()
        optim_step.result()
        return sampled

    def close(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            for training in self.runs.values():
                training.close()


# ------------------------------------------------------------------ tinker 0.38 (subprocess)


class TinkerClient:
    """bench/tinker_loop_client.py in the tinker 0.38 interpreter, one JSON line each way."""

    name = "tinker"

    def __init__(self, python: Path, base_url: str, base_model: str, work: Work, log: Path):
        self._log = log.open("wb")
        self.process = subprocess.Popen(
            [str(python), str(CLIENT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        sizes = work.sizes
        self.ready = self._ask(
            {
                "url": base_url,
                "api_key": TINKER_KEY,
                "base_model": base_model,
                "rank": RANK,
                "seed": SEED,
                "learning_rate": ADAM["learning_rate"],
                "sl_tokens": work.sl_tokens,
                "rl_prompts": work.rl_prompts,
                "num_samples": sizes.rl_samples,
                "max_tokens": sizes.rl_new_tokens,
            }
        )

    def _ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            self._log.flush()
            tail = Path(self._log.name).read_text(errors="replace")[-4000:]
            raise RuntimeError(f"the tinker client exited ({self.process.wait()}):\n{tail}")
        return json.loads(line)

    def run(self, loop: str, steps: int) -> Run:
        answer = self._ask({"loop": loop, "steps": steps})
        return Run(answer["seconds"], answer["sampled_tokens"], answer["try_again"])

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps({"quit": True}) + "\n")
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


# ------------------------------------------------------------------ measuring


def timed(client: Client, loop: str, steps: int, probe: BusyProbe) -> Run:
    busy_before = probe.read()
    run = client.run(loop, steps)
    return Run(run.seconds, run.sampled_tokens, run.try_again, probe.read() - busy_before)


def bench_loop(
    loop: str, clients: tuple[Client, Client], args: argparse.Namespace, probe: BusyProbe
) -> str:
    """Both clients (tinker first) on one loop; the summary line."""
    for client in clients:
        client.run(loop, 1)  # warm-up
    runs: dict[str, list[Run]] = {client.name: [] for client in clients}
    for rep in range(args.reps):
        for client in clients if rep % 2 == 0 else clients[::-1]:
            run = timed(client, loop, args.steps, probe)
            runs[client.name].append(run)
            print(
                f"  rep {rep + 1} {loop} {client.name:<8} {run.per_step:7.3f} s/step"
                f"  {probe.label} {run.busy_share:4.0%}"
                f"  sampled {statistics.mean(run.sampled_tokens):.0f} tokens/step"
                + (f"  try_again {run.try_again}" if client.name == "tinker" else ""),
                flush=True,
            )
    tinker, together = runs["tinker"], runs["together"]
    step = {name: statistics.median(s for r in of for s in r.seconds) for name, of in runs.items()}
    busy = {name: statistics.median(r.busy_share for r in of) for name, of in runs.items()}
    sampled = {
        name: statistics.mean(t for r in of for t in r.sampled_tokens) for name, of in runs.items()
    }
    paired = statistics.median(
        a.per_step / b.per_step for a, b in zip(tinker, together, strict=True)
    )
    return (
        f"{args.label} {loop}  tinker {step['tinker']:.3f} s/step  together"
        f" {step['together']:.3f} s/step  ratio tinker/together"
        f" {step['tinker'] / step['together']:.2f}x (paired {paired:.2f}x; target <= 1.15)"
        f"  {probe.label} {busy['tinker']:.0%} tinker (target >= 80% on qwen3-40m),"
        f" {busy['together']:.0%} together  sampled tokens/step {sampled['tinker']:.0f} tinker,"
        f" {sampled['together']:.0f} together  try_again {sum(r.try_again for r in tinker)}"
    )


@contextlib.contextmanager
def server_for(name: str, args: argparse.Namespace) -> Iterator[tuple[str, str, int]]:
    """(base URL, base model, vocabulary size) of a `posttrain serve` of --models `name`."""
    log_path = None
    extra: tuple[str, ...] = ()
    if args.server_log is not None:
        log_path = Path(f"{args.server_log}.{name}")
        log_path.unlink(missing_ok=True)  # the server appends
        extra = ("--log-level", "info")
    with (
        tempfile.TemporaryDirectory(prefix="tinker-loops-") as scratch,
        served_model(name) as (base_model, model_args, vocab),
    ):
        keys = Path(scratch) / "keys"
        keys.write_text(f"{TINKER_KEY} tinker-user\n{API_KEY} together-user\n")
        extra = (*model_args, "--keys-file", str(keys), *extra)
        with started_server(log_path=log_path, extra_args=extra) as server:
            yield server.base_url, base_model, vocab


def bench_model(name: str, python: Path, args: argparse.Namespace) -> list[str]:
    """Both loops through both clients on one server; their summary lines."""
    with server_for(name, args) as (base_url, base_model, vocab):
        work = Work.random(vocab, args.sizes)
        client_log = Path(f"{args.server_log or '/tmp/tinker-loops'}.{name}.client.log")
        tinker = TinkerClient(python, base_url, base_model, work, client_log)
        together = None
        try:
            together = TogetherClient(base_url, base_model, work)
            probe = BusyProbe.detect(base_url)
            source = probe.family
            if probe.is_fallback:
                source += f" (FALLBACK: the server has no {BUSY_COUNTER})"
            print(
                f"\n{name} ({base_model}); tinker {tinker.ready['tinker']} runs"
                f" {', '.join(tinker.ready['runs'].values())}; engine busy time from {source};"
                f" tinker client log {client_log}",
                flush=True,
            )
            args.label = name
            return [bench_loop(loop, (tinker, together), args, probe) for loop in LOOPS]
        finally:
            tinker.close()
            if together is not None:
                together.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=["tiny", "qwen3-40m"],
        help="default: tiny qwen3-40m (--quick: tiny)",
    )
    parser.add_argument("--steps", type=int, help="measured steps per run (3; --quick: 1)")
    parser.add_argument("--reps", type=int, help="repetitions of each client (3; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="smoke run: see above")
    parser.add_argument("--server-log", help="keep the server's output (at info) in PATH.MODEL")
    parser.add_argument(
        "--tinker-python",
        type=Path,
        help="a python with tinker 0.38 (default: tests/tinker_env.py's .venv-tinker, built"
        " on first use)",
    )
    args = parser.parse_args()
    quick = {"models": ["tiny"], "steps": 1, "reps": 1}
    full = {"models": ["tiny", "qwen3-40m"], "steps": 3, "reps": 3}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.sizes = QUICK if args.quick else FULL
    python = args.tinker_python or ensure_tinker_env()
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(
        f"torch {torch.__version__}; OMP_NUM_THREADS={threads}, torch threads in this process"
        f" {torch.get_num_threads()} (the server and the tinker client inherit the environment)"
    )
    print(f"steps per run {args.steps}, repetitions {args.reps}, sizes {args.sizes}")
    print(f"clients: tinker = tinker 0.38 on /api/v1 ({python}); together = the together SDK's"
          " tinker shim on /v1/rl; both at their SDK defaults")  # fmt: skip
    summary = []
    for name in args.models:
        summary += bench_model(name, python, args)
    print("\nmedians")
    for line in summary:
        print(line)


if __name__ == "__main__":
    main()
