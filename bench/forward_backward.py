"""Training forward-backward: posttrain's engine against the straightforward transformers path,
on the same weights and LoRA adapter (a benchmark, not a timed test; issue 3).

Model: a randomly initialised 38.3M-parameter Qwen3 with a 32k vocabulary (the `qwen3-40m`
config of bench/sampling.py, seed 0), float32 by default, one LoRA session of rank 8 on every
attention and MLP projection (--train-unembed: on the output head too).

- A, memory: --rows x --tokens tokens (16 x 1024), CE over every token, one forward-backward.
  posttrain: LocalEngine.forward_backward_batch of one item (chunked float32 log-softmax, never
  the whole [tokens, vocab] tensor). naive:
  `torch.log_softmax(model(...).logits.float(), -1).gather(...)` over the padded batch, the CE
  sum, backward.
  Peak memory of one step: on CUDA, the allocator's peak above what was allocated before the
  step. On the CPU, each variant runs in a fresh process that resets the kernel's peak-RSS mark
  (/proc/self/clear_refs) just before the step and reads VmHWM after it, minus the RSS before
  it; glibc is told to map every allocation of 64 KiB or more on its own
  (MALLOC_MMAP_THRESHOLD_), so a freed tensor leaves the RSS at once and the peak follows live
  tensor memory, not the allocator's reuse pattern.
- B, an RL batch: --samples samples (32) with lengths uniform over [--min-length,
  --max-length] (64..1024, seed 0), CE over every token. posttrain: the same engine call
  (length buckets, engine/train/buckets.py). padded: the naive path of A over the batch padded to
  its longest sample, with an attention mask and the loss masked to real tokens; it runs as
  forward-backwards of --padded-rows rows (16, A's batch: the whole padded batch's float32
  logits would not fit a 23 GiB machine), each still padded to the whole batch's longest
  sample, so it computes exactly what one padded forward-backward would.

Tokens/s count real tokens only (the same numerator for both variants). Each variant gets one
small warm-up step, then --reps repetitions with the variants interleaved; printed are medians,
every run, the ratio of medians and the median of per-repetition ratios (the runs of one
repetition are adjacent in time, so their ratio is robust to a shared machine's drifting load).

    python bench/forward_backward.py                     # CPU, float32, the issue's shapes
    python bench/forward_backward.py --quick --reps 1    # a smoke run with small shapes
    python bench/forward_backward.py --device cuda --reps 5 --padded-rows 0

--quick shapes (4 x 256, 8 samples over 16..256) are for checking that the script runs: one
logprob chunk then holds the whole batch, so A's memory ratio says nothing there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from sampling import RANDOM_CONFIGS
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from posttrain.config import BUILTIN_MODEL_DIR, EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.types import ForwardBackwardRequest, LoraConfig, LossConfig, LossType, TrainingSample

MODEL_ID = "qwen3-40m"
# The same 40M config as the sampling benchmark (this script's folder is on sys.path).
QWEN3_40M = RANDOM_CONFIGS[MODEL_ID]
VOCAB = QWEN3_40M["vocab_size"]
CE = LossConfig(LossType.CROSS_ENTROPY)
RESOURCE, SESSION = "r", "s"
WARM_UP = [16, 8]  # lengths of the warm-up batch: small, only for one-time initialisation


@dataclass(frozen=True)
class Setup:
    model_dir: str
    device: str
    dtype: str
    train_unembed: bool
    padded_rows: int


def write_model(directory: Path) -> None:
    """The random model as a Hugging Face directory, so the engine loads it like any model."""
    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_40M, max_position_embeddings=4096, eos_token_id=0, pad_token_id=0)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    # load_model wants a tokenizer; the built-in one is never used on these token ids.
    AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR).save_pretrained(directory)


def make_engine(setup: Setup) -> LocalEngine:
    config = EngineConfig(device=setup.device, dtype=setup.dtype)
    engine = LocalEngine(config, {MODEL_ID: Path(setup.model_dir)})
    engine.load_resource(RESOURCE, MODEL_ID, muon_scaling=None)
    lora = LoraConfig(rank=8, alpha=16, train_unembed=setup.train_unembed)
    engine.create_session(RESOURCE, SESSION, lora)
    return engine


def make_samples(lengths: list[int], seed: int, vocab: int = VOCAB) -> tuple[TrainingSample, ...]:
    """Random token ids (from 3 up: past the special tokens), CE weight 1 on every token."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for length in lengths:
        tokens = torch.randint(3, vocab, (length + 1,), generator=generator).tolist()
        inputs = {"target_tokens": tuple(float(t) for t in tokens[1:]), "weights": (1.0,) * length}
        samples.append(TrainingSample(tuple(tokens[:-1]), inputs))
    return tuple(samples)


def rl_lengths(count: int, low: int, high: int) -> list[int]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(low, high + 1, (count,), generator=generator).tolist()


# ------------------------------------------------------------------ the two variants


def posttrain_step(engine: LocalEngine, samples: tuple[TrainingSample, ...], setup: Setup) -> None:
    (outcome,) = engine.forward_backward_batch(
        RESOURCE, [(SESSION, ForwardBackwardRequest(samples, CE))]
    )
    assert not isinstance(outcome, Exception), outcome
    engine.discard_gradients(RESOURCE, SESSION)


def naive_logprobs(
    model: torch.nn.Module, ids_ST: torch.Tensor, mask_ST: torch.Tensor, targets_ST: torch.Tensor
) -> torch.Tensor:
    """The textbook path: the whole batch's float32 logits, log-softmax, gather. The logits go
    out of scope on return; autograd keeps the log-softmax output for backward."""
    logits_STV = model(input_ids=ids_ST, attention_mask=mask_ST).logits
    logprobs_STV = torch.log_softmax(logits_STV.float(), dim=-1)
    return logprobs_STV.gather(-1, targets_ST.unsqueeze(-1)).squeeze(-1)


def padded_tensors(
    samples: tuple[TrainingSample, ...], width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids, targets and attention mask, right-padded to `width`."""
    ids_ST = torch.zeros(len(samples), width, dtype=torch.int64)
    targets_ST = torch.zeros(len(samples), width, dtype=torch.int64)
    mask_ST = torch.zeros(len(samples), width, dtype=torch.int64)
    for row, sample in enumerate(samples):
        n = len(sample.tokens)
        ids_ST[row, :n] = torch.tensor(sample.tokens)
        targets_ST[row, :n] = torch.tensor([int(t) for t in sample.loss_fn_inputs["target_tokens"]])
        mask_ST[row, :n] = 1
    return ids_ST.to(device), targets_ST.to(device), mask_ST.to(device)


def naive_step(engine: LocalEngine, samples: tuple[TrainingSample, ...], setup: Setup) -> None:
    """The same model and adapter over the batch right-padded to its longest sample, in
    forward-backwards of setup.padded_rows rows (0: all rows at once)."""
    width = max(len(s.tokens) for s in samples)
    rows = setup.padded_rows or len(samples)
    with engine.trainer_model(RESOURCE, SESSION) as model:
        for start in range(0, len(samples), rows):
            part = samples[start : start + rows]
            ids_ST, targets_ST, mask_ST = padded_tensors(part, width, engine.device)
            logprobs_ST = naive_logprobs(model, ids_ST, mask_ST, targets_ST)
            loss = -(logprobs_ST * mask_ST).sum()
            loss.backward()
    engine.discard_gradients(RESOURCE, SESSION)


Step = Callable[[LocalEngine, tuple[TrainingSample, ...], Setup], None]
VARIANTS: dict[str, Step] = {"posttrain": posttrain_step, "naive": naive_step}


# ------------------------------------------------------------------ measuring


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(run: Callable[[], None], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


def proc_status_kib(field: str) -> int:
    match = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    assert match is not None, f"no {field} in /proc/self/status"
    return int(match.group(1))


def peak_step_bytes(run: Callable[[], None], device: torch.device) -> int:
    """Memory one step needs above what was in use before it (see the module docstring)."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = proc_status_kib("VmRSS")
    run()
    return (proc_status_kib("VmHWM") - before) << 10


def memory_probe(engine: LocalEngine, setup: Setup, variant: str, lengths: list[int]) -> int:
    """Peak memory of one step of `variant`; on the CPU in a fresh process (see run_probe)."""
    if engine.device.type == "cuda":
        samples = make_samples(lengths, seed=1)
        return peak_step_bytes(lambda: VARIANTS[variant](engine, samples, setup), engine.device)
    probe = json.dumps(dict(setup=vars(setup), variant=variant, lengths=lengths))
    threads = str(torch.get_num_threads())
    command = [sys.executable, __file__, "--threads", threads, "--probe", probe]
    environment = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(64 << 10))
    result = subprocess.run(command, check=True, capture_output=True, text=True, env=environment)
    return int(result.stdout.strip().splitlines()[-1])


def run_probe(spec: str) -> None:
    """The child side of memory_probe: one warm-up step (one-time initialisation is not the
    step's memory), then one measured step; prints its peak bytes. RSS belongs to a process, so
    the other variant's freed memory is not there to be reused."""
    probe = json.loads(spec)
    setup = Setup(**probe["setup"])
    engine = make_engine(setup)
    step = VARIANTS[probe["variant"]]
    step(engine, make_samples(WARM_UP, seed=2), setup)
    samples = make_samples(probe["lengths"], seed=1)
    print(peak_step_bytes(lambda: step(engine, samples, setup), engine.device))


def compare(engine: LocalEngine, setup: Setup, lengths: list[int], reps: int) -> dict[str, list]:
    """Tokens/s (real tokens) of each variant per repetition, variants interleaved."""
    for step in VARIANTS.values():
        step(engine, make_samples(WARM_UP, seed=2), setup)
    samples = make_samples(lengths, seed=1)
    speeds: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for _ in range(reps):
        for variant, step in VARIANTS.items():
            seconds = timed(lambda step=step: step(engine, samples, setup), engine.device)
            speeds[variant].append(sum(lengths) / seconds)
    return speeds


def report_speeds(speeds: dict[str, list[float]], labels: dict[str, str]) -> dict[str, float]:
    medians = {variant: statistics.median(values) for variant, values in speeds.items()}
    for variant, label in labels.items():
        runs = ", ".join(f"{v:.1f}" for v in speeds[variant])
        print(f"  {label:<36} {medians[variant]:9.1f} tokens/s   (runs: {runs})")
    return medians


def ratio_text(speeds: dict[str, list[float]], medians: dict[str, float]) -> str:
    paired = statistics.median(
        ours / theirs for ours, theirs in zip(speeds["posttrain"], speeds["naive"], strict=True)
    )
    return f"{medians['posttrain'] / medians['naive']:.2f}x (per-repetition median {paired:.2f}x)"


def bench_memory_batch(engine: LocalEngine, setup: Setup, args: argparse.Namespace) -> None:
    lengths = [args.tokens] * args.rows
    print(f"\nA: {args.rows} x {args.tokens} tokens, one forward-backward, CE over every token")
    labels = {"posttrain": "posttrain (engine)", "naive": "naive (full log-softmax)"}
    one_batch = Setup(**{**vars(setup), "padded_rows": 0})  # A's naive path is one forward
    speeds = compare(engine, one_batch, lengths, args.reps)
    medians = report_speeds(speeds, labels)
    peaks = {variant: memory_probe(engine, one_batch, variant, lengths) for variant in labels}
    for variant, label in labels.items():
        print(f"  {label:<36} {peaks[variant] / 2**20:9.1f} MiB peak step memory")
    memory = peaks["posttrain"] / peaks["naive"]
    print(f"  posttrain / naive throughput: {ratio_text(speeds, medians)}   target >= 1.0")
    print(f"  posttrain / naive peak memory: {memory:.2f}x   target <= 0.6")


def bench_rl_batch(engine: LocalEngine, setup: Setup, args: argparse.Namespace) -> None:
    lengths = rl_lengths(args.samples, args.min_length, args.max_length)
    print(
        f"\nB: {args.samples} samples, lengths uniform over {args.min_length}..{args.max_length}"
        f" (seed 0): {sum(lengths)} real tokens, {len(lengths) * max(lengths)} padded"
    )
    rows = setup.padded_rows or len(lengths)
    labels = {
        "posttrain": "posttrain (engine, length buckets)",
        "naive": f"padded transformers ({rows} rows/pass)",
    }
    speeds = compare(engine, setup, lengths, args.reps)
    medians = report_speeds(speeds, labels)
    print(f"  posttrain / padded throughput: {ratio_text(speeds, medians)}   target >= 1.5")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small shapes for a smoke run")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--sections", default="AB", help="which of A and B to run")
    parser.add_argument(
        "--train-unembed",
        action="store_true",
        help="LoRA on the output head too: its gradients need the softmax and the loss's"
        " gradient together, so the engine recomputes each logprob chunk in backward",
    )
    parser.add_argument(
        "--padded-rows", type=int, default=16, help="rows per pass of B's padded baseline (0: all)"
    )
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # the child of memory_probe
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe:
        run_probe(args.probe)
        return
    shapes = dict(rows=16, tokens=1024, samples=32, min_length=64, max_length=1024)
    if args.quick:
        shapes = dict(rows=4, tokens=256, samples=8, min_length=16, max_length=256)
    vars(args).update(shapes)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}")
    with tempfile.TemporaryDirectory() as directory:
        write_model(Path(directory))
        setup = Setup(directory, args.device, args.dtype, args.train_unembed, args.padded_rows)
        engine = make_engine(setup)
        params = engine.resource_footprint(RESOURCE).base_parameters
        head = "and the output head" if args.train_unembed else "(not the output head)"
        print(
            f"{MODEL_ID}: {params / 1e6:.1f}M parameters (random), {args.dtype}, LoRA rank 8 on"
            f" attention and MLP {head}, bucket_overhead_tokens"
            f" {engine.config.bucket_overhead_tokens}"
        )
        if "A" in args.sections:
            bench_memory_batch(engine, setup, args)
        if "B" in args.sections:
            bench_rl_batch(engine, setup, args)


if __name__ == "__main__":
    main()
