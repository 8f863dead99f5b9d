"""The demo's steps quiet and beside one busy process (a benchmark, not a timed test).

A real `posttrain serve` subprocess (posttrain/demo/server.py) is driven by this process with
the demo's own step functions (posttrain/demo/loop.py): a cross-entropy warm-up of
--warmup-steps steps (reported as steps/s), then --rl-steps GRPO steps (sample, reward,
reference forward, forward-backward, optim-step, weights-sync; reported as seconds a step).
Each repetition runs that quiet and then beside one busy process, a child that keeps one core
busy (`--busy python`: a pure-Python loop; `--busy matmul`: a torch matmul loop on one thread),
started before and killed after the busy half. Printed: every run, the medians over
--reps repetitions, and the ratios busy / quiet of the warm-up step time and the GRPO step
time (medians of the per-repetition ratios: adjacent runs, robust to a shared machine's
drifting load). The server's intra-op threads are stated (engine/hosts/threads.py; --server-threads
passes `--threads N` to `posttrain serve`).

    python bench/contention.py                       # 40 warm-up + 6 GRPO steps x 3 reps
    python bench/contention.py --server-threads 1    # one thread (the default before), to compare
    OMP_WAIT_POLICY=ACTIVE python bench/contention.py  # libgomp's spinning waits, to compare
    python bench/contention.py --quick               # smoke run: a few small steps, 1 rep

Target (2-core CPU): beside one busy process the demo runs within 1.6x of its quiet time.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from together.post_training import ModelResourcesClient, SessionClient

from posttrain.config import BUILTIN_MODELS
from posttrain.demo.loop import (
    POLL_INTERVAL_S,
    DemoConfig,
    Tokens,
    rl_step,
    sdk_quiet,
    split_problems,
    warmup_step,
)
from posttrain.demo.server import local_server
from posttrain.demo.task import Problem
from posttrain.engine.hosts.threads import intra_op_threads, server_wait_policy, usable_cores

API_KEY = "local-key"

BUSY_PROGRAMS = {
    "python": "while True:\n    pass\n",
    "matmul": (
        "import torch\n"
        "torch.set_num_threads(1)\n"
        "a = torch.randn(256, 256)\n"
        "while True:\n"
        "    a = torch.tanh(a @ a)\n"
    ),
}


@contextmanager
def busy_neighbour(kind: str) -> Iterator[None]:
    """A child process that keeps one core busy while the block runs."""
    process = subprocess.Popen([sys.executable, "-c", BUSY_PROGRAMS[kind]])
    try:
        time.sleep(0.5)  # let it start (and import torch) before the timed steps
        yield
    finally:
        process.kill()
        process.wait()


@dataclass
class Run:
    warmup_step_s: float  # median seconds of one warm-up step
    grpo_step_s: float  # median seconds of one GRPO step


def measure(
    warm: SessionClient,
    policy: SessionClient,
    reference: SessionClient,
    tokens: Tokens,
    train: list[Problem],
    config: DemoConfig,
    rng: random.Random,
) -> Run:
    """--warmup-steps steps on `warm`, --rl-steps GRPO steps on `policy`; median step times.
    Both sessions train on from run to run; quiet and busy runs alternate, so the drift in
    work a step does (how many GRPO samples have a nonzero advantage) reaches both."""
    warmups = [
        warmup_step(warm, tokens, rng.sample(train, config.warmup_batch_size), config).seconds
        for _ in range(config.warmup_steps)
    ]
    grpos = []
    for index in range(config.rl_steps):
        batch = rng.sample(train, config.prompts_per_step)
        grpos.append(rl_step(policy, reference, tokens, batch, config, index).seconds)
    return Run(statistics.median(warmups), statistics.median(grpos))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup-steps", type=int, default=40, help="warm-up steps per run")
    parser.add_argument("--rl-steps", type=int, default=6, help="GRPO steps per run")
    parser.add_argument("--reps", type=int, default=3, help="quiet/busy repetitions")
    parser.add_argument(
        "--setup-steps",
        type=int,
        default=60,
        help="warm-up steps before the GRPO sessions branch off (so some answers are right)",
    )
    parser.add_argument("--busy", choices=tuple(BUSY_PROGRAMS), default="python")
    parser.add_argument(
        "--server-threads", type=int, default=None, help="the server's --threads (default: its own)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny steps, one rep")
    args = parser.parse_args()
    # A SIGTERM unwinds like Ctrl-C, so the busy child and the server are stopped, not orphaned.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    config = replace(DemoConfig(), warmup_steps=args.warmup_steps, rl_steps=args.rl_steps, seed=0)
    if args.quick:
        config = replace(
            config, warmup_steps=3, rl_steps=2, warmup_batch_size=8, prompts_per_step=8
        )
        args.reps, args.setup_steps = 1, 3
    extra = () if args.server_threads is None else ("--threads", str(args.server_threads))
    threads = intra_op_threads(args.server_threads, model_dirs=BUILTIN_MODELS.values())
    print(
        f"usable cores {usable_cores()}, server intra-op threads {threads}"
        f" ({'--threads' if args.server_threads else 'its default'}), OpenMP waits"
        f" {server_wait_policy()}, load average at start"
        f" {os.getloadavg()[0]:.2f}; busy neighbour: {args.busy} on one core"
    )
    print(
        f"per run: {config.warmup_steps} warm-up steps x {config.warmup_batch_size} problems,"
        f" {config.rl_steps} GRPO steps x {config.prompts_per_step} prompts x"
        f" {config.group_size} samples; {args.reps} repetitions"
    )
    tokens = Tokens(config.base_model)
    train, _ = split_problems(config.seed, config.num_heldout)
    rng = random.Random(1)
    lora = {"rank": config.lora_rank, "alpha": config.lora_alpha, "seed": config.seed}
    with local_server(extra_args=extra) as base_url:
        with sdk_quiet():
            resources = ModelResourcesClient.create(
                base_url=base_url, api_key=API_KEY, base_model=config.base_model, interval=0.2
            )
            warm = resources.create_session(lora_config=lora, interval=0.2)
            # GRPO trains only on groups whose rewards differ: the policy starts from a model
            # that gets some answers right, as the demo's does after its warm-up.
            for _ in range(args.setup_steps):
                warmup_step(warm, tokens, rng.sample(train, config.warmup_batch_size), config)
            checkpoint = warm.create_training_checkpoint(interval=POLL_INTERVAL_S)
            policy, reference = (
                resources.create_session(
                    resume_from_checkpoint_id=checkpoint.id, load_optimizer=False, interval=0.2
                )
                for _ in range(2)
            )
            policy.trainer.weights_sync(interval=POLL_INTERVAL_S)
        quiet: list[Run] = []
        busy: list[Run] = []
        for rep in range(args.reps):
            quiet.append(measure(warm, policy, reference, tokens, train, config, rng))
            with busy_neighbour(args.busy):
                busy.append(measure(warm, policy, reference, tokens, train, config, rng))
            print(
                f"rep {rep}: warm-up {1 / quiet[-1].warmup_step_s:.2f} steps/s quiet,"
                f" {1 / busy[-1].warmup_step_s:.2f} busy; GRPO step"
                f" {quiet[-1].grpo_step_s:.3f} s quiet, {busy[-1].grpo_step_s:.3f} s busy",
                flush=True,
            )
    warmup_ratio = statistics.median(
        b.warmup_step_s / q.warmup_step_s for q, b in zip(quiet, busy, strict=True)
    )
    grpo_ratio = statistics.median(
        b.grpo_step_s / q.grpo_step_s for q, b in zip(quiet, busy, strict=True)
    )
    quiet_warmup = statistics.median(1 / r.warmup_step_s for r in quiet)
    busy_warmup = statistics.median(1 / r.warmup_step_s for r in busy)
    print(
        f"medians: warm-up {quiet_warmup:.2f} steps/s quiet, {busy_warmup:.2f} busy;"
        f" GRPO step {statistics.median(r.grpo_step_s for r in quiet):.3f} s quiet,"
        f" {statistics.median(r.grpo_step_s for r in busy):.3f} s busy"
    )
    print(f"ratio busy/quiet: warm-up step {warmup_ratio:.2f}x, GRPO step {grpo_ratio:.2f}x")
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
