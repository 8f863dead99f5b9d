"""The vLLM line of the GPU check: posttrain's trainer with its generator on a vLLM server
(`--generators vllm`, engine/hosts/vllm/engine.py) on one model, against the built-in sampler.

`run(device, small)` is what bench/gpu_check.py calls (`vllm_line` on its model, with the
interpreter in POSTTRAIN_VLLM_PYTHON or .venv-vllm) where a vLLM build is on the device machine;
it reports, for a LoRA rank 32 session:

1. mismatch: |vLLM's sampled-token logprob - the trainer's forward_only logprob| on the same
   tokens, max and mean (float32 on the CPU: within 1e-4; bfloat16 on a GPU: bfloat16's
   rounding, two kernels);
2. sampling tokens/s on one shape through vLLM and through the built-in sampler;
3. weights-sync until served (a publish and a one-token sample, less a one-token sample).

Where the given interpreter has no vLLM, the line says so and measures nothing.

    python bench/gpu_vllm.py --vllm-python .venv-vllm/bin/python --device cpu --small
    python bench/gpu_vllm.py --vllm-python PATH --device cuda        # a GPU build of vLLM
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from posttrain.config import EngineConfig  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.engine.hosts.vllm.engine import VllmEngine  # noqa: E402
from posttrain.types import (  # noqa: E402
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    SampleRequest,
    SamplingParams,
    TrainingSample,
)

MODEL_ID = "gpu-vllm-check"
CE = LossConfig(LossType.CROSS_ENTROPY)


def has_vllm(python: Path) -> str | None:
    """None when `python` imports vllm; else why not."""
    done = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
    )
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]


def forward_logprobs(engine, prompt: tuple[int, ...], tokens: list[int]) -> list[float]:
    full = list(prompt) + tokens
    weights = (0.0,) * (len(prompt) - 1) + (1.0,) * len(tokens)
    sample = TrainingSample(
        tuple(full[:-1]), {"target_tokens": tuple(float(t) for t in full[1:]), "weights": weights}
    )
    request = ForwardBackwardRequest((sample,), CE, forward_only=True, return_loss_fn_outputs=True)
    (outcome,) = engine.forward_backward_batch("r", [("s", request)])
    assert not isinstance(outcome, Exception), outcome
    return outcome.loss_fn_outputs[0][len(prompt) - 1 :]


def vllm_line(
    model_dir: Path,
    vllm_python: Path,
    *,
    device: str,
    prompts: int = 8,
    samples: int = 8,
    new_tokens: int = 128,
) -> dict:
    """The vLLM line's report (see the module docstring)."""
    why = has_vllm(vllm_python)
    if why is not None:
        return {"vllm": f"skipped: {vllm_python} cannot import vllm ({why})"}
    config = EngineConfig(device=device)
    paths = {MODEL_ID: model_dir}
    config_vllm = config.model_copy(update={"generators": "vllm", "vllm_python": vllm_python})
    builtin = LocalEngine(config, paths)
    begin = time.perf_counter()
    engine = VllmEngine(LocalEngine(config, paths), config_vllm, paths)
    report: dict = {}
    try:
        for each in (builtin, engine):
            each.load_resource("r", MODEL_ID, muon_scaling=None, generator_replicas=1)
            each.create_session("r", "s", LoraConfig(rank=32, seed=1))
        report["vllm_start_s"] = round(time.perf_counter() - begin, 1)
        vocab = engine.model_info(MODEL_ID).vocab_size
        generator = torch.Generator().manual_seed(0)
        shape = [
            tuple(torch.randint(3, vocab, (64,), generator=generator).tolist())
            for _ in range(prompts)
        ]
        params = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=1, stop_at_eos=False)
        request = SampleRequest(tuple(shape), samples, params)
        diffs: list[float] = []
        (results,) = engine.sample_batch("r", [("s", request)], fence=engine.generator_fence("r"))
        for prompt, result in zip(shape, results[:2], strict=False):
            for sequence in result.sequences[:2]:
                forward = forward_logprobs(engine, prompt, sequence.tokens)
                diffs += [abs(a - b) for a, b in zip(forward, sequence.logprobs, strict=True)]
        report["mismatch_max"] = max(diffs)
        report["mismatch_mean"] = statistics.fmean(diffs)
        tokens = prompts * samples * new_tokens
        for name, each in (("builtin", builtin), ("vllm", engine)):
            times = []
            for _ in range(3):
                start = time.perf_counter()
                if each is engine:
                    each.sample_batch("r", [("s", request)], fence=each.generator_fence("r"))
                else:
                    each.sample_batch("r", [("s", request)])
                times.append(time.perf_counter() - start)
            report[f"{name}_tokens_per_s"] = round(tokens / statistics.median(times))
        one = SampleRequest(tuple(shape[:1]), 1, SamplingParams(max_tokens=1, seed=1))
        versions = iter(range(2, 10**9))

        def one_token() -> float:
            start = time.perf_counter()
            engine.sample_batch("r", [("s", one)], fence=engine.generator_fence("r"))
            return time.perf_counter() - start

        def synced() -> float:
            start = time.perf_counter()
            engine.publish("r", "s", version=next(versions))
            one_token()
            return time.perf_counter() - start

        base = statistics.median(one_token() for _ in range(3))
        report["sync_ms_lora_r32"] = round(
            (statistics.median(synced() for _ in range(3)) - base) * 1e3, 1
        )
    finally:
        engine.close()
        builtin.close()
    return report


def vllm_python_given() -> Path | None:
    """The vLLM interpreter the server would use: POSTTRAIN_VLLM_PYTHON, else the repo's
    .venv-vllm (scripts/build_vllm_env.sh's default), else None."""
    given = os.environ.get("POSTTRAIN_VLLM_PYTHON")
    if given:
        return Path(given).absolute()
    default = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    return default if default.exists() else None


def run(device: str, small: bool) -> dict:
    """bench/gpu_check.py's optional vLLM section: the line on gpu_check's model shape (its
    SMALL one when `small`), with the vLLM interpreter from vllm_python_given()."""
    python = vllm_python_given()
    if python is None:  # gpu_check reports it as "skipped: RuntimeError: ..."
        raise RuntimeError("no vLLM interpreter: set POSTTRAIN_VLLM_PYTHON or build .venv-vllm")
    from gpu_check import QWEN3_0_6B, SMALL, build_model  # bench/gpu_check.py's model

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    directory = Path(tempfile.mkdtemp(prefix="gpu-vllm-"))
    build_model(directory, SMALL if small else QWEN3_0_6B, torch.device(device), dtype)
    shape = {"prompts": 2, "samples": 2, "new_tokens": 16} if small else {}
    return vllm_line(directory, python, device=device, **shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vllm-python", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny model, a short run")
    args = parser.parse_args()
    from gpu_check import QWEN3_0_6B, SMALL, build_model  # bench/gpu_check.py's model

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    directory = Path(tempfile.mkdtemp(prefix="gpu-vllm-"))
    build_model(directory, SMALL if args.small else QWEN3_0_6B, device, dtype)
    shape = {"prompts": 2, "samples": 2, "new_tokens": 16} if args.small else {}
    report = vllm_line(directory, args.vllm_python.absolute(), device=args.device, **shape)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
