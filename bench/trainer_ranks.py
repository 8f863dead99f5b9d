"""What a trainer group (engine/hosts/ranks/trainer_group.py, `--trainer-ranks N`) gains and costs.

1. A full-weight training step (forward-backward of --rows x --tokens random tokens, then an
   AdamW optim-step) on the random 38M-parameter Qwen3 of bench/forward_backward.py: one
   process on one thread (LocalEngine) against N ranks of one thread each, their steps
   alternated. Medians of --reps steps after one warm-up, and their ratio; the same for a LoRA
   session. The tensor bytes each rank holds: a full-weight session's weights, gradients and
   AdamW moments are sharded (FSDP2, engine/parallel/fsdp.py), the generator's copy is rank
   0's alone.
2. LoRA: what sharding the frozen base would cost, against a LoRA step: the time of one gloo
   all-gather of the base's bytes over the N ranks (a sharded base needs one per forward, and
   again for the backward), medians of 3 in a group of its own.
3. The per-operation overhead of the group against LocalEngine on the built-in tiny model:
   small operations, alternated, medians over --op-reps.

4. With --fsdp2: only (1)'s full-weight step, bytes and peak memory, for one process and N
   ranks (the session sharded with FSDP2, engine/parallel/fsdp.py), alternated. Peak memory
   is each process's VmHWM (peak resident set) less its resident set before the session was
   created: what the session and its steps added at their peak. The one process runs in a
   worker process for this (ProcessEngine, measured as the ranks are); its step time is
   LocalEngine's. (docs/benchmarks.md has this against posttrain's own ZeRO-3, which FSDP2
   replaced, measured alternated before it went.)

    python bench/trainer_ranks.py [--ranks 2] [--reps 5] [--fsdp2]
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
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.engine.hosts.messages import (  # noqa: E402
    MeasureResourceFootprint,
    MeasureSessionFootprint,
)
from posttrain.engine.hosts.process.remote import ProcessEngine  # noqa: E402
from posttrain.engine.hosts.ranks.trainer_group import TrainerGroupEngine  # noqa: E402
from posttrain.types import (  # noqa: E402
    AdamParams,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    OperationKind,
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


def training_steps(
    engines: dict[str, object], samples, reps: int, lora: LoraConfig | None
) -> dict[str, list[float]]:
    """Seconds of each of `reps` steps of a fresh session on each engine ("f": full weight with
    `lora` None), the engines' steps alternated so the machine's drift hits them alike."""
    session = "f" if lora is None else "l"
    request = ForwardBackwardRequest(samples, CE)

    def step(engine) -> None:
        (outcome,) = engine.forward_backward_batch("r", [(session, request)])
        if isinstance(outcome, Exception):
            raise outcome
        engine.optim_step("r", session, STEP)

    for engine in engines.values():
        engine.create_session("r", session, lora)
        step(engine)  # warm-up: first-touch allocations, the AdamW moments
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(reps):
        for name, engine in engines.items():
            times[name].append(timed(lambda engine=engine: step(engine)))
    return times


def held_bytes(engine, ranks: int) -> list[tuple[int, int, int, int]]:
    """Per rank (one process: one entry): every tensor of the resource, and the session's
    weights, optimizer state and accumulated gradients (after a forward-backward)."""
    request = ForwardBackwardRequest(make_samples([16], seed=2), CE)
    (outcome,) = engine.forward_backward_batch("r", [("f", request)])
    if isinstance(outcome, Exception):
        raise outcome
    if ranks == 1:
        resources, sessions = [engine.resource_footprint("r")], [engine.session_footprint("r", "f")]
    else:
        resources = engine.on_every_rank(MeasureResourceFootprint("r"))
        sessions = engine.on_every_rank(MeasureSessionFootprint("r", "f"))
    engine.optim_step("r", "f", STEP)
    return [
        (r.total_bytes, s.weights_bytes, s.optimizer_bytes, s.gradient_bytes)
        for r, s in zip(resources, sessions, strict=True)
    ]


def _gather_rank(rank: int, world: int, address: str, numel: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    shard = torch.ones(numel // world)
    full = [torch.empty_like(shard) for _ in range(world)]
    times = []
    for _ in range(4):
        dist.barrier()
        begin = time.perf_counter()
        dist.all_gather(full, shard)
        times.append(time.perf_counter() - begin)
    dist.destroy_process_group()
    if rank == 0:
        out.put(statistics.median(times[1:]))


def all_gather_seconds(numel: int, world: int) -> float:
    """Median seconds of a gloo all-gather of `numel` float32 values sharded over `world`
    processes on this host (what a sharded frozen base pays per forward)."""
    import multiprocessing
    import socket

    with socket.socket() as probe:  # a port free now, for the group's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    address = f"tcp://127.0.0.1:{port}"
    ranks = [
        context.Process(target=_gather_rank, args=(rank, world, address, numel, out))
        for rank in range(world)
    ]
    for process in ranks:
        process.start()
    seconds = out.get(timeout=600)
    for process in ranks:
        process.join()
    return seconds


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
    parser.add_argument("--fsdp2", action="store_true", help="the full-weight step only")
    args = parser.parse_args()
    if args.fsdp2:
        fsdp2(args)
        return
    torch.set_num_threads(1)  # one thread per rank, and one for the single process
    one = EngineConfig(device="cpu")
    group_config = EngineConfig(device="cpu", trainer_ranks=args.ranks)
    print(f"cores={os.cpu_count()} ranks={args.ranks} torch threads per process=1")

    with tempfile.TemporaryDirectory() as directory:
        write_model(Path(directory))
        models = {MODEL_ID: Path(directory)}
        samples = make_samples([args.tokens] * args.rows, seed=1)
        local = LocalEngine(one, models)
        group = TrainerGroupEngine(group_config, models)
        try:
            local.load_resource("r", MODEL_ID, muon_scaling=None)
            started = time.perf_counter()
            group.load_resource("r", MODEL_ID, muon_scaling=None)
            start_s = time.perf_counter() - started
            engines = {"one": local, "group": group}
            lora = training_steps(engines, samples, args.reps, LORA)
            for engine in engines.values():
                engine.drop_session("r", "l")
            full = training_steps(engines, samples, args.reps, None)
            single_bytes = held_bytes(local, 1)
            rank_bytes = held_bytes(group, args.ranks)
            base = local.resource_footprint("r").base_parameters
        finally:
            group.close()
    one_s, n_s = statistics.median(full["one"]), statistics.median(full["group"])
    print(f"\n38M full-weight step ({args.rows} x {args.tokens} tokens, CE, then AdamW)")
    print(f"  group start (spawn, import, load) on {args.ranks} ranks: {start_s:.1f} s")
    for name, label in (("one", "1 process"), ("group", f"{args.ranks} ranks")):
        times = ", ".join(f"{t:.3f}" for t in full[name])
        print(f"  {label:10}  median {statistics.median(full[name]):.3f} s  ({times})")
    print(f"  speed-up: {one_s / n_s:.2f}x")
    lora_one, lora_n = statistics.median(lora["one"]), statistics.median(lora["group"])
    print(f"  LoRA rank 8, the same batch: 1 process {lora_one:.3f} s, {args.ranks} ranks")
    print(f"    {lora_n:.3f} s: speed-up {lora_one / lora_n:.2f}x")
    mib = 1 << 20
    print("  MiB held (resource total; session weights, optimizer state, gradients):")
    for label, rows in (("1 process", single_bytes), (f"{args.ranks} ranks", rank_bytes)):
        for rank, (total, weights, optimizer, gradients) in enumerate(rows):
            print(
                f"    {label} rank {rank}: {total / mib:.0f}; {weights / mib:.0f},"
                f" {optimizer / mib:.1f}, {gradients / mib:.1f}"
            )
    gather_s = all_gather_seconds(base, args.ranks)
    print(
        f"\nLoRA, frozen base of {base / 1e6:.1f}M float32 parameters: one all-gather over"
        f" {args.ranks} gloo ranks {gather_s:.3f} s; a sharded base pays about two per step"
        f" ({2 * gather_s:.3f} s) against a {lora_n:.3f} s LoRA step on {args.ranks} ranks,"
        f" to save {(args.ranks - 1) / args.ranks * base * 4 / mib:.0f} MiB per rank"
    )

    if args.op_reps:
        per_operation(args.op_reps, one, group_config)


def per_operation(reps: int, one: EngineConfig, group_config: EngineConfig) -> None:
    models = {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}
    engines = {"local": LocalEngine(one, models), "group": TrainerGroupEngine(group_config, models)}
    times: dict[tuple[str, str], list[float]] = {}
    try:
        ops = {}
        for name, engine in engines.items():
            engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
            engine.create_session("r", "s", LoraConfig(rank=8, seed=1))
            ops[name] = operations(engine)
        for _ in range(reps):
            for op in ops["local"]:
                for name in engines:  # alternated: the machine's drift hits both alike
                    times.setdefault((name, op), []).append(timed(ops[name][op]))
    finally:
        engines["group"].close()
    print(f"\nbuilt-in model, LoRA rank 8: per-operation cost, medians of {reps}")
    print(f"{'operation':36} {'local ms':>9} {'group ms':>9} {'added ms':>9} {'ratio':>6}")
    for op in ops["local"]:
        local_ms = statistics.median(times[("local", op)]) * 1e3
        group_ms = statistics.median(times[("group", op)]) * 1e3
        print(
            f"{op:36} {local_ms:9.2f} {group_ms:9.2f} {group_ms - local_ms:9.2f}"
            f" {group_ms / local_ms:6.2f}"
        )


def _proc_kib(pid: int, field: str) -> int:
    """A field of /proc/<pid>/status in KiB (VmRSS: resident now, VmHWM: its peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def fsdp2(args: argparse.Namespace) -> None:
    """Full-weight steps, bytes and peak memory per process: one process and FSDP2 ranks."""
    torch.set_num_threads(1)
    print(f"cores={os.cpu_count()} ranks={args.ranks} torch threads per process=1")
    with tempfile.TemporaryDirectory() as directory:
        write_model(Path(directory))
        models = {MODEL_ID: Path(directory)}
        samples = make_samples([args.tokens] * args.rows, seed=1)
        request = ForwardBackwardRequest(samples, CE)
        local = LocalEngine(EngineConfig(device="cpu"), models)
        worker = ProcessEngine(EngineConfig(device="cpu", workers="process"), models)
        group = TrainerGroupEngine(EngineConfig(device="cpu", trainer_ranks=args.ranks), models)
        engines = {"one": local, "fsdp2": group}
        try:
            for engine in (local, worker, group):
                engine.load_resource("r", MODEL_ID, muon_scaling=None)
            pids = {"one": [worker.worker_pid("r")], "fsdp2": group.rank_pids("r")}
            base = {name: [_proc_kib(p, "VmRSS") for p in ps] for name, ps in pids.items()}
            full = training_steps(engines, samples, args.reps, None)
            worker.create_session("r", "f", None)
            for _ in range(2):  # the worker's steps, for its peak alone
                (outcome,) = worker.forward_backward_batch("r", [("f", request)])
                assert not isinstance(outcome, Exception), outcome
                worker.optim_step("r", "f", STEP)
            peak = {
                name: [_proc_kib(p, "VmHWM") - b for p, b in zip(ps, base[name], strict=True)]
                for name, ps in pids.items()
            }
            held = {
                name: held_bytes(engine, 1 if name == "one" else args.ranks)
                for name, engine in engines.items()
            }
            admission = {
                name: (
                    engine.resource_footprint("r").total_bytes,
                    engine.peak_bytes("r", OperationKind.FORWARD_BACKWARD, [("f", request)]),
                )
                for name, engine in engines.items()
            }
        finally:
            worker.close()
            group.close()
    mib = 1 << 20
    print(f"\n38M full-weight step ({args.rows} x {args.tokens} tokens, CE, then AdamW)")
    for name, times in full.items():
        listed = ", ".join(f"{t:.3f}" for t in times)
        print(f"  {name:6} median {statistics.median(times):.3f} s  ({listed})")
    one, ranks = statistics.median(full["one"]), statistics.median(full["fsdp2"])
    print(f"  fsdp2 / one step time: {ranks / one:.2f}")
    print("  peak MiB a process added (VmHWM less its resident set before the session):")
    one_peak = peak["one"][0]
    for name, kibs in peak.items():
        listed = ", ".join(f"{kib / 1024:.0f} ({kib / one_peak:.2f}x one)" for kib in kibs)
        print(f"    {name}: {listed}")
    print("  MiB held (resource total; session weights, optimizer state, gradients):")
    for name, rows in held.items():
        for rank, (total, weights, optimizer, gradients) in enumerate(rows):
            print(
                f"    {name} rank {rank}: {total / mib:.0f}; {weights / mib:.0f},"
                f" {optimizer / mib:.1f}, {gradients / mib:.1f}"
            )
    print("  admission, rank 0 (MiB resident + estimated forward-backward peak = need):")
    for name, (resident, need) in admission.items():
        print(
            f"    {name}: {resident / mib:.0f} + {need / mib:.0f} = {(resident + need) / mib:.0f}"
        )


if __name__ == "__main__":
    main()
