"""GPU line of FSDP2 full-weight training (engine/parallel/fsdp.py,
`--trainer-ranks N` with a full-weight session): `fsdp2_check` is what bench/gpu_check.py
calls on the GPU machine; run alone it prints its report.

Ranks = the CUDA devices present (NCCL; one device is a world of one, which still runs
fully_shard, its MixedPrecisionPolicy (bfloat16 parameters, float32 reductions) and the
streamed checkpoints); `--device cpu` is a dry run on two gloo ranks. On the random 38M Qwen3
of bench/forward_backward.py it trains a full-weight session for --steps forward-backwards
(--rows x --tokens random tokens, cross-entropy) and AdamW steps on one process (LocalEngine,
one device) and on the group, alternated, and reports:

- loss agreement: the largest relative difference of the steps' losses (bfloat16 on CUDA,
  so `ok` allows 2e-2; float32 on the CPU dry run, 1e-4);
- step time: medians after one warm-up, and their ratio;
- per-rank bytes of the session (weights, optimizer state, gradients after a forward-backward)
  against one process's, each rank's share of the total.

    python bench/gpu_fsdp2.py --device cuda      # on the GPU machine
    python bench/gpu_fsdp2.py --device cpu       # a dry run here, two gloo ranks
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from forward_backward import MODEL_ID, make_samples, write_model  # noqa: E402

from posttrain.config import EngineConfig  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.engine.hosts.messages import MeasureSessionFootprint  # noqa: E402
from posttrain.engine.hosts.ranks.trainer_group import TrainerGroupEngine  # noqa: E402
from posttrain.types import (  # noqa: E402
    AdamParams,
    ForwardBackwardRequest,
    LossConfig,
    LossType,
    OptimStepRequest,
)

CE = LossConfig(LossType.CROSS_ENTROPY)
STEP = OptimStepRequest(adam=AdamParams(learning_rate=1e-5))
TOLERANCE = {"cuda": 2e-2, "cpu": 1e-4}


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def fsdp2_check(
    device: str = "cuda", *, steps: int = 4, rows: int = 8, tokens: int = 128
) -> dict[str, Any]:
    """One process against an FSDP2 group on every CUDA device (two gloo ranks on `cpu`):
    losses, step times and per-rank session bytes. Returns the report; `ok` says whether the
    losses agree within the device's tolerance and each rank holds at most 1.1x an even
    share of the weights."""
    ranks = torch.cuda.device_count() if device == "cuda" else 2
    if ranks < 1:
        raise RuntimeError("no CUDA device")
    one_config = EngineConfig(device=device)
    group_config = EngineConfig(device=device, trainer_ranks=ranks)
    samples = make_samples([tokens] * rows, seed=1)
    request = ForwardBackwardRequest(samples, CE)
    losses: dict[str, list[float]] = {"one": [], "fsdp2": []}
    times: dict[str, list[float]] = {"one": [], "fsdp2": []}
    with tempfile.TemporaryDirectory() as directory:
        write_model(Path(directory))
        models = {MODEL_ID: Path(directory)}
        local = LocalEngine(one_config, models)
        group = TrainerGroupEngine(group_config, models)
        try:
            engines = {"one": local, "fsdp2": group}
            for engine in engines.values():
                engine.load_resource("r", MODEL_ID, muon_scaling=None)
                engine.create_session("r", "f", None)
            for index in range(steps + 1):  # the first is the warm-up
                for name, engine in engines.items():
                    begin = time.perf_counter()
                    (outcome,) = engine.forward_backward_batch("r", [("f", request)])
                    if isinstance(outcome, Exception):
                        raise outcome
                    engine.optim_step("r", "f", STEP)
                    _synchronize(device)
                    if index:
                        times[name].append(time.perf_counter() - begin)
                    losses[name].append(outcome.loss)
            for engine in engines.values():
                (outcome,) = engine.forward_backward_batch("r", [("f", request)])
            one = local.session_footprint("r", "f")
            shares = group.on_every_rank(MeasureSessionFootprint("r", "f"))
        finally:
            group.close()
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(*losses.values(), strict=True))
    medians = {name: statistics.median(values) for name, values in times.items()}
    per_rank = [
        {
            "weights_bytes": s.weights_bytes,
            "optimizer_bytes": s.optimizer_bytes,
            "gradient_bytes": s.gradient_bytes,
            "weights_share": s.weights_bytes / one.weights_bytes,
        }
        for s in shares
    ]
    even = all(r["weights_share"] <= 1.1 / ranks for r in per_rank)
    return {
        "device": device,
        "ranks": ranks,
        "losses": losses,
        "loss_max_rel_diff": worst,
        "step_seconds": medians,
        "fsdp2_over_one": medians["fsdp2"] / medians["one"],
        "one_process_bytes": {
            "weights_bytes": one.weights_bytes,
            "optimizer_bytes": one.optimizer_bytes,
            "gradient_bytes": one.gradient_bytes,
        },
        "per_rank": per_rank,
        "ok": worst <= TOLERANCE[device] and even,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = fsdp2_check(args.device, steps=args.steps, rows=args.rows, tokens=args.tokens)
    print(
        f"FSDP2 on {report['ranks']} {args.device} rank(s): losses within"
        f" {report['loss_max_rel_diff']:.2e} of one process; step"
        f" {report['step_seconds']['fsdp2']:.3f} s vs {report['step_seconds']['one']:.3f} s"
        f" ({report['fsdp2_over_one']:.2f}x); weights share per rank"
        f" {[round(r['weights_share'], 3) for r in report['per_rank']]}; ok={report['ok']}"
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
