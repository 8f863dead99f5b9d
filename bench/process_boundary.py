"""What a process boundary costs per engine call (engine/hosts/process/worker.py), against the
in-process engine in the same run: the same small operations on LocalEngine and on ProcessEngine
(one worker process), alternated, medians over --reps of each.

Operations: a forward-backward of one 8-token sample, an optim-step, a publish, a sample of
--sample-tokens tokens (each decode step crosses the pipe once for `between_tokens`), and a
forward-backward of a 32 x 128-token batch (what the boundary costs against real work).
OMP threads are stated; the worker inherits them.

    OMP_NUM_THREADS=1 python bench/process_boundary.py [--reps 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.engine.hosts.process.remote import ProcessEngine  # noqa: E402
from posttrain.types import (  # noqa: E402
    AdamParams,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    OptimStepRequest,
    SampleRequest,
    SamplingParams,
    TrainingSample,
)

CE = LossConfig(LossType.CROSS_ENTROPY)


def sample_of(length: int, start: int) -> TrainingSample:
    tokens = [(start + i) % 90 + 5 for i in range(length + 1)]
    return TrainingSample(
        tokens=tuple(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": (1.0,) * length,
        },
    )


def operations(engine, sample_tokens: int) -> dict[str, Callable[[], object]]:
    small = ForwardBackwardRequest((sample_of(8, 0),), CE)
    batch = ForwardBackwardRequest(tuple(sample_of(128, i) for i in range(32)), CE)
    step = OptimStepRequest(adam=AdamParams(learning_rate=1e-4))
    prompt = SampleRequest(
        prompts=((1, 40, 41, 42),),
        sampling_params=SamplingParams(max_tokens=sample_tokens, seed=1, stop=()),
    )
    version = iter(range(1, 10**9))
    return {
        "forward-backward, 8 tokens": lambda: engine.forward_backward_batch("r", [("s", small)]),
        "optim-step": lambda: engine.optim_step("r", "s", step),
        "publish": lambda: engine.publish("r", "s", version=next(version)),
        f"sample, {sample_tokens} tokens": lambda: engine.sample_batch(
            "r", [("s", prompt)], between_tokens=lambda: None
        ),
        "forward-backward, 32 x 128 tokens": lambda: engine.forward_backward_batch(
            "r", [("s", batch)]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--sample-tokens", type=int, default=32)
    args = parser.parse_args()
    config = EngineConfig(device="cpu")
    models = {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}
    engines = {"thread": LocalEngine(config, models), "process": ProcessEngine(config, models)}
    started = time.perf_counter()
    engines["process"].load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    spawn_s = time.perf_counter() - started
    engines["thread"].load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    ops = {}
    for name, engine in engines.items():
        engine.create_session("r", "s", LoraConfig(rank=8, seed=1))
        ops[name] = operations(engine, args.sample_tokens)
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for _ in range(args.reps):
            for op in ops["thread"]:
                for name in engines:  # alternated: the machine's drift hits both alike
                    begin = time.perf_counter()
                    ops[name][op]()
                    times.setdefault((name, op), []).append(time.perf_counter() - begin)
    finally:
        engines["process"].close()
    print(
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
        f" torch threads={torch.get_num_threads()} reps={args.reps}"
    )
    print(f"worker process start and model load: {spawn_s:.2f} s")
    print(f"{'operation':36} {'thread ms':>10} {'process ms':>11} {'added ms':>9} {'ratio':>6}")
    for op in ops["thread"]:
        thread = statistics.median(times[("thread", op)]) * 1e3
        process = statistics.median(times[("process", op)]) * 1e3
        added, ratio = process - thread, process / thread
        print(f"{op:36} {thread:10.2f} {process:11.2f} {added:9.2f} {ratio:6.2f}")


if __name__ == "__main__":
    main()
