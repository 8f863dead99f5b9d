"""What a join costs a decode block: its prompts prefilled inside the block's first decode pass
(engine/generate/joining_pass.py, chunked prefill) vs in a prefill pass of their own before the
block (joins.start_rows, as the sampler keeps for static passes), in one process (a benchmark,
not a timed test; issue 30).

A sampler.Decoding runs --rows one-sample rows (--prompt-tokens random prompt ids each, no EOS)
and, before each of --blocks decode blocks of --block-steps passes, admits --joins one-sample
requests of --prompt-tokens fresh prompt ids: a stream that admits at every block boundary,
as a closed loop of agents or a steady stream of operations does. Both ways run the same
requests; the first two blocks of each run are not timed (allocation). Printed per setting:
the median time of a block with its join, each way, in pass / apart; and, counted once each way
with a TorchDispatchMode (machine-independent), the aten operations a block with its join
dispatches, which on a device whose every operation costs its launch (a GPU running eager
passes: ~16 us each on an H200) are what the block costs. Medians over --reps runs, the ways
alternated. Dynamic passes: beside static ones (CUDA graphs) joins prefill apart.

    OMP_NUM_THREADS=1 python bench/joining_pass.py            # tiny and host-bound, CPU
    python bench/joining_pass.py --quick                       # a smoke run

`host-bound` is bench/closed_loop.py's 28-layer, 64-wide Qwen3: a CPU pass of it costs its
dispatch, as the Qwen3-0.6B shape's eager passes did on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout

from closed_loop import model_dir  # noqa: E402
from gpu_check_common import switched  # noqa: E402

from posttrain.config import BUILTIN_MODEL_ID, EngineConfig  # noqa: E402
from posttrain.engine.generate import generator, joining_pass, sampler  # noqa: E402
from posttrain.engine.generate.sampler import GenerationRequest  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.types import LoraConfig, SamplingParams  # noqa: E402

WAYS = {"in_pass": True, "apart": False}


class _Ops(TorchDispatchMode):
    """aten operations dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def requests(count: int, prompt_tokens: int, vocab: int, seed: int) -> list[GenerationRequest]:
    generator_ = torch.Generator().manual_seed(seed)
    return [
        GenerationRequest(
            tuple(torch.randint(1, vocab, (prompt_tokens,), generator=generator_).tolist()),
            1,
            SamplingParams(max_tokens=100_000, seed=seed * 1000 + i, stop_at_eos=False),
            "s@generator",
        )
        for i in range(count)
    ]


def run(gm, served, args, vocab: int, in_pass: bool, count_ops: bool) -> tuple[float, int]:
    """(median seconds of a block with its join, aten operations of one such block)."""
    with torch.no_grad(), switched(joining_pass, JOIN_IN_DECODE_PASS=in_pass):
        decoding = sampler.Decoding(
            gm, requests(args.rows, args.prompt_tokens, vocab, 1), served, args.block_steps
        )
        times, ops = [], 0
        for block in range(args.blocks):
            joining = requests(args.joins, args.prompt_tokens, vocab, 2 + block)
            if count_ops and block == 2:
                mode = _Ops()
                with mode:
                    decoding.admit(joining)
                    decoding.block()
                ops = mode.count
                continue
            start = time.perf_counter()
            decoding.admit(joining)
            decoding.block()
            if block >= 2:
                times.append(time.perf_counter() - start)
        decoding.close()
    return statistics.median(times), ops


def load(name: str, scratch: Path):
    """(GeneratorModel of a LoRA session on model `name`, what it serves, vocabulary)."""
    directory, vocab = model_dir(name, scratch)
    model_id = BUILTIN_MODEL_ID if name == "tiny" else name
    engine = LocalEngine(EngineConfig(device="cpu", prefix_cache_mib=0), {model_id: directory})
    engine.load_resource("r", model_id, muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=8, alpha=16, seed=1))
    resource = engine._resource("r")
    generator.served(resource, engine._session("r", "s")[1])
    gm = generator.generator_model(engine.config, resource, resource.loaded.model)
    return gm, resource.served, vocab


def measure(gm, served, vocab: int, args) -> dict:
    """Both ways --reps times, alternated, for one setting (args.joins etc. single values)."""
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    ops: dict[str, int] = {}
    for rep in range(args.reps):
        for way, in_pass in WAYS.items():
            block_s, counted = run(gm, served, args, vocab, in_pass, rep == 0)
            seconds[way].append(block_s)
            if rep == 0:
                ops[way] = counted
    row = {f"{way}_block_ms": statistics.median(seconds[way]) * 1e3 for way in WAYS}
    row["in_pass_over_apart_time"] = row["in_pass_block_ms"] / row["apart_block_ms"]
    row |= {f"{way}_block_ops": ops[way] for way in WAYS}
    row["in_pass_over_apart_ops"] = ops["in_pass"] / ops["apart"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["tiny", "host-bound"])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--joins", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--block-steps", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny, small, 1 rep")
    args = parser.parse_args()
    if args.quick:
        args.models, args.rows, args.joins, args.reps, args.blocks = ["tiny"], 4, [2], 1, 4
        args.prompt_tokens, args.block_steps = [8], [1, 2]
    print(
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, torch threads"
        f" {torch.get_num_threads()}, load average at start {os.getloadavg()[0]:.2f};"
        f" {args.rows} rows decoding, dynamic passes,"
        f" medians of {args.reps}, ways alternated",
        flush=True,
    )
    report: dict[str, list[dict]] = {}
    settings = [
        (joins, prompt, steps)
        for steps in args.block_steps
        for prompt in args.prompt_tokens
        for joins in args.joins
    ]
    with tempfile.TemporaryDirectory(prefix="joining-pass-") as scratch:
        for name in args.models:
            gm, served, vocab = load(name, Path(scratch))
            print(f"\n{name}:", flush=True)
            report[name] = []
            for joins, prompt, steps in settings:
                single = argparse.Namespace(
                    **{**vars(args), "joins": joins, "prompt_tokens": prompt, "block_steps": steps}
                )
                row = {"joins": joins, "prompt_tokens": prompt, "block_steps": steps}
                row |= measure(gm, served, vocab, single)
                report[name].append(row)
                print(
                    f"  {joins} join(s) of {prompt} prompt tokens a block of {steps} pass(es):"
                    f" {row['apart_block_ms']:7.1f} -> {row['in_pass_block_ms']:7.1f} ms a block"
                    f" ({row['in_pass_over_apart_time']:.2f}x), aten operations"
                    f" {row['apart_block_ops']} -> {row['in_pass_block_ops']}"
                    f" ({row['in_pass_over_apart_ops']:.2f}x)",
                    flush=True,
                )
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
