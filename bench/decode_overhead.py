"""Sampler per-decode-step overhead against the matmul floor (issue 16, item 2).

Runs engine/generate/sampler.generate on one model (the built-in tiny Qwen3 by default, a
LoRA adapter routed as a session samples) and times every decode step, from one embedding call
to the next (a forward pre-hook on the input embedding). The floor of a step with B live rows is the
time of the step's matrix products alone: every linear layer's x[B, in] @ W^T (LoRA A and B
products included) and the output head, run back to back on random inputs in the same
process. Overhead = step time - floor: Python, small tensor ops, attention, sampling.

    OMP_NUM_THREADS=1 python bench/decode_overhead.py             # 16 prompts x 128 x 8 x 32
    python bench/decode_overhead.py --model qwen3-40m --reps 5
    python bench/decode_overhead.py --block-steps 8 [--static]    # blocks, static passes

Also counts the tensor operations and host reads (`.item()`, `int(t)`, `bool(t)`: a device
synchronisation each on a GPU) per decode step, and the results transfers (the one
device-to-host copy of a block's tokens and logprobs) per block of `--block-steps` passes,
which do not depend on the machine's load. `--static`: the static-shape passes
(engine/generate/decode_graph.py, eager here; on CUDA they are captured in graphs).
Prints per-step medians (ms), the floor and their ratio; JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
from sampling import ADAPTER, build_model  # this script's folder is on sys.path
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoTokenizer

from posttrain.config import BUILTIN_MODEL_DIR
from posttrain.engine.generate import sampler
from posttrain.engine.generate.decode_rows import LiveRows
from posttrain.engine.generate.prefill import GeneratorModel
from posttrain.engine.generate.prefix_cache import PrefixCache
from posttrain.engine.generate.sampler import GenerationRequest, generate
from posttrain.engine.state import WeightsVersion
from posttrain.model.kv_shape import kv_shape
from posttrain.model.lora import AdapterSpec, LoraLinear, LoraModel
from posttrain.types import SamplingParams


def matmul_floor(lora: LoraModel, rows: int, repeats: int = 20) -> float:
    """Seconds of one decode step's matrix products for `rows` rows (median of `repeats`)."""
    products = []
    for layer in lora.layers.values():
        if not isinstance(layer, LoraLinear):
            continue
        weight = layer.base.weight
        products.append((torch.randn(rows, weight.shape[1], dtype=weight.dtype), weight))
        for adapter in layer.adapters.values():
            products.append((torch.randn(rows, adapter.lora_A.shape[1]), adapter.lora_A))
            products.append((torch.randn(rows, adapter.lora_B.shape[1]), adapter.lora_B))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for x, w in products:
            torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_steps(
    gm: GeneratorModel, requests: list[GenerationRequest], block_steps: int
) -> list[tuple[int, float]]:
    """(rows, seconds) of each decode step of one generate call (the prefill pass excluded)."""
    marks: list[tuple[int, float]] = []
    embedding: nn.Module = gm.model.get_input_embeddings()

    def mark(_module, args):
        marks.append((args[0].shape[0] if args[0].shape[1] == 1 else -1, time.perf_counter()))

    handle = embedding.register_forward_pre_hook(mark)
    try:
        generate(gm, requests, versions={ADAPTER: WeightsVersion(1, 0)}, block_steps=block_steps)
        end = time.perf_counter()
    finally:
        handle.remove()
    marks.append((0, end))
    steps = []
    for (rows, start), (_, stop) in zip(marks, marks[1:], strict=False):
        if rows > 0:  # a decode pass (one new position per row), not the prefill
            steps.append((rows, stop - start))
    return steps


class _OpCounter(TorchDispatchMode):
    """Counts the tensor operations dispatched inside the block, and the host reads among
    them (`.item()`, `int(t)`, `bool(t)`: each a device synchronisation on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.host_reads += func.overloadpacket is torch.ops.aten._local_scalar_dense
        return func(*args, **(kwargs or {}))


def ops_per_step(gm: GeneratorModel, requests_of, block_steps: int) -> tuple[float, float, float]:
    """(tensor ops, host reads) per decode step and results transfers per block: the
    difference between a call of one block and one of several (prefill and setup cancel out;
    with one pass per block, 1 + 1 and 1 + 11 new tokens)."""
    counts = []
    short_blocks = 1
    long_blocks = max(2, math.ceil(11 / block_steps))
    transfers = [0]
    to_host = LiveRows.to_host

    def counted(self, *args):
        transfers[0] += 1
        return to_host(self, *args)

    LiveRows.to_host = counted  # counts the calls; the transfer itself runs as ever
    try:
        for blocks in (short_blocks, long_blocks):
            transfers[0] = 0
            with _OpCounter() as counter:
                generate(
                    gm,
                    requests_of(1 + blocks * block_steps),
                    versions={ADAPTER: WeightsVersion(1, 0)},
                    block_steps=block_steps,
                )
            counts.append((counter.ops, counter.host_reads, transfers[0]))
    finally:
        LiveRows.to_host = to_host
    steps = (long_blocks - short_blocks) * block_steps
    return (
        (counts[1][0] - counts[0][0]) / steps,
        (counts[1][1] - counts[0][1]) / steps,
        (counts[1][2] - counts[0][2]) / (long_blocks - short_blocks),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--block-steps", type=int, default=1, help="decode passes per block")
    parser.add_argument("--static", action="store_true", help="static-shape passes")
    args = parser.parse_args()
    sampler.CPU_STATIC_DECODE = args.static
    model = build_model(args.model, torch.device("cpu"), torch.float32)
    kv = kv_shape(model)
    lora = LoraModel(model)
    lora.add_adapter(
        ADAPTER, AdapterSpec(rank=8, alpha=16, dropout=0.0, seed=0, train_unembed=True)
    )

    tokenizer = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
    eos = int(model.config.eos_token_id)
    # EOS that no token is: every row runs its max_tokens, so every step has the same rows.
    gm = GeneratorModel(model, lora, tokenizer, frozenset({-1}), PrefixCache(0), 1024, kv)
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=0)
    # Per repetition: the median decode step, then the floor right after it, so a load
    # change on a shared machine moves both (the ratio is the robust number).
    per_rep: list[tuple[float, float]] = []
    rows_seen = set()
    for rep in range(args.reps + 1):
        prompts = torch.randint(3, vocab, (args.prompts, args.prompt_tokens), generator=generator)
        requests = [
            GenerationRequest(tuple(p), args.samples, params, ADAPTER) for p in prompts.tolist()
        ]
        steps = decode_steps(gm, requests, args.block_steps)
        rows_seen.update(r for r, _ in steps)
        (rows,) = rows_seen
        if rep:  # the first is a warm-up
            per_rep.append((statistics.median(t for _, t in steps), matmul_floor(lora, rows)))
    step = statistics.median(t for t, _ in per_rep)
    floor = statistics.median(f for _, f in per_rep)
    ratio = statistics.median(t / f for t, f in per_rep)

    def requests_of(new_tokens: int) -> list[GenerationRequest]:
        prompts = torch.randint(3, vocab, (args.prompts, args.prompt_tokens), generator=generator)
        short = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=0)
        return [GenerationRequest(tuple(p), args.samples, short, ADAPTER) for p in prompts.tolist()]

    ops, host_reads, transfers = ops_per_step(gm, requests_of, args.block_steps)
    report = {
        "model": args.model,
        "block_steps": args.block_steps,
        "static": args.static,
        "eos": eos,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "step_ms": step * 1e3,
        "matmul_floor_ms": floor * 1e3,
        "overhead_ms": (step - floor) * 1e3,
        "step_over_floor": ratio,
        "tensor_ops_per_step": ops,
        "host_reads_per_step": host_reads,
        "results_transfers_per_block": transfers,
    }
    print(
        f"{args.model}, {rows} rows, {torch.get_num_threads()} threads: decode step "
        f"{step * 1e3:.2f} ms, matmul floor {floor * 1e3:.2f} ms, overhead "
        f"{(step - floor) * 1e3:.2f} ms ({ratio:.2f}x the floor, per-repetition median); "
        f"{ops:.0f} tensor ops and {host_reads:.0f} host reads per step, {transfers:.0f}"
        f" results transfer(s) per block of {args.block_steps} pass(es)"
        f"{' (static passes)' if args.static else ''}"
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
