"""A LoRA session's sample on a vLLM server right after each weights-sync, in one process
(VllmEngine over the in-process trainer, no HTTP): the time a sample takes once the adapter was
reinstalled. vLLM loads an adapter again at every decode step of a request whose adapter was
registered in place (docs/continuous_batching.md, "Invariants"), so how an install registers
it shows
here. Run it from two trees, alternated, to compare them:

    python bench/vllm_sync_sample.py --vllm-python ~/.cache/posttrain/venv-vllm/bin/python
    PYTHONPATH=/path/to/other/tree python /path/to/other/tree/bench/vllm_sync_sample.py ...

Prints the median over --syncs samples (the first, which warms the server, left out).
`--pipeline`: PIPELINE syncs, whose install loads the adapter in place (for the requests
running then); the next sample's admit loads it afresh once none of the session's runs.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.engine.hosts.vllm.engine import VllmEngine  # noqa: E402
from posttrain.types import LoraConfig, SampleRequest, SamplingParams  # noqa: E402

PATHS = {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", type=Path, required=True)
    parser.add_argument("--syncs", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument(
        "--pipeline", action="store_true", help="PIPELINE syncs (the adapter loads in place)"
    )
    args = parser.parse_args()
    config = EngineConfig(device="cpu", dtype="float32")
    vllm = config.model_copy(update={"generators": "vllm", "vllm_python": args.vllm_python})
    engine = VllmEngine(LocalEngine(config, PATHS), vllm, PATHS)
    try:
        engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None, generator_replicas=1)
        engine.create_session("r", "s", LoraConfig(rank=args.rank, seed=1))
        params = SamplingParams(max_tokens=args.tokens, seed=3, stop_at_eos=False)
        request = SampleRequest(((1, 40, 41, 42),) * args.prompts, args.samples, params)
        seconds = []
        for version in range(1, args.syncs + 1):
            engine.publish("r", "s", version=version, mid_generation=args.pipeline)
            fence = engine.generator_fence("r")
            begin = time.perf_counter()
            engine.sample_batch("r", [("s", request)], fence=fence)
            seconds.append(time.perf_counter() - begin)
        print(
            f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, {args.prompts} prompts x"
            f" {args.samples} samples x {args.tokens} tokens, LoRA rank {args.rank}: a sample"
            f" after a {'PIPELINE ' if args.pipeline else ''}sync took"
            f" {statistics.median(seconds[1:]):.3f} s (median of"
            f" {len(seconds) - 1}; each: {', '.join(f'{s:.3f}' for s in seconds)})"
        )
    finally:
        engine.close()


if __name__ == "__main__":
    main()
