"""Multi-LoRA throughput: N sessions on one model resource, concurrently vs one at a time
(issue 6; a benchmark, not a timed test).

Starts a real `posttrain serve` (posttrain/demo/server.py) and drives it through the together
SDK, as a client would: one model resource, --sessions LoRA sessions (rank 8, distinct seeds).
Each session's workload, in two separate phases so each ratio is clean:

- forward-backward phase: --rounds rounds of one forward-backward (cross-entropy, --batch
  samples of --seq-tokens input tokens, fixed random tokens of the model's vocabulary, one
  fixed batch per session) and one optim-step (AdamW);
- sampling phase: --rounds sample operations of --prompts prompts (--prompt-tokens random
  tokens each) x --samples completions, up to --new-tokens new tokens, temperature 1, a fixed
  seed per session and round (so both modes generate the same tokens).

Concurrent: one thread per session, all released at once, each driving its own session's
operations through the SDK; the scheduler may run queued operations of several sessions in one
shared engine pass (service/scheduling/scheduler.py). Sequential: the same operations,
session 1's first,
then session 2's, ... Both modes run on fresh sessions of the same resource (the previous
mode's sessions are stopped first). Polling intervals are small (--interval) so the SDK's
polling latency does not dominate; the price is that 8 sessions polling at once cost the
server CPU (each GET of an operation takes milliseconds of server CPU on this machine), which
the CPU seconds printed per phase show; compare --interval 0.2.

Forward-backward tokens/s = trained input tokens / wall time of the phase (optim-steps
included); sampling tokens/s = generated tokens / wall time of the phase (prompts excluded).
Prints the median over --reps repetitions (after one untimed warm-up of each mode), the ratio
concurrent / sequential of the medians, and from the server's /metrics how many operations ran
in shared passes (posttrain_shared_pass_operations_total delta) in how many passes. To show
what bounds the ratio it also prints the round trip of an operation that computes nothing,
the CPU seconds of the server process and of this process per phase, and the share of the
sequential phases' wall time the engine spent running operations (the run-time histogram of
/metrics): on a CPU a shared pass costs about what its sessions' passes cost apart, so the
concurrent mode can at most hide the rest, and the ratio is at most about 1 / that share.

Memory is measured in one place, bench/session_memory.py (its shared-pass section runs the
same sessions and batch at engine level); this script measures throughput only.

    python bench/multilora.py                    # built-in posttrain/tiny-qwen3, ~2 min on 2 CPUs
    python bench/multilora.py --quick            # smoke run, seconds
    python bench/multilora.py --model PATH       # another local Hugging Face model directory

At most 8 sessions: the server's max_sessions_per_resource.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from together.post_training import ModelResourcesClient, SessionClient

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID
from posttrain.demo.server import local_server

API_KEY = "bench-key"
RANK = 8
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
ADAM = {"learning_rate": 1e-4}
FIRST_TOKEN = 3  # below: end-of-text, begin-of-text, padding in the built-in vocabulary
MODES = ("sequential", "concurrent")


@dataclass(frozen=True)
class Workload:
    rounds: int
    batch: int
    seq_tokens: int
    prompts: int
    prompt_tokens: int
    samples: int
    new_tokens: int
    interval: float


@dataclass
class Phase:
    """One timed phase of one mode: tokens pushed, wall seconds, what /metrics saw."""

    tokens: int
    seconds: float
    shared_passes: float
    shared_operations: float
    engine_seconds: float  # summed operation run times (see engine_seconds)
    server_cpu: float  # CPU seconds of the server process during the phase
    client_cpu: float  # CPU seconds of this process (the SDK and its threads)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


# ------------------------------------------------------------------ the workload


def random_tokens(rng: random.Random, vocab: int, count: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(count)]


def training_batch(seed: int, vocab: int, work: Workload) -> list[dict]:
    """--batch cross-entropy samples of --seq-tokens input tokens, every target weighted 1."""
    rng = random.Random(1000 + seed)
    batch = []
    for _ in range(work.batch):
        tokens = random_tokens(rng, vocab, work.seq_tokens + 1)
        batch.append(
            {
                "model_input": {"chunks": [{"encoded_text": {"tokens": tokens[:-1]}}]},
                "loss_fn_inputs": {
                    "target_tokens": {"data": tokens[1:], "dtype": "int64"},
                    "weights": {"data": [1.0] * work.seq_tokens, "dtype": "float32"},
                },
            }
        )
    return batch


def prompt_batch(seed: int, vocab: int, work: Workload) -> list[dict]:
    rng = random.Random(2000 + seed)
    return [
        {"chunks": [{"encoded_text": {"tokens": random_tokens(rng, vocab, work.prompt_tokens)}}]}
        for _ in range(work.prompts)
    ]


def train_rounds(session: SessionClient, batch: list[dict], work: Workload) -> int:
    for _ in range(work.rounds):
        session.trainer.forward_backward(samples=batch, loss=CE, interval=work.interval)
        session.trainer.optim_step(adam_params=ADAM, interval=work.interval)
    return work.rounds * work.batch * work.seq_tokens


def sample_rounds(session: SessionClient, index: int, prompts: list[dict], work: Workload) -> int:
    generated = 0
    for round_ in range(work.rounds):
        params = {
            "max_tokens": work.new_tokens,
            "temperature": 1.0,
            "seed": 100 * index + round_,
            "stop": [],
        }
        results = session.generator.sample_batch(
            prompts, num_samples=work.samples, sampling_params=params, interval=work.interval
        )
        generated += sum(len(s.tokens) for r in results for s in r.sequences)
    return generated


def concurrently(jobs: list[Callable[[], int]]) -> tuple[int, float]:
    """Run each job on its own thread, all released at once; total of their results, seconds."""
    barrier = threading.Barrier(len(jobs) + 1)
    results: list[int | BaseException] = [0] * len(jobs)

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = jobs[index]()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return sum(results), seconds  # type: ignore[arg-type]


def one_at_a_time(jobs: list[Callable[[], int]]) -> tuple[int, float]:
    start = time.perf_counter()
    total = sum(job() for job in jobs)
    return total, time.perf_counter() - start


# ------------------------------------------------------------------ the server side


def metrics(base_url: str) -> dict[str, float]:
    """The server's /metrics samples, keyed by name with labels."""
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def engine_seconds(values: dict[str, float], kinds: tuple[str, ...]) -> float:
    """Summed run time of the operations of `kinds` (an operation in a shared pass is charged
    the whole pass, so this is exact only where passes are not shared)."""
    return sum(
        values.get(f'posttrain_operation_duration_seconds_sum{{kind="{kind}"}}', 0.0)
        for kind in kinds
    )


def server_pid() -> int | None:
    """The `posttrain serve` child of this process (local_server does not expose it)."""
    for children in Path("/proc/self/task").glob("*/children"):
        for pid in children.read_text().split():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"serve" in cmdline and b"posttrain" in cmdline:
                return int(pid)
    return None


def cpu_seconds(pid: int | None) -> tuple[float, float]:
    """CPU seconds (user + system) used so far by the server process and by this process."""
    server = 0.0
    if pid is not None:
        # Fields 14 and 15 of /proc/PID/stat, after the parenthesised command name.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        server = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    times = os.times()
    return server, times.user + times.system


def open_sessions(resources: ModelResourcesClient, count: int) -> list[SessionClient]:
    def create(index: int) -> SessionClient:
        return resources.create_session(lora_config={"rank": RANK, "seed": index}, interval=0.05)

    # The SDK prints each session's creation progress; keep the report readable.
    with ThreadPoolExecutor(count) as pool, contextlib.redirect_stdout(io.StringIO()):
        return list(pool.map(create, range(count)))


def stop_sessions(sessions: list[SessionClient]) -> None:
    with ThreadPoolExecutor(len(sessions)) as pool:
        list(pool.map(lambda s: s.stop(), sessions))


def round_trip(resources: ModelResourcesClient, interval: float, count: int = 20) -> float:
    """Median seconds of an operation that computes nothing (an optim-step without gradients):
    the SDK's submit and polling, the HTTP handlers, the store and the worker queue."""
    (session,) = open_sessions(resources, 1)
    try:
        times = []
        for _ in range(count):
            start = time.perf_counter()
            session.trainer.optim_step(adam_params=ADAM, interval=interval)
            times.append(time.perf_counter() - start)
    finally:
        stop_sessions([session])
    return statistics.median(times)


def run_mode(
    base_url: str,
    resources: ModelResourcesClient,
    mode: str,
    vocab: int,
    num_sessions: int,
    work: Workload,
) -> dict[str, Phase]:
    """Both phases of one mode on fresh sessions; the sessions are stopped afterwards."""
    sessions = open_sessions(resources, num_sessions)
    pid = server_pid()
    batches = [training_batch(i, vocab, work) for i in range(num_sessions)]
    prompts = [prompt_batch(i, vocab, work) for i in range(num_sessions)]
    drive = concurrently if mode == "concurrent" else one_at_a_time
    phases = {}
    try:
        for phase, kinds, job in (
            (
                "forward-backward",
                ("forward-backward", "optim-step"),
                lambda i: train_rounds(sessions[i], batches[i], work),
            ),
            ("sample", ("sample",), lambda i: sample_rounds(sessions[i], i, prompts[i], work)),
        ):
            before = metrics(base_url)
            cpu_before = cpu_seconds(pid)
            jobs = [lambda i=i, job=job: job(i) for i in range(num_sessions)]
            tokens, seconds = drive(jobs)
            cpu_after = cpu_seconds(pid)
            after = metrics(base_url)
            phases[phase] = Phase(
                tokens,
                seconds,
                after["posttrain_shared_passes_total"] - before["posttrain_shared_passes_total"],
                after["posttrain_shared_pass_operations_total"]
                - before["posttrain_shared_pass_operations_total"],
                engine_seconds(after, kinds) - engine_seconds(before, kinds),
                cpu_after[0] - cpu_before[0],
                cpu_after[1] - cpu_before[1],
            )
    finally:
        stop_sessions(sessions)
    return phases


def throughput(
    model_dir: Path, base_model: str, extra_args: tuple[str, ...], args: argparse.Namespace
) -> None:
    work = Workload(
        args.rounds,
        args.batch,
        args.seq_tokens,
        args.prompts,
        args.prompt_tokens,
        args.samples,
        args.new_tokens,
        args.interval,
    )
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    threads = os.environ.get("OMP_NUM_THREADS", f"unset, torch uses {torch.get_num_threads()}")
    print(
        f"{args.sessions} LoRA sessions (rank {RANK}) on one {base_model} resource; rounds per"
        f" session and phase: {work.rounds}; server OMP_NUM_THREADS: {threads}"
    )
    print(f"  forward-backward phase: {work.batch} x {work.seq_tokens} tokens (CE), optim-step")
    print(
        f"  sample phase: {work.prompts} prompts x {work.prompt_tokens} tokens x {work.samples}"
        f" samples, up to {work.new_tokens} new tokens; SDK polling every {work.interval}s"
    )
    results: dict[str, dict[str, list[Phase]]] = {mode: {} for mode in MODES}
    with local_server(extra_args=extra_args) as base_url:
        with contextlib.redirect_stdout(io.StringIO()):
            resources = ModelResourcesClient.create(
                base_url=base_url, api_key=API_KEY, base_model=base_model, interval=0.05
            )
        try:
            overhead = round_trip(resources, work.interval)
            print(
                "  one operation without compute (optim-step, no gradients):"
                f" {overhead * 1e3:.1f} ms round trip"
            )
            warm = Workload(**{**work.__dict__, "rounds": 1})
            for mode in MODES:
                run_mode(base_url, resources, mode, vocab, args.sessions, warm)
            for rep in range(args.reps):
                # Alternate which mode goes first, so a drift in machine load hits both.
                for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                    phases = run_mode(base_url, resources, mode, vocab, args.sessions, work)
                    for name, phase in phases.items():
                        results[mode].setdefault(name, []).append(phase)
                    for name, p in phases.items():
                        print(
                            f"rep {rep + 1} {mode:<10} {name:<16} {p.rate:6.0f} tok/s"
                            f" {p.seconds:6.2f} s  shared {p.shared_operations:2.0f} ops in"
                            f" {p.shared_passes:2.0f} passes  CPU s: server {p.server_cpu:5.2f}"
                            f" client {p.client_cpu:5.2f}",
                            flush=True,
                        )
        finally:
            resources.stop(force=True)
    summary(results, args.sessions * args.rounds)


def summary(results: dict[str, dict[str, list[Phase]]], operations_per_phase: int) -> None:
    print()
    print(f"{'medians':<18}{'sequential':>14}{'concurrent':>14}{'ratio':>8}")
    for name in ("forward-backward", "sample"):
        seq = statistics.median(p.rate for p in results["sequential"][name])
        conc = statistics.median(p.rate for p in results["concurrent"][name])
        print(f"{name:<18}{seq:>10.0f} t/s{conc:>10.0f} t/s{conc / seq:>7.2f}x")
    print()
    for name in ("forward-backward", "sample"):
        concurrent = results["concurrent"][name]
        operations = sum(p.shared_operations for p in concurrent)
        passes = sum(p.shared_passes for p in concurrent)
        total = len(concurrent) * operations_per_phase
        mean = operations / passes if passes else 0.0
        sequential = results["sequential"][name]
        busy = sum(p.engine_seconds for p in sequential) / sum(p.seconds for p in sequential)
        alone = sum(p.shared_operations for p in sequential)
        print(
            f"{name}: concurrent, {operations:.0f} of {total} {name} operations ran in"
            f" {passes:.0f} shared passes ({mean:.1f} per pass); sequential ({alone:.0f} shared),"
            f" the engine ran operations {busy:.0%} of the phase's wall time"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=8, help="LoRA sessions (at most 8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per session and phase")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="samples per forward-backward")
    parser.add_argument("--seq-tokens", type=int, default=128, help="tokens per training sample")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per sample operation")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=16, help="max new tokens")
    parser.add_argument("--interval", type=float, default=0.02, help="SDK polling interval (s)")
    parser.add_argument("--model", type=Path, default=None, help="another local HF model dir")
    parser.add_argument("--quick", action="store_true", help="tiny settings for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.reps, args.seq_tokens, args.new_tokens = 1, 1, 32, 8
    if not 1 <= args.sessions <= 8:
        parser.error("--sessions must be 1..8 (the server's max_sessions_per_resource)")
    torch.manual_seed(0)
    if args.model is None:
        model_dir, base_model, extra_args = BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, ()
    else:
        # `posttrain serve --model PATH` lists the model under its directory name.
        model_dir = args.model.expanduser().resolve()
        base_model, extra_args = model_dir.name, ("--model", str(model_dir))
    throughput(model_dir, base_model, extra_args, args)


if __name__ == "__main__":
    main()
