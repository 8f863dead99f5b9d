"""Generator replicas (engine/hosts/replicas/engine.py) against one replica and the inline
generator, in the same run: sampling throughput, weights-sync latency against the bytes moved, and
what the boundary adds to one small sample. One thread per process (set here, before anything
starts).

1. Sampling throughput: --requests sample operations of --prompts prompts x --samples samples x
   --tokens new tokens, submitted from two threads at once, on two generator lanes (two
   replicas) and on one (one replica, the lanes' work in turn); the inline generator (in this
   process, one at a time) is the baseline. Medians over --reps; tokens/s and the ratio.
2. Weights-sync latency: a publish through the replicas (pack the tensors for the replicas'
   channel) and until a replica serves them (a one-token sample after it, minus a one-token
   sample without one), for a LoRA adapter and for a full-weight session, against the bytes;
   for each weights transport (engine/hosts/replicas/weights_broadcast.py): a gloo broadcast in the
   resource's weights group (the default) and each replica's pipe, alternated.
3. Boundary: one small sample through a replica vs inline.

    python bench/scale_out.py [--model 40m] [--reps 3]
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch loads, here and in every spawned replica

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.engine.hosts.replicas.engine import ReplicatedEngine  # noqa: E402
from posttrain.types import LoraConfig, SampleRequest, SamplingParams  # noqa: E402

CONFIG = EngineConfig(device="cpu", dtype="float32")


def model_paths(model: str, directory: Path) -> tuple[str, dict[str, Path]]:
    if model == "tiny":
        return BUILTIN_MODEL_ID, {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}
    from forward_backward import MODEL_ID, write_model

    write_model(directory)
    return MODEL_ID, {MODEL_ID: directory}


def request(args: argparse.Namespace, seed: int, tokens: int | None = None) -> SampleRequest:
    prompts = tuple(tuple(range(5 + p, 13 + p)) for p in range(args.prompts))
    return SampleRequest(
        prompts=prompts,
        num_samples=args.samples,
        sampling_params=SamplingParams(
            max_tokens=tokens or args.tokens, temperature=1.0, seed=seed, stop=()
        ),
    )


PIPE = CONFIG.model_copy(update={"weights_transport": "pipe"})


def engines(model_id: str, paths: dict[str, Path]) -> dict[str, object]:
    built: dict[str, object] = {"inline": LocalEngine(CONFIG, paths)}
    for replicas in (1, 2):
        built[f"{replicas} replica" + ("s" if replicas > 1 else "")] = ReplicatedEngine(
            LocalEngine(CONFIG, paths), CONFIG, paths
        )
    built["2 replicas, pipe"] = ReplicatedEngine(LocalEngine(PIPE, paths), PIPE, paths)
    for name, engine in built.items():
        replicas = 2 if name.startswith("2") else 1
        engine.load_resource("r", model_id, muon_scaling=None, generator_replicas=replicas)
        engine.create_session("r", "s", LoraConfig(rank=32, seed=1))
        engine.publish("r", "s", version=1)
    return built


def throughput(engine, args: argparse.Namespace) -> float:
    """Seconds for --requests samples from two threads; lanes as the engine has."""
    lanes = max(engine.generator_lanes("r"), 1)
    fence = engine.generator_fence("r")
    begin = time.perf_counter()

    def lane(index: int) -> None:
        for seed in range(index, args.requests, 2):
            batch = [("s", request(args, seed))]
            if engine.generator_lanes("r") == 0:  # an inline generator has no lanes
                engine.sample_batch("r", batch)
            else:
                engine.sample_batch("r", batch, fence=fence, lane=index % lanes)

    if engine.generator_lanes("r") == 0:
        lane(0), lane(1)  # inline: one generator, one at a time (the scheduler's order)
    else:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lane, (0, 1)))
    return time.perf_counter() - begin


def median_ms(run: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        begin = time.perf_counter()
        run()
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3


def sync_latency(
    engine, args: argparse.Namespace, reps: int, session: str = "s"
) -> tuple[float, float]:
    """(publish ms, publish + served-by-both-replicas ms) for `session`."""
    one = request(args, 0, tokens=1)
    version = iter(range(2, 10**9))

    def publish() -> None:
        engine.publish("r", session, version=next(version))

    def sample() -> None:
        fence = engine.generator_fence("r")
        for lane in range(engine.generator_lanes("r")):
            engine.sample_batch("r", [(session, one)], fence=fence, lane=lane)

    def served() -> None:
        publish()
        sample()

    baseline = median_ms(sample, reps)
    return median_ms(publish, reps), median_ms(served, reps) - baseline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=("tiny", "40m"), default="tiny")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    directory = Path(tempfile.mkdtemp(prefix="scale-out-"))
    model_id, paths = model_paths(args.model, directory)
    started = time.perf_counter()
    built = engines(model_id, paths)
    start_s = time.perf_counter() - started
    print(
        f"model={args.model} OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
        f" torch threads={torch.get_num_threads()} reps={args.reps} cores={os.cpu_count()}"
    )
    print(f"four engines (five replica processes) started and loaded: {start_s:.1f} s")
    try:
        tokens = args.requests * args.prompts * args.samples * args.tokens
        seconds: dict[str, list[float]] = {name: [] for name in built}
        for _ in range(args.reps):
            for name, engine in built.items():  # alternated: drift hits all alike
                seconds[name].append(throughput(engine, args))
        inline = statistics.median(seconds["inline"])
        print(
            f"\nsampling: {args.requests} requests x {args.prompts} prompts x {args.samples}"
            f" samples x {args.tokens} tokens = {tokens} tokens, two submitting threads"
        )
        print(f"{'generators':14} {'median s':>9} {'tokens/s':>9} {'vs inline':>10} {'vs 1':>6}")
        one = statistics.median(seconds["1 replica"])
        for name, values in seconds.items():
            median = statistics.median(values)
            print(
                f"{name:14} {median:9.3f} {tokens / median:9.0f} {inline / median:10.2f}"
                f" {one / median:6.2f}"
            )

        transports = {"broadcast": built["2 replicas"], "pipe": built["2 replicas, pipe"]}
        engine = transports["broadcast"]
        lora_bytes = sum(
            t.numel() * t.element_size() for t in engine.generator_state("r", "s")[0].values()
        )
        reps = max(args.reps, 5)
        latency: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(reps):  # alternated: drift hits both alike
            for name, engine in transports.items():
                latency.setdefault(("LoRA r32", name), []).append(sync_latency(engine, args, 3))
        inline_publish = median_ms(lambda: built["inline"].publish("r", "s", version=1), reps)
        for engine in transports.values():
            engine.drop_session("r", "s")
            engine.create_session("r", "f", None)  # full weight: the whole model crosses
        full = engine.generator_state("r", "f")[0]
        full_bytes = sum(t.numel() * t.element_size() for t in full.values())
        for _ in range(max(args.reps, 3)):
            for name, engine in transports.items():
                latency.setdefault(("full weight", name), []).append(
                    sync_latency(engine, args, 3, session="f")
                )
        print("\nweights-sync to two replicas, until both serve it (median ms)")
        print(
            f"{'session':12} {'transport':10} {'bytes':>10} {'publish':>8} {'served':>8}"
            f" {'MB/s':>6}"
        )
        for (session, name), values in latency.items():
            publish_ms = statistics.median(v[0] for v in values)
            served_ms = statistics.median(v[1] for v in values)
            size = lora_bytes if session.startswith("LoRA") else full_bytes
            print(
                f"{session:12} {name:10} {size:10d} {publish_ms:8.2f} {served_ms:8.2f}"
                f" {size / served_ms / 1e3:6.0f}"
            )
        print(f"inline generator, LoRA r32 publish: {inline_publish:.2f} ms")
        for name, engine in transports.items():
            print(f"{name} deliveries: {engine.delivery('r')}")

        small = request(args, 0, tokens=4)
        fence = built["1 replica"].generator_fence("r")
        through = median_ms(
            lambda: built["1 replica"].sample_batch("r", [("s", small)], fence=fence), 10
        )
        here = median_ms(lambda: built["inline"].sample_batch("r", [("s", small)]), 10)
        print(f"\nboundary: one {args.prompts}x{args.samples} sample of 4 tokens, median ms")
        print(f"inline {here:.2f}  replica {through:.2f}  added {through - here:.2f}")
    finally:
        for engine in built.values():
            close = getattr(engine, "close", None)
            if close is not None:
                close()


if __name__ == "__main__":
    main()
