"""What a trainer group (engine/trainer_group.py, `--trainer-ranks N`) gains and costs.

1. A full-weight training step (forward-backward of --rows x --tokens random tokens, then an
   AdamW optim-step) on the random 38M-parameter Qwen3 of bench/forward_backward.py: one
   process on one thread (LocalEngine) against N ranks of one thread each. Medians of --reps
   steps after one warm-up, and their ratio; the same for a LoRA session; the tensor bytes one
   rank holds (replicated data parallel: every rank holds the whole model, its generator copy
   and the AdamW moments).
2. The per-operation overhead of the group against LocalEngine on the built-in tiny model:
   small operations, alternated, medians over --op-reps.

    python bench/trainer_ranks.py [--ranks 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from forward_backward import MODEL_ID, make_samples, write_model  # noqa: E402

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig  # noqa: E402
from posttrain.engine.local import LocalEngine  # noqa: E402
from posttrain.engine.trainer_group import TrainerGroupEngine  # noqa: E402
from posttrain.types import (  # noqa: E402
    AdamParams,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    OptimStepRequest,
)

CE = LossConfig(LossType.CROSS_ENTROPY)
STEP = OptimStepRequest(adam=AdamParams(learning_rate=1e-5))
LORA = LoraConfig(rank=8, alpha=16, seed=1)


def timed(call: Callable[[], object]) -> float:
    begin = time.perf_counter()
    outcome = call()
    if isinstance(outcome, list) and outcome and isinstance(outcome[0], Exception):
        raise outcome[0]
    return time.perf_counter() - begin


def training_steps(engine, samples, reps: int, lora: LoraConfig | None) -> list[float]:
    """Seconds of each of `reps` steps of a fresh session ("f": full weight with `lora` None)."""
    engine.load_resource("r", MODEL_ID, muon_scaling=None)
    session = "f" if lora is None else "l"
    engine.create_session("r", session, lora)
    request = ForwardBackwardRequest(samples, CE)

    def step() -> None:
        (outcome,) = engine.forward_backward_batch("r", [(session, request)])
        if isinstance(outcome, Exception):
            raise outcome
        engine.optim_step("r", session, STEP)

    step()  # warm-up: first-touch allocations, the AdamW moments
    times = [timed(step) for _ in range(reps)]
    if lora is not None:
        engine.drop_session("r", session)
    return times


def held_bytes(engine) -> tuple[int, int]:
    """(every tensor of the resource, what the session holds between steps: its weights, its
    generator's copy and its AdamW moments), on one process or on rank 0."""
    resource = engine.resource_footprint("r")
    session = engine.session_footprint("r", "f")
    return resource.total_bytes, session.resident_bytes


def operations(engine) -> dict[str, Callable[[], object]]:
    from process_boundary import sample_of

    small = ForwardBackwardRequest((sample_of(8, 0),), CE)
    batch = ForwardBackwardRequest(tuple(sample_of(128, i) for i in range(32)), CE)
    step = OptimStepRequest(adam=AdamParams(learning_rate=1e-4))
    version = iter(range(1, 10**9))
    return {
        "forward-backward, 8 tokens": lambda: engine.forward_backward_batch("r", [("s", small)]),
        "optim-step": lambda: engine.optim_step("r", "s", step),
        "publish": lambda: engine.publish("r", "s", version=next(version)),
        "forward-backward, 32 x 128 tokens": lambda: engine.forward_backward_batch(
            "r", [("s", batch)]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--op-reps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread per rank, and one for the single process
    one = EngineConfig(device="cpu")
    group_config = EngineConfig(device="cpu", trainer_ranks=args.ranks)
    print(f"cores={os.cpu_count()} ranks={args.ranks} torch threads per process=1")

    with tempfile.TemporaryDirectory() as directory:
        write_model(Path(directory))
        models = {MODEL_ID: Path(directory)}
        samples = make_samples([args.tokens] * args.rows, seed=1)
        local = LocalEngine(one, models)
        single_lora = training_steps(local, samples, args.reps, LORA)
        single = training_steps(local, samples, args.reps, None)
        single_bytes = held_bytes(local)
        del local
        group = TrainerGroupEngine(group_config, models)
        try:
            started = time.perf_counter()
            group.load_resource("r", MODEL_ID, muon_scaling=None)
            start_s = time.perf_counter() - started
            ranked_lora = training_steps(group, samples, args.reps, LORA)
            ranked = training_steps(group, samples, args.reps, None)
            rank_bytes = held_bytes(group)
        finally:
            group.close()
    one_s, n_s = statistics.median(single), statistics.median(ranked)
    print(f"\n38M full-weight step ({args.rows} x {args.tokens} tokens, CE, then AdamW)")
    print(f"  group start (spawn, import, load) on {args.ranks} ranks: {start_s:.1f} s")
    print(f"  1 process:  median {one_s:.3f} s  ({', '.join(f'{t:.3f}' for t in single)})")
    print(f"  {args.ranks} ranks:    median {n_s:.3f} s  ({', '.join(f'{t:.3f}' for t in ranked)})")
    print(f"  speed-up: {one_s / n_s:.2f}x")
    lora_one, lora_n = statistics.median(single_lora), statistics.median(ranked_lora)
    print(f"  LoRA rank 8, the same batch: 1 process {lora_one:.3f} s, {args.ranks} ranks")
    print(f"    {lora_n:.3f} s: speed-up {lora_one / lora_n:.2f}x")
    mib = 1 << 20
    print(
        f"  bytes per rank: resource {rank_bytes[0] / mib:.0f} MiB, session"
        f" {rank_bytes[1] / mib:.0f} MiB (one process: {single_bytes[0] / mib:.0f} MiB,"
        f" {single_bytes[1] / mib:.0f} MiB): replicated, not sharded"
    )

    models = {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}
    engines = {"local": LocalEngine(one, models), "group": TrainerGroupEngine(group_config, models)}
    times: dict[tuple[str, str], list[float]] = {}
    try:
        ops = {}
        for name, engine in engines.items():
            engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
            engine.create_session("r", "s", LoraConfig(rank=8, seed=1))
            ops[name] = operations(engine)
        for _ in range(args.op_reps):
            for op in ops["local"]:
                for name in engines:  # alternated: the machine's drift hits both alike
                    times.setdefault((name, op), []).append(timed(ops[name][op]))
    finally:
        engines["group"].close()
    print(f"\nbuilt-in model, LoRA rank 8: per-operation cost, medians of {args.op_reps}")
    print(f"{'operation':36} {'local ms':>9} {'group ms':>9} {'added ms':>9} {'ratio':>6}")
    for op in ops["local"]:
        local_ms = statistics.median(times[("local", op)]) * 1e3
        group_ms = statistics.median(times[("group", op)]) * 1e3
        print(
            f"{op:36} {local_ms:9.2f} {group_ms:9.2f} {group_ms - local_ms:9.2f}"
            f" {group_ms / local_ms:6.2f}"
        )


if __name__ == "__main__":
    main()
