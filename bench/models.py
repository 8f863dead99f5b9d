"""Throughput of every model family at one size, so that a regression in one family shows
(a benchmark, not a timed test; issue 13).

Every family of tests/unit/model/families.py (the random-init configs the family tests use, with
their sliding windows, soft-capping and logit scaling) is built at the same size, --hidden
(128) wide and --layers (4) deep, with the built-in tokenizer's 99-token vocabulary, and served
by one LocalEngine, one model resource per family, one LoRA session each (rank 8, every
projection and the output head, the API's default). Measured through the engine's public
methods, as the scheduler calls them:

- forward-backward: `forward_backward_batch` of --rows x --tokens tokens (8 x 128) of random
  ids, cross-entropy on every token, then `discard_gradients`; tokens/s.
- sample: `sample_batch` of --prompts prompts (8) of --prompt-tokens random ids (16), each
  --samples times (4), up to --new-tokens tokens (32), temperature 1; generated tokens/s
  (EOS ends a row early, counted with its EOS). Fresh prompts every repetition, so the prefix
  cache only pays for its insertions. The table also shows how many tokens a row generated on
  average (of --new-tokens).

Each repetition runs every family once, in table order, each right after a Llama run of the
same work, after one small warm-up each; printed are medians over --reps repetitions (7), and
each family's ratio to Llama, the baseline run in the same process: the ratio of medians and,
in brackets, the median of the ratios to the adjacent Llama run (robust to a shared machine's
drifting load, which moves single runs here by up to 2x).

    OMP_NUM_THREADS=1 python bench/models.py               # CPU, float32, one thread
    python bench/models.py --quick                         # a smoke run (tiny shapes, 1 rep)
    python bench/models.py --device cuda --dtype bfloat16  # the issue's GPU family check

VARIANTS holds the rows: one per family, plus qwen3_moe+replay, the MoE forward-backward with
routed-expert replay (every sample carries the routes of its tokens, `replay_samples`; its
sampling column is plain sampling). A row marked `is_pending` prints without numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit" / "model"))
import families  # noqa: E402

from posttrain.config import EngineConfig  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.types import (  # noqa: E402
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    SampleRequest,
    SamplingParams,
    TrainingSample,
)

BASELINE = "llama"
SESSION = "s"
CE = LossConfig(LossType.CROSS_ENTROPY)
FIRST_ID = 3  # random ids from here up: past the built-in tokenizer's special tokens

Samples = tuple[TrainingSample, ...]


@dataclass(frozen=True)
class Shapes:
    rows: int
    tokens: int
    prompts: int
    prompt_tokens: int
    samples: int
    new_tokens: int


FULL = Shapes(rows=8, tokens=128, prompts=8, prompt_tokens=16, samples=4, new_tokens=32)
QUICK = Shapes(rows=2, tokens=16, prompts=2, prompt_tokens=8, samples=2, new_tokens=4)
WARM_UP = Shapes(rows=1, tokens=8, prompts=1, prompt_tokens=4, samples=1, new_tokens=2)


def plain_samples(engine: LocalEngine, resource: str, samples: Samples) -> Samples:
    return samples


def replay_samples(engine: LocalEngine, resource: str, samples: Samples) -> Samples:
    """The same samples, each carrying the expert routes its tokens take now (a greedy
    one-token sample of each with return_routed_experts: its routes cover the whole prompt),
    so the forward-backward replays them in every MoE layer (model/routing.py). Untimed."""
    request = SampleRequest(
        prompts=tuple(s.tokens for s in samples),
        num_samples=1,
        sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
        return_routed_experts=True,
    )
    (results,) = engine.sample_batch(resource, [(SESSION, request)])
    return tuple(
        replace(s, routed_experts=r.sequences[0].routed_experts)
        for s, r in zip(samples, results, strict=True)
    )


@dataclass(frozen=True)
class Variant:
    """One row of the table: a family, and how its forward-backward samples are made from the
    plain cross-entropy batch. `is_pending` rows print without numbers."""

    family: str
    training_samples: Callable[[LocalEngine, str, Samples], Samples] = plain_samples
    is_pending: bool = False


VARIANTS: dict[str, Variant] = {family: Variant(family) for family in families.FAMILIES}
VARIANTS["qwen3_moe+replay"] = Variant("qwen3_moe", replay_samples)


def random_ids(generator: torch.Generator, rows: int, length: int) -> list[list[int]]:
    return torch.randint(FIRST_ID, families.VOCAB, (rows, length), generator=generator).tolist()


def ce_batch(generator: torch.Generator, shapes: Shapes) -> Samples:
    """Cross-entropy on every token of shapes.rows random sequences of shapes.tokens tokens."""
    samples = []
    for ids in random_ids(generator, shapes.rows, shapes.tokens + 1):
        targets = tuple(float(t) for t in ids[1:])
        inputs = {"target_tokens": targets, "weights": (1.0,) * shapes.tokens}
        samples.append(TrainingSample(tuple(ids[:-1]), inputs))
    return tuple(samples)


def forward_backward(engine: LocalEngine, resource: str, samples: Samples) -> int:
    """One forward-backward, its gradients dropped; the number of tokens it trained on."""
    (outcome,) = engine.forward_backward_batch(
        resource, [(SESSION, ForwardBackwardRequest(samples, CE))]
    )
    assert not isinstance(outcome, Exception), outcome
    engine.discard_gradients(resource, SESSION)
    return sum(len(s.tokens) for s in samples)


def sample(engine: LocalEngine, resource: str, prompts: list[list[int]], shapes: Shapes) -> int:
    """One sample operation; the number of tokens it generated."""
    params = SamplingParams(max_tokens=shapes.new_tokens, temperature=1.0, seed=0)
    request = SampleRequest(tuple(tuple(p) for p in prompts), shapes.samples, params)
    (results,) = engine.sample_batch(resource, [(SESSION, request)])
    return sum(len(s.tokens) for r in results for s in r.sequences)


def timed(run: Callable[[], int], device: torch.device) -> tuple[int, float]:
    """The tokens of one run, and tokens per second."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return tokens, tokens / (time.perf_counter() - start)


@dataclass
class Runs:
    """Tokens/s of one row's runs, and of the Llama run just before each (its pair)."""

    fb: list[float] = field(default_factory=list)
    sample: list[float] = field(default_factory=list)
    paired_fb: list[float] = field(default_factory=list)
    paired_sample: list[float] = field(default_factory=list)
    # EOS ends a row early, at a rate that differs between random-init families; fewer live
    # rows make a decode pass cheaper, so the table shows how long rows ran.
    new_tokens_per_row: list[float] = field(default_factory=list)


def measure(
    engine: LocalEngine, rows: dict[str, Variant], shapes: Shapes, reps: int
) -> dict[str, Runs]:
    """Runs of every row. Each repetition runs every row once, each right after a Llama run of
    the same work, so a row's ratio to Llama pairs runs that are adjacent in time."""
    generator = torch.Generator().manual_seed(0)
    device = engine.device
    for label, variant in rows.items():
        batch = variant.training_samples(engine, label, ce_batch(generator, WARM_UP))
        forward_backward(engine, label, batch)
        sample(engine, label, random_ids(generator, 1, WARM_UP.prompt_tokens), WARM_UP)
    runs = {label: Runs() for label in rows}
    for _ in range(reps):
        batch = ce_batch(generator, shapes)
        prompts = random_ids(generator, shapes.prompts, shapes.prompt_tokens)
        base_batch = VARIANTS[BASELINE].training_samples(engine, BASELINE, batch)
        for label, variant in rows.items():
            samples = variant.training_samples(engine, label, batch)
            _, base_fb = timed(partial(forward_backward, engine, BASELINE, base_batch), device)
            _, fb = timed(partial(forward_backward, engine, label, samples), device)
            _, base_sample = timed(partial(sample, engine, BASELINE, prompts, shapes), device)
            new_tokens, generated = timed(partial(sample, engine, label, prompts, shapes), device)
            row = runs[label]
            row.new_tokens_per_row.append(new_tokens / (shapes.prompts * shapes.samples))
            row.fb.append(fb)
            row.sample.append(generated)
            # The baseline's own row is its pair: its ratios are 1 by definition.
            row.paired_fb.append(fb if label == BASELINE else base_fb)
            row.paired_sample.append(generated if label == BASELINE else base_sample)
    return runs


def ratio_text(values: list[float], paired: list[float], baseline: list[float]) -> str:
    """The ratio of medians to the baseline's, and the median of ratios to adjacent runs."""
    ratio = statistics.median(values) / statistics.median(baseline)
    per_pair = statistics.median(v / b for v, b in zip(values, paired, strict=True))
    return f"{ratio:.2f}x ({per_pair:.2f}x)"


def print_table(runs: dict[str, Runs], parameters: dict[str, int], labels: list[str]) -> None:
    header = (
        f"{'family':<17} {'params':>8} {'fb tokens/s':>12} {'fb / llama':>15}"
        f" {'sample tokens/s':>16} {'sample / llama':>15} {'new tokens/row':>15}"
    )
    print(header)
    base = runs[BASELINE]
    for label in labels:
        family = VARIANTS[label].family
        size = f"{parameters[family] / 1e6:.2f}M" if family in parameters else "-"
        if label not in runs:
            print(f"{label:<17} {size:>8} {'pending':>12}")
            continue
        row = runs[label]
        fb_ratio = ratio_text(row.fb, row.paired_fb, base.fb)
        sample_ratio = ratio_text(row.sample, row.paired_sample, base.sample)
        print(
            f"{label:<17} {size:>8} {statistics.median(row.fb):12.1f} {fb_ratio:>15}"
            f" {statistics.median(row.sample):16.1f} {sample_ratio:>15}"
            f" {statistics.mean(row.new_tokens_per_row):15.1f}"
        )
    print("\nruns (tokens/s, forward-backward | sample):")
    for label, row in runs.items():
        fb = ", ".join(f"{v:.0f}" for v in row.fb)
        generated = ", ".join(f"{v:.0f}" for v in row.sample)
        print(f"  {label:<17} {fb} | {generated}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one repetition")
    parser.add_argument("--reps", type=int, help="repetitions (default 7; --quick: 1)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of every family")
    parser.add_argument("--layers", type=int, default=4, help="layers of every family")
    parser.add_argument("--families", nargs="+", choices=list(VARIANTS), help="rows to run")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = QUICK if args.quick else FULL
    reps = args.reps or (1 if args.quick else 7)
    labels = [BASELINE, *[f for f in args.families or VARIANTS if f != BASELINE]]
    size = families.Size(args.hidden, args.layers)
    omp = os.environ.get("OMP_NUM_THREADS", "unset")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
        f" (OMP_NUM_THREADS={omp}), {args.device}, {args.dtype}"
    )
    print(
        f"every family: hidden {size.hidden_size}, {size.num_hidden_layers} layers,"
        f" vocabulary {families.VOCAB}, LoRA rank 8; {reps} repetitions of forward-backward"
        f" {shapes.rows} x {shapes.tokens} tokens and sample {shapes.prompts} prompts x"
        f" {shapes.prompt_tokens} tokens x {shapes.samples} samples x {shapes.new_tokens}"
        " new tokens\n"
    )
    with tempfile.TemporaryDirectory() as directory:
        needed = {VARIANTS[label].family for label in labels}
        paths = {f: families.build(f, Path(directory) / f, size=size) for f in needed}
        engine = LocalEngine(EngineConfig(device=args.device, dtype=args.dtype), paths)
        rows = {label: VARIANTS[label] for label in labels if not VARIANTS[label].is_pending}
        for label, variant in rows.items():
            engine.load_resource(label, variant.family, muon_scaling=None)
            engine.create_session(label, SESSION, LoraConfig(rank=8, alpha=16, seed=0))
        parameters = {
            variant.family: engine.resource_footprint(label).base_parameters
            for label, variant in rows.items()
        }
        runs = measure(engine, rows, shapes, reps)
    print_table(runs, parameters, labels)


if __name__ == "__main__":
    main()
