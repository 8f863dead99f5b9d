"""How OpenMP's wait setting shapes a model's speed quiet and beside a busy process, in process
(a benchmark, not a timed test).

Each setting runs in a fresh interpreter (libgomp reads its wait setting once, when torch
loads it) on 2 intra-op threads: a forward-backward of the 40M Qwen3 config of bench/sampling.py
(8 x 256 tokens, random init, seed 0) and a greedy decode (32 rows, a 32-token prompt, 16 new
tokens with the KV cache), each --reps times quiet and then --reps times beside a child that
keeps one core busy (a pure-Python loop). Printed per setting: the medians and the ratio busy /
quiet. The settings: libgomp's default spinning, GOMP_SPINCOUNT=1000 (the server's own,
engine/hosts/threads.py), 10000, and OMP_WAIT_POLICY=PASSIVE.

    python bench/omp_waits.py              # 40M, 3 reps per half
    python bench/omp_waits.py --quick      # smoke run: a tiny config, 1 rep

What it decides: the server's default (threads.SPIN_ROUNDS); docs/benchmarks.md has the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from sampling import RANDOM_CONFIGS

SETTINGS = {
    "spinning": {},
    "spin 1000": {"GOMP_SPINCOUNT": "1000"},
    "spin 10000": {"GOMP_SPINCOUNT": "10000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}
SHAPES = {  # (Qwen3 config, rows, tokens)
    "40m": (RANDOM_CONFIGS["qwen3-40m"], 8, 256),
    "tiny": (
        dict(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
        ),
        2,
        16,
    ),
}


def measure(shape: str, reps: int) -> dict[str, float]:
    """In this (child) interpreter: medians quiet and busy of both workloads."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.set_num_threads(2)
    torch.manual_seed(0)
    config, rows, tokens = SHAPES[shape]
    model = Qwen3ForCausalLM(Qwen3Config(**config))
    ids = torch.randint(0, config["vocab_size"], (rows, tokens))

    def train() -> float:
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad()
        return time.perf_counter() - start

    def decode() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            out = model(input_ids=ids[:, : tokens // 8].repeat(4, 1), use_cache=True)
            for _ in range(16):
                step = out.logits[:, -1:].argmax(-1)
                out = model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
        return time.perf_counter() - start

    train(), decode()  # warm-up
    result = {
        "train_quiet": statistics.median(train() for _ in range(reps)),
        "decode_quiet": statistics.median(decode() for _ in range(reps)),
    }
    busy = subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"])
    try:
        time.sleep(0.5)
        result["train_busy"] = statistics.median(train() for _ in range(reps))
        result["decode_busy"] = statistics.median(decode() for _ in range(reps))
    finally:
        busy.kill()
        busy.wait()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="runs per half (quiet, busy)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny config, 1 rep")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # shape, in a setting's interpreter
    args = parser.parse_args()
    shape, reps = ("tiny", 1) if args.quick else ("40m", args.reps)
    if args.child:
        print(json.dumps(measure(args.child, reps)))
        return
    print(
        f"usable cores {len(os.sched_getaffinity(0))}, 2 intra-op threads, shape {shape},"
        f" {reps} reps per half, load average at start {os.getloadavg()[0]:.2f}"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    for name, setting in SETTINGS.items():
        command = [sys.executable, __file__, "--child", shape, "--reps", str(reps)]
        out = subprocess.run(
            command, env={**base, **setting}, capture_output=True, text=True, check=True
        ).stdout
        r = json.loads(out.splitlines()[-1])
        print(
            f"{name:<11} forward-backward {r['train_quiet']:.3f} s quiet, busy/quiet"
            f" {r['train_busy'] / r['train_quiet']:.2f}x; decode {r['decode_quiet']:.3f} s quiet,"
            f" busy/quiet {r['decode_busy'] / r['decode_quiet']:.2f}x",
            flush=True,
        )
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
