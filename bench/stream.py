"""A stream of one-sample operations against the built-in sampler (a benchmark, not a timed test).

A real `posttrain serve` (posttrain/demo/server.py) on the built-in posttrain/tiny-qwen3 or the
38M random Qwen3 of bench/sampling.py (`qwen3-40m`, saved as bench/sdk_loops.py saves it), driven
through the together SDK's low-level client (`Together(...).post_training.operations`): each
operation is a POST, then GETs (held polls: the GET that sees it terminal returns at once) until
it is terminal, one client thread per operation. The sampler today batches what is queued when a
generation starts and runs that batch to its end, so operations that arrive meanwhile wait; these
numbers are the baseline of continuous batching (operations joining a running generation).

- **Stream**: --ops one-sample operations (--prompt-tokens fresh random tokens each, up to
  --new-tokens new tokens, temperature 1, seed = its index), arriving at a fixed rate
  (`steady`) or in bursts of --burst at once at the same mean rate (`burst`). Rates are
  --loads x the one-at-a-time rate (1 / the median latency of one such operation alone), so
  they mean the same on any machine (--base-rate fixes the rate of 1x instead, so two runs,
  e.g. today's sampler and the joining one, get the same arrivals); the ops/s offered is
  printed too. Per load and pattern:
  completed operations/s (ops / (last result - first submit)), latency submit -> result
  (median and p90 over all operations of all repetitions), and the ratio of completed ops/s to
  `ideal` (ops / (last arrival + one op's solo latency): a server that answers every operation
  in its solo time, never queueing; bursts arrive over a shorter span than a steady stream, so
  this, not the offered rate, is their yardstick) and to `batched` (one operation holding all
  --ops prompts: the same work arriving at once, the ceiling a joining sampler approaches).
  `saturates at`: the lowest load whose completed ops/s falls under 0.9x ideal.
- **Late arrival**: a long operation (--long-samples rows x --long-tokens new tokens) runs; a
  one-sample operation submitted --late-after of the long one's solo time after it was seen
  running. Printed: the short operation's latency, the long operation's remaining time at that
  submit, the short one's solo latency, and one decode step of the long batch (its solo time /
  its tokens; a decode block on the CPU is sampler.CPU_BLOCK_STEPS steps). The time to a first
  token is not observable through the SDK: today the short one's latency ~ the long one's
  remaining time plus its own; joined, about (2 blocks + its own tokens) of joined steps.
- **Forward-backward of another session** (LoRA, cross-entropy, --fb-batch x --fb-tokens) during
  the long operation, submitted the same way, against its solo latency.
- **Single large operation alone**: the long operation's solo latency (a joining sampler must
  not slow it).
- **Agents** (closed loop): --agents clients, each submitting --turns one-sample operations one
  after another (the next as soon as the last returned, as an asynchronous RL loop's rollout
  workers or an agent's turns do), each asking for a number of new tokens drawn uniformly from
  --agent-tokens (rollouts end at different lengths; EOS may end them sooner). Each client
  always has one operation in flight, so the sampler is saturated by construction: operations/s
  and tokens/s completed while every agent still runs (from the first submit to the first
  agent's last result: `saturated`) are throughput at saturation for a loop of that many
  concurrent rollouts; over the whole run (ops / (last result - first submit)) they include
  the ramp-down, where fewer agents remain. Also latency median and p90. The draws depend only
  on the seeds, so two servers get the same requests.

Targets (for continuous batching, not today's sampler): completed ops/s >= 2x today's at the
load where today's saturates (the agents section's closed loop is saturated by construction; a
finite stream at a fixed rate is bounded by its arrivals, see docs/benchmarks.md); a late
arrival's first token within 2 decode blocks (latency about its own generation, not the long
one's remainder); the forward-backward within 2x its solo time plus one decode block; the
large operation alone no slower than today within noise.

Medians over --reps repetitions, after one untimed warm-up of each operation shape. The server
inherits OMP_NUM_THREADS; its intra-op threads are printed (--server-threads passes --threads).
JSON of every number on the last line.

    OMP_NUM_THREADS=1 python bench/stream.py                  # tiny and qwen3-40m
    OMP_NUM_THREADS=1 python bench/stream.py --models tiny --loads 0.5 1 2 4 8
    OMP_NUM_THREADS=1 python bench/stream.py --models tiny --sections agents --agents 16 32
    python bench/stream.py --quick                            # smoke run: tiny, small, 1 rep
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from closed_loop import completed_rate, saturated  # this script's folder is on sys.path
from multilora import metrics
from sdk_loops import served_model
from together import Together
from together.post_training import ModelResourcesClient

from posttrain.config import BUILTIN_MODELS
from posttrain.demo.loop import sdk_quiet
from posttrain.demo.server import local_server
from posttrain.engine.generate import sampler
from posttrain.engine.hosts.threads import intra_op_threads, usable_cores

API_KEY = "bench-key"
FIRST_TOKEN = 3  # below: end-of-text, begin-of-text, padding in the built-in vocabulary
DONE = ("TRAINING_OPERATION_STATUS_COMPLETED", "TRAINING_OPERATION_STATUS_FAILED")
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
RUNNING = 'posttrain_operations{kind="sample",status="running"}'


@dataclass(frozen=True)
class Op:
    """One finished operation: when it was submitted and finished (perf_counter), tokens made."""

    submitted: float
    finished: float
    tokens: int

    @property
    def latency(self) -> float:
        return self.finished - self.submitted


class Driver:
    """Submits operations of two sessions of one resource and waits for their results."""

    def __init__(self, base_url: str, base_model: str, vocab: int) -> None:
        self.base_url, self.vocab = base_url, vocab
        with sdk_quiet():
            resources = ModelResourcesClient.create(
                base_url=base_url, api_key=API_KEY, base_model=base_model, interval=0.05
            )
            self.sampler_id = resources.create_session(interval=0.05).session_id
            lora = {"rank": 8, "alpha": 16, "seed": 1}
            self.trainer_id = resources.create_session(lora_config=lora, interval=0.05).session_id
        self.ops = Together(base_url=base_url, api_key=API_KEY, max_retries=0).post_training
        self.ops = self.ops.operations

    def prompt(self, rng: random.Random, tokens: int) -> dict:
        ids = [rng.randrange(FIRST_TOKEN, self.vocab) for _ in range(tokens)]
        return {"chunks": [{"encoded_text": {"tokens": ids}}]}

    def sample(self, prompts: list[dict], samples: int, new_tokens: int, seed: int) -> Op:
        submitted = time.perf_counter()
        op = self.ops.sample(
            self.sampler_id,
            idempotency_key=str(uuid.uuid4()),
            model_inputs=prompts,
            num_samples=samples,
            sampling_params={"max_tokens": new_tokens, "temperature": 1.0, "seed": seed},
        )
        while op.status not in DONE:
            op = self.ops.retrieve_sample(op.id, session_id=self.sampler_id)
        finished = time.perf_counter()
        assert op.status.endswith("COMPLETED"), op.error
        tokens = sum(len(s.tokens) for r in op.output.results for s in r.sequences)
        return Op(submitted, finished, tokens)

    def forward_backward(self, batch: list[dict]) -> Op:
        submitted = time.perf_counter()
        op = self.ops.forward_backward(
            self.trainer_id, idempotency_key=str(uuid.uuid4()), loss=CE, samples=batch
        )
        while op.status not in DONE:
            op = self.ops.retrieve_forward_backward(op.id, session_id=self.trainer_id)
        finished = time.perf_counter()
        assert op.status.endswith("COMPLETED"), op.error
        return Op(submitted, finished, 0)

    def training_batch(self, rng: random.Random, size: int, tokens: int) -> list[dict]:
        batch = []
        for _ in range(size):
            ids = [rng.randrange(FIRST_TOKEN, self.vocab) for _ in range(tokens + 1)]
            batch.append(
                {
                    "model_input": {"chunks": [{"encoded_text": {"tokens": ids[:-1]}}]},
                    "loss_fn_inputs": {
                        "target_tokens": {"data": ids[1:], "dtype": "int64"},
                        "weights": {"data": [1.0] * tokens, "dtype": "float32"},
                    },
                }
            )
        return batch

    def time_to_join(self, submitted: float, submitter: threading.Thread) -> float | None:
        """Seconds from `submitted` until the server reports two sample operations running (the
        late one joined the running generation: its first token is drawn as it joins), or None
        if `submitter`, the thread waiting for the late one, got its result first."""
        while submitter.is_alive():
            if metrics(self.base_url).get(RUNNING, 0.0) >= 2:
                return time.perf_counter() - submitted
            time.sleep(0.002)
        return None

    def wait_running(self, submitter: threading.Thread) -> None:
        """Until the server reports a sample operation running (its generation has started),
        or `submitter`, the thread waiting for that operation, has its result."""
        while submitter.is_alive() and metrics(self.base_url).get(RUNNING, 0.0) < 1:
            time.sleep(0.005)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def arrival_offsets(ops: int, rate: float, pattern: str, burst: int) -> list[float]:
    """Seconds after the start at which each operation is submitted."""
    if pattern == "steady":
        return [i / rate for i in range(ops)]
    return [(i // burst) * burst / rate for i in range(ops)]


def run_stream(
    driver: Driver, args: argparse.Namespace, rate: float, pattern: str, seed: int
) -> list[Op]:
    """--ops one-sample operations submitted at their arrival offsets, one thread each."""
    rng = random.Random(seed)
    prompts = [driver.prompt(rng, args.prompt_tokens) for _ in range(args.ops)]
    offsets = arrival_offsets(args.ops, rate, pattern, args.burst)
    start = time.perf_counter() + 0.05

    def one(index: int) -> Op:
        time.sleep(max(0.0, start + offsets[index] - time.perf_counter()))
        return driver.sample([prompts[index]], 1, args.new_tokens, index)

    with ThreadPoolExecutor(max_workers=args.ops) as pool:
        return list(pool.map(one, range(args.ops)))


def run_agents(driver: Driver, args: argparse.Namespace, agents: int, seed: int) -> list[list[Op]]:
    """`agents` clients each submitting --turns one-sample operations one after another: the
    next as soon as the last returned (a closed loop), each with a fresh prompt and a number of
    new tokens drawn from --agent-tokens, seeded by (seed, agent, turn). Each agent's Ops."""
    low, high = args.agent_tokens

    def agent(index: int) -> list[Op]:
        rng = random.Random(1_000_003 * seed + index)
        ops = []
        for turn in range(args.turns):
            prompt = driver.prompt(rng, args.prompt_tokens)
            new_tokens = rng.randint(low, high)
            ops.append(driver.sample([prompt], 1, new_tokens, 10_000 * index + turn))
        return ops

    with ThreadPoolExecutor(max_workers=agents) as pool:
        return list(pool.map(agent, range(agents)))


def agents_section(driver: Driver, args: argparse.Namespace, solo_short: float) -> dict:
    low, high = args.agent_tokens
    rows = []
    for agents in args.agents:
        runs = [run_agents(driver, args, agents, rep) for rep in range(args.reps)]
        flat = [[o for ops in r for o in ops] for r in runs]
        windows = [saturated(r) for r in runs]
        latencies = [o.latency for r in flat for o in r]
        row = {
            "agents": agents,
            "turns": args.turns,
            "saturated_ops_s": statistics.median(ops_s for ops_s, _ in windows),
            "saturated_tokens_s": statistics.median(tokens_s for _, tokens_s in windows),
            "completed_ops_s": statistics.median(completed_rate(r) for r in flat),
            "latency_median_s": statistics.median(latencies),
            "latency_p90_s": percentile(latencies, 0.9),
            "tokens_per_op": statistics.mean(o.tokens for r in flat for o in r),
        }
        rows.append(row)
        print(
            f"{agents:3d} agents x {args.turns} turns ({low}-{high} new tokens each, closed"
            f" loop): {row['saturated_ops_s']:6.2f} ops/s, {row['saturated_tokens_s']:7.1f}"
            f" tokens/s while all run ({row['completed_ops_s']:.2f} ops/s over the whole run;"
            f" {row['tokens_per_op']:.1f} tokens per op); latency median"
            f" {row['latency_median_s'] * 1e3:.0f} ms, p90 {row['latency_p90_s'] * 1e3:.0f} ms",
            flush=True,
        )
    return {"agent_tokens": [low, high], "rows": rows}


def during_long(
    driver: Driver,
    args: argparse.Namespace,
    long_solo: float,
    seed: int,
    late: Callable[[], Op],
    joins: list[float | None] | None = None,
) -> tuple[Op, Op]:
    """The long operation, and `late()` submitted --late-after of its solo time after it was
    seen running: (long Op, late Op). With `joins`, the late operation's time to join the
    running generation (Driver.time_to_join) is appended to it."""
    rng = random.Random(seed)
    prompt = [driver.prompt(rng, args.prompt_tokens)]
    result: dict[str, Op] = {}
    thread = threading.Thread(
        target=lambda: result.setdefault(
            "long", driver.sample(prompt, args.long_samples, args.long_tokens, seed)
        )
    )
    thread.start()
    driver.wait_running(thread)
    time.sleep(args.late_after * long_solo)
    late_thread = threading.Thread(target=lambda: result.setdefault("late", late()))
    submitted = time.perf_counter()
    late_thread.start()
    if joins is not None:
        joins.append(driver.time_to_join(submitted, late_thread))
    late_thread.join()
    thread.join()
    return result["long"], result["late"]


def stream_section(driver: Driver, args: argparse.Namespace, solo_short: float) -> dict:
    rng = random.Random(7)
    batched = []
    for rep in range(args.reps):
        prompts = [driver.prompt(rng, args.prompt_tokens) for _ in range(args.ops)]
        batched.append(driver.sample(prompts, 1, args.new_tokens, rep).latency)
    batched_rate = args.ops / statistics.median(batched)
    serial_rate = 1 / solo_short
    base_rate = args.base_rate or serial_rate
    print(
        f"one-sample op alone {solo_short * 1e3:.0f} ms ({serial_rate:.2f} ops/s one at a time);"
        f" all {args.ops} prompts as one op {statistics.median(batched):.2f} s"
        f" ({batched_rate:.2f} ops/s batched)",
        flush=True,
    )
    rows = []
    for pattern in args.patterns:
        for load in args.loads:
            rate = load * base_rate
            runs = [
                run_stream(driver, args, rate, pattern, 1000 * rep + int(load * 100))
                for rep in range(args.reps)
            ]
            completed = statistics.median(completed_rate(r) for r in runs)
            latencies = [o.latency for r in runs for o in r]
            last = arrival_offsets(args.ops, rate, pattern, args.burst)[-1]
            ideal = args.ops / (last + solo_short)
            row = {
                "pattern": pattern,
                "load": load,
                "offered_ops_s": rate,
                "ideal_ops_s": ideal,
                "completed_ops_s": completed,
                "latency_median_s": statistics.median(latencies),
                "latency_p90_s": percentile(latencies, 0.9),
                "tokens_per_op": statistics.median(o.tokens for r in runs for o in r),
            }
            rows.append(row)
            print(
                f"{pattern:>6} load {load:4.2f}x ({rate:6.2f} ops/s offered):"
                f" {completed:6.2f} ops/s completed ({completed / ideal:.2f}x ideal,"
                f" {completed / batched_rate:.2f}x batched); latency median"
                f" {row['latency_median_s'] * 1e3:.0f} ms, p90 {row['latency_p90_s'] * 1e3:.0f} ms",
                flush=True,
            )
    saturation = {}
    for pattern in args.patterns:
        over = [
            r
            for r in rows
            if r["pattern"] == pattern and r["completed_ops_s"] < 0.9 * r["ideal_ops_s"]
        ]
        if over:
            first = min(over, key=lambda r: r["load"])
            saturation[pattern] = first
            print(
                f"{pattern} saturates at load {first['load']:.2f}x:"
                f" {first['completed_ops_s']:.2f} ops/s today (target after: >= 2x that)"
            )
        else:
            print(f"{pattern} does not saturate at the loads run")
    return {
        "solo_op_s": solo_short,
        "batched_ops_s": batched_rate,
        "rows": rows,
        "saturates": {
            k: {"load": v["load"], "completed_ops_s": v["completed_ops_s"]}
            for k, v in saturation.items()
        },
    }


def long_section(driver: Driver, args: argparse.Namespace, solo_short: float) -> dict:
    rng = random.Random(11)
    batch = driver.training_batch(rng, args.fb_batch, args.fb_tokens)
    long_solo, fb_solo, late, remaining, fb_during, step = [], [], [], [], [], []
    joins: list[float | None] = []
    for rep in range(args.reps):
        prompt = [driver.prompt(rng, args.prompt_tokens)]
        long_op = driver.sample(prompt, args.long_samples, args.long_tokens, rep)
        long_solo.append(long_op.latency)
        step.append(long_op.latency / max(1, long_op.tokens // args.long_samples))
        fb_solo.append(driver.forward_backward(batch).latency)
    long_s = statistics.median(long_solo)
    for rep in range(args.reps):
        short_prompt = [driver.prompt(rng, args.prompt_tokens)]
        long_op, short = during_long(
            driver,
            args,
            long_s,
            100 + rep,
            lambda p=short_prompt, rep=rep: driver.sample(p, 1, args.new_tokens, rep),
            joins,
        )
        late.append(short.latency)
        remaining.append(long_op.finished - short.submitted)
        long_op, fb = during_long(
            driver, args, long_s, 200 + rep, lambda: driver.forward_backward(batch)
        )
        fb_during.append(fb.latency)
    block = statistics.median(step) * sampler.CPU_BLOCK_STEPS
    out = {
        "long_solo_s": long_s,
        "decode_block_s": block,
        "late_latency_s": statistics.median(late),
        "long_remaining_s": statistics.median(remaining),
        "short_solo_s": solo_short,
        "fb_solo_s": statistics.median(fb_solo),
        "fb_during_s": statistics.median(fb_during),
        "late_while_running": sum(r > 0 for r in remaining),  # of --reps
        # Seconds until it joined the running generation (None: it never did, it ran after).
        "late_join_s": sorted(joins, key=lambda j: float("inf") if j is None else j),
    }
    print(
        f"large op alone ({args.long_samples} x {args.long_tokens} tokens): {long_s:.2f} s;"
        f" one decode block of it ~{block * 1e3:.1f} ms"
        f" ({sampler.CPU_BLOCK_STEPS} step(s) on the CPU)"
    )
    print(
        f"late one-sample op: {out['late_latency_s']:.2f} s (long op's remaining time at its"
        f" submit {out['long_remaining_s']:.2f} s; alone {solo_short:.2f} s;"
        f" {out['late_latency_s'] / solo_short:.1f}x alone; submitted while it ran in"
        f" {out['late_while_running']} of {args.reps})"
    )
    joined = [j for j in joins if j is not None]
    if joined:
        worst = max(joined)
        print(
            f"late op joined the running generation in {len(joined)} of {args.reps}, after"
            f" {statistics.median(joined) * 1e3:.0f} ms median, {worst * 1e3:.0f} ms at most"
            f" ({worst / block:.1f} blocks; its first token is drawn as it joins)"
        )
    else:
        print("late op never joined the running generation: it ran after it")
    target = 2 * out["fb_solo_s"] + block
    print(
        f"forward-backward of another session: {out['fb_during_s']:.2f} s during the long op,"
        f" {out['fb_solo_s']:.2f} s alone ({out['fb_during_s'] / out['fb_solo_s']:.1f}x;"
        f" target after: <= {target:.2f} s)"
    )
    return out


def bench_model(name: str, args: argparse.Namespace, extra: tuple[str, ...]) -> dict:
    with served_model(name) as (base_model, model_args, vocab):
        with local_server(extra_args=(*model_args, *extra)) as base_url:
            driver = Driver(base_url, base_model, vocab)
            rng = random.Random(3)
            warm = [driver.prompt(rng, args.prompt_tokens)]
            driver.sample(warm, 1, args.new_tokens, 0)  # untimed warm-ups
            driver.sample(warm, args.long_samples, args.long_tokens, 0)
            driver.forward_backward(driver.training_batch(rng, args.fb_batch, args.fb_tokens))
            solo = statistics.median(
                driver.sample(
                    [driver.prompt(rng, args.prompt_tokens)], 1, args.new_tokens, i
                ).latency
                for i in range(max(3, args.reps))
            )
            print(f"\n{name}:", flush=True)
            sections = {"stream": stream_section, "long": long_section, "agents": agents_section}
            return {key: sections[key](driver, args, solo) for key in args.sections}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "qwen3-40m"])
    parser.add_argument("--ops", type=int, default=32, help="operations per stream")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0, 8.0])
    parser.add_argument(
        "--patterns", nargs="+", choices=["steady", "burst"], default=["steady", "burst"]
    )
    parser.add_argument("--burst", type=int, default=8, help="operations per burst")
    parser.add_argument(
        "--base-rate",
        type=float,
        default=None,
        help="ops/s of load 1x (default: 1 / one operation's solo latency, measured): fix it to"
        " offer the same arrivals to two servers run at different times",
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=["stream", "long", "agents"],
        default=["stream", "long", "agents"],
    )
    parser.add_argument("--agents", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--turns", type=int, default=6, help="operations per agent, in sequence")
    parser.add_argument(
        "--agent-tokens",
        type=int,
        nargs=2,
        default=[8, 128],
        metavar=("LOW", "HIGH"),
        help="each agent operation's max_tokens, drawn uniformly from LOW..HIGH",
    )
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--long-samples", type=int, default=256)
    parser.add_argument("--long-tokens", type=int, default=128)
    parser.add_argument("--late-after", type=float, default=0.25, help="x the long op's solo time")
    parser.add_argument("--fb-batch", type=int, default=8)
    parser.add_argument("--fb-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--server-threads", type=int, default=None, help="the server's --threads")
    parser.add_argument(
        "--serve-args",
        default="",
        help="more `posttrain serve` arguments, e.g. '--workers process' (printed)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny, small, 1 rep")
    args = parser.parse_args()
    if args.quick:
        args.models, args.ops, args.loads, args.burst, args.reps = ["tiny"], 4, [2.0], 2, 1
        args.new_tokens, args.long_samples, args.long_tokens, args.fb_batch = 4, 4, 16, 2
        args.prompt_tokens, args.fb_tokens = 8, 8
        args.agents, args.turns, args.agent_tokens = [2], 2, [2, 6]
    extra = () if args.server_threads is None else ("--threads", str(args.server_threads))
    extra += tuple(args.serve_args.split())
    threads = (  # the server's own count depends on the models it serves (hosts/threads.py)
        str(args.server_threads)
        if args.server_threads
        else f"{intra_op_threads(None, model_dirs=BUILTIN_MODELS.values())} (built-ins),"
        f" {intra_op_threads(None)} (wider models)"
    )
    print(
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, usable cores"
        f" {usable_cores()}, server intra-op threads {threads},"
        f" load average at start {os.getloadavg()[0]:.2f}; serve args {list(extra)};"
        f" {args.ops} ops per stream,"
        f" {args.prompt_tokens} prompt + {args.new_tokens} new tokens each, {args.reps} reps"
    )
    results = {name: bench_model(name, args, extra) for name in args.models}
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
