"""What an open stream of sample operations costs beside static decode passes (the GPU default,
CUDA graphs there, eager here): the layouts it makes (each a capture on CUDA), its eager prefill
passes and its decode blocks, counted on the CPU, and what they come to on the H200's measured
costs (a benchmark, not a timed test; issue 30).

A stream that ramps up has no ended rows for a join to take, so without placeholders every join
appends its rows and makes a new layout. Three ways, the same operations:

- **placeholders**: a stream's layout is made with placeholder rows, up to a power of two of
  its running rows (engine/generate/padding_joins.py); joins take them, and the padding
  finished rows leave;
- **padding**: joins take only the padding finished rows leave (the layouts hold the rows
  they run);
- **append**: every join appends its rows after an eager prefill pass (joins as they ran
  beside static passes before they took padding rows and prefill steps).

The operations are one-sample, `--prompt-tokens` random ids each, `max_tokens` uniform in
--new-tokens (EOS ends a row sooner), temperature 1, seeded; `--per-block` of them join at each
decode block boundary (arrivals counted in blocks, not seconds, so the counts do not depend on
the machine), operation i sampling the i-th of `--sessions` LoRA sessions in turn, in one
SampleStream with the server's default pool. Printed per way: layouts,
eager prefills, prefill-step runs and steps made, decode blocks and their rows, the CPU's
seconds, and the estimate

    blocks x 104 ms + (layouts + steps made) x 176 ms + eager prefills x 88 ms + step runs x 15 ms

(the H200 run, docs/benchmarks.md "GPU check": a replayed block of 8 passes ~104 ms, an eager
pass ~88 ms on the
Qwen3-0.6B shape; a capture taken as 2 eager passes, a replayed prefill step as 15 ms). A
block's rows do not enter it: on the H200 a replayed pass costs about the same at 8 and 64 rows.

    OMP_NUM_THREADS=1 python bench/stream_layouts.py                   # ~2 minutes
    python bench/stream_layouts.py --quick                             # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from closed_loop import Blocks, counting, model_dir  # noqa: E402  (bench/)
from gpu_check_common import switched  # noqa: E402  (bench/)

from posttrain.config import BUILTIN_MODEL_ID, EngineConfig, SchedulerConfig  # noqa: E402
from posttrain.engine.generate import padding_joins, prefill_graph, sampler  # noqa: E402
from posttrain.engine.generate.prefill_graph import PrefillStep  # noqa: E402
from posttrain.engine.generate.sample_stream import SampleStream  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.service.scheduling.sample_streams import stream_rows  # noqa: E402
from posttrain.types import LoraConfig, SampleRequest, SamplingParams  # noqa: E402

# The H200's costs (docs/benchmarks.md, "GPU check"; see the docstring).
BLOCK_S, EAGER_PASS_S, STEP_RUN_S = 0.104, 0.088, 0.015
CAPTURE_S = 2 * EAGER_PASS_S
WAYS = {
    "placeholders": {},
    "padding": {"PLACEHOLDERS": False},
    "append": {"JOIN_INTO_PADDING": False},
}


def operations(count: int, prompt_tokens: int, new_tokens: tuple[int, int], vocab: int):
    rng = random.Random(7)
    ops = []
    for index in range(count):
        prompt = tuple(rng.randrange(1, vocab) for _ in range(prompt_tokens))
        params = SamplingParams(max_tokens=rng.randint(*new_tokens), temperature=1.0, seed=index)
        ops.append(SampleRequest((prompt,), 1, params))
    return ops


def run_stream(engine: LocalEngine, ops: list[SampleRequest], per_block: int) -> dict:
    """The operations joining `per_block` at each block boundary until all finish: the counts,
    the CPU's seconds and each operation's tokens."""
    resource = engine._resource("r")
    sessions = [engine._session("r", s)[1] for s in sorted(resource.sessions)]
    stream = SampleStream(engine.config, resource, resource.loaded.model)
    stream.reserve_rows(stream_rows(SchedulerConfig()))  # the server's pool by default
    blocks = Blocks()
    made = [0]
    make = PrefillStep.__init__

    def step_made(step: PrefillStep, *args, **kwargs) -> None:
        made[0] += 1
        make(step, *args, **kwargs)

    tokens: dict[int, tuple[int, ...]] = {}
    queue = list(enumerate(ops))
    start = time.perf_counter()
    with counting(blocks), switched(PrefillStep, __init__=step_made):
        while queue or stream.running:
            if queue:
                joining, queue = queue[:per_block], queue[per_block:]
                # Operation i samples the i-th session in turn (LoRA adapters of one model).
                stream.admit([(sessions[i % len(sessions)], op) for i, op in joining])
            if stream.running:
                stream.block()
            for item, (result,) in stream.take_finished():
                tokens[item] = tuple(result.sequences[0].tokens)
    seconds = time.perf_counter() - start
    stream.close()
    counts = blocks.report() | {"prefill_steps_made": made[0], "cpu_s": seconds}
    estimate = (
        blocks.count * BLOCK_S
        + (blocks.layouts + made[0]) * CAPTURE_S
        + blocks.prefills * EAGER_PASS_S
        + blocks.prefill_steps * STEP_RUN_S
    )
    return counts | {"h200_estimate_s": estimate, "tokens": tokens}


def compare(engine: LocalEngine, ops: list[SampleRequest], per_block: int) -> dict:
    results = {}
    for way, switches in WAYS.items():
        with (
            switched(padding_joins, **switches),
            switched(prefill_graph, JOIN_PREFILL_STEPS=way != "append"),
        ):
            results[way] = run_stream(engine, ops, per_block)
    mine = results["placeholders"].pop("tokens")
    for way in ("padding", "append"):
        theirs = results[way].pop("tokens")
        results[way]["same_tokens_ops"] = sum(mine[i] == theirs[i] for i in mine)
    for way in ("padding", "append"):
        for key in ("h200_estimate_s", "cpu_s"):
            results[f"placeholders_over_{way}_{key}"] = (
                results["placeholders"][key] / results[way][key]
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="host-bound", help="host-bound, qwen3-40m or tiny")
    parser.add_argument("--ops", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--per-block", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument(
        "--new-tokens", type=int, nargs=2, default=[16, 160], metavar=("LOW", "HIGH")
    )
    parser.add_argument("--block-steps", type=int, default=8, help="decode passes per block")
    parser.add_argument(
        "--sessions", type=int, default=1, help="LoRA sessions, sampled in turn by the operations"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny, small")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.model, args.ops, args.per_block, args.prompt_tokens = "tiny", [6], [1], 8
        args.new_tokens, args.block_steps = [4, 12], 2
    sampler.CPU_STATIC_DECODE = True
    sampler.CPU_BLOCK_STEPS = args.block_steps
    low, high = args.new_tokens
    print(
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, torch threads"
        f" {torch.get_num_threads()}, load average at start {os.getloadavg()[0]:.2f};"
        f" {args.model}, static passes, blocks of {args.block_steps}, {args.prompt_tokens}"
        f" prompt tokens, {low}-{high} new, {args.sessions} LoRA session(s)",
        flush=True,
    )
    report: dict[str, object] = {"model": args.model, "sessions": args.sessions, "rows": []}
    with tempfile.TemporaryDirectory(prefix="stream-layouts-") as scratch:
        directory, vocab = model_dir(args.model, Path(scratch))
        model_id = BUILTIN_MODEL_ID if args.model == "tiny" else args.model
        # No prefix cache: each way would find the prompts the ways before it ran.
        config = EngineConfig(device="cpu", prefix_cache_mib=0)
        engine = LocalEngine(config, {model_id: directory})
        engine.load_resource("r", model_id, muon_scaling=None)
        for index in range(args.sessions):
            engine.create_session("r", f"s{index}", LoraConfig(rank=8, alpha=16, seed=index))
        warm = operations(max(2, args.sessions), args.prompt_tokens, (2, 4), vocab)
        compare(engine, warm, 1)  # warm-up, every session served
        for count in args.ops:
            for per_block in args.per_block:
                ops = operations(count, args.prompt_tokens, (low, high), vocab)
                row = {"ops": count, "per_block": per_block} | compare(engine, ops, per_block)
                report["rows"].append(row)
                print(f"\n{count} operations, {per_block} a block:")
                for way in WAYS:
                    r = row[way]
                    print(
                        f"  {way:>12}: {r['layouts']:3d} layouts, {r['prefills']:3d} eager"
                        f" prefills, {r['prefill_steps']:3d} step runs ({r['prefill_steps_made']}"
                        f" made), {r['blocks']:3d} blocks of {r['rows_per_block']:.1f} rows;"
                        f" CPU {r['cpu_s']:.2f} s; H200 estimate {r['h200_estimate_s']:.1f} s"
                        + (
                            f"; same tokens {r['same_tokens_ops']}/{count}"
                            if "same_tokens_ops" in r
                            else ""
                        )
                    )
                for way in ("padding", "append"):
                    print(
                        f"  placeholders / {way}: H200 estimate"
                        f" {row[f'placeholders_over_{way}_h200_estimate_s']:.2f}x the time,"
                        f" CPU {row[f'placeholders_over_{way}_cpu_s']:.2f}x",
                        flush=True,
                    )
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    print(json.dumps(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
