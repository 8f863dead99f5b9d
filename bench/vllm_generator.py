"""The built-in sampler against a vLLM server (`--generators vllm`, engine/hosts/vllm/engine.py)
on the same machine, in the same run: the same sample operations through both, and the
weights-sync latency until the new weights are served, for a LoRA rank 32 adapter and for the
full model. Medians over --reps, the two alternated so drift hits both alike.

1. Sampling: --requests sample operations of --prompts prompts x --samples samples x --tokens
   new tokens (no EOS stop, so every sequence runs to --tokens), one after another; tokens/s
   and the ratio. The built-in sampler runs in this process on --threads torch threads; the
   vLLM server runs in its own processes (its CPU backend picks its own threads).
2. Weights-sync: a publish and until the server serves it (a one-token sample after it, minus
   a one-token sample without one): the files written, the adapter loaded in place (or the
   model reloaded through the worker extension), the prefix cache reset.

    python bench/vllm_generator.py --vllm-python .venv-vllm/bin/python [--reps 3]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.engine.hosts.vllm.engine import VllmEngine  # noqa: E402
from posttrain.types import LoraConfig, SampleRequest, SamplingParams  # noqa: E402

PATHS = {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}


def request(args: argparse.Namespace, seed: int, tokens: int | None = None) -> SampleRequest:
    prompts = tuple(tuple(range(5 + p, 13 + p)) for p in range(args.prompts))
    params = SamplingParams(
        max_tokens=tokens or args.tokens, temperature=1.0, seed=seed, stop_at_eos=False
    )
    return SampleRequest(prompts=prompts, num_samples=args.samples, sampling_params=params)


def sample(engine, session: str, req: SampleRequest) -> None:
    if engine.generator_lanes("r") == 0:
        engine.sample_batch("r", [(session, req)])
    else:
        engine.sample_batch("r", [(session, req)], fence=engine.generator_fence("r"), lane=0)


def median_ms(run: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        begin = time.perf_counter()
        run()
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3


def sync_ms(engine, args: argparse.Namespace, session: str, reps: int) -> float:
    """A publish until served, less a one-token sample without one (median ms)."""
    one = request(args, 0, tokens=1)
    versions = iter(range(2, 10**9))

    def served() -> None:
        engine.publish("r", session, version=next(versions))
        sample(engine, session, one)

    return median_ms(served, reps) - median_ms(lambda: sample(engine, session, one), reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=Path(os.environ.get("POSTTRAIN_VLLM_PYTHON", ".venv-vllm/bin/python")),
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(device="cpu", dtype="float32")
    vllm_config = config.model_copy(
        update={"generators": "vllm", "vllm_python": args.vllm_python.absolute()}
    )
    built = {"built-in": LocalEngine(config, PATHS)}
    begin = time.perf_counter()
    built["vLLM"] = VllmEngine(LocalEngine(config, PATHS), vllm_config, PATHS)
    try:
        for engine in built.values():
            engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None, generator_replicas=1)
            engine.create_session("r", "s", LoraConfig(rank=32, seed=1))
            engine.publish("r", "s", version=1)
        print(
            f"model={BUILTIN_MODEL_ID} torch threads={torch.get_num_threads()} reps={args.reps}"
            f" cores={os.cpu_count()}; the vLLM server started and served: "
            f"{time.perf_counter() - begin:.1f} s"
        )
        tokens = args.requests * args.prompts * args.samples * args.tokens
        seconds: dict[str, list[float]] = {name: [] for name in built}
        for rep in range(args.reps):
            for name, engine in built.items():
                begin = time.perf_counter()
                for seed in range(args.requests):
                    sample(engine, "s", request(args, 100 * rep + seed))
                seconds[name].append(time.perf_counter() - begin)
        print(
            f"\nsampling: {args.requests} requests x {args.prompts} prompts x {args.samples}"
            f" samples x {args.tokens} tokens = {tokens} tokens, one request at a time"
        )
        base = statistics.median(seconds["built-in"])
        print(f"{'sampler':10} {'median s':>9} {'tokens/s':>9} {'vs built-in':>12}")
        for name, values in seconds.items():
            median = statistics.median(values)
            print(f"{name:10} {median:9.3f} {tokens / median:9.0f} {base / median:12.2f}")

        print("\nweights-sync until served (median ms)")
        print(f"{'session':12} {'bytes':>10} " + " ".join(f"{n:>10}" for n in built))
        for label, session in (("LoRA r32", "s"), ("full weight", "f")):
            if session == "f":
                for engine in built.values():
                    engine.drop_session("r", "s")
                    engine.create_session("r", "f", None)
            state = built["built-in"].generator_state("r", session)[0]
            size = sum(t.numel() * t.element_size() for t in state.values())
            cells = [sync_ms(engine, args, session, max(args.reps, 3)) for engine in built.values()]
            print(f"{label:12} {size:10,} " + " ".join(f"{c:10.1f}" for c in cells))
    finally:
        for engine in built.values():
            engine.close()


if __name__ == "__main__":
    main()
