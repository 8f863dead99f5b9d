"""Sampler throughput: posttrain's generator against transformers `generate` and a naive sampler,
on the same weights in one process (a benchmark, not a timed test).

The shape of an RL rollout (issue 5): --prompts prompts of --prompt-tokens random tokens,
--samples completions each, up to --new-tokens new tokens, temperature 1, EOS ends a row.

- posttrain: engine/generate/sampler.generate with a LoRA adapter routed (as a session samples): one
  prefill per prompt fanned out to its samples, a preallocated KV cache, finished rows freed,
  vectorised per-row-seeded sampling, the prefix cache on (fresh prompts each repetition, so
  it only pays for insertions).
- transformers: `model.generate` on the same routed model with every prompt repeated
  --samples times (the usual way to get n samples from it).
- naive: the seed-era sampler: prompts repeated, one batched prefill, a DynamicCache, every row
  decoded until the last one stops (no prefill sharing, no row freeing).

Prints generated tokens per second of each (tokens up to and including EOS) and posttrain's
ratio to each baseline: the ratio of medians over --reps repetitions (after one warm-up), and
the median of per-repetition ratios.

    python bench/sampling.py                                      # tiny + qwen3-40m, CPU
    python bench/sampling.py --models qwen3-0.5b --device cuda --dtype bfloat16

Models: `tiny` is the built-in posttrain/tiny-qwen3; `qwen3-40m` (~38M parameters) and
`qwen3-0.5b` (~0.6B) are randomly initialised Qwen3 configs (seed 0).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, Qwen3Config
from transformers import Qwen3ForCausalLM as Qwen3Model

from posttrain.config import BUILTIN_MODEL_DIR
from posttrain.engine.generate import sampler
from posttrain.engine.generate.prefill import GeneratorModel
from posttrain.engine.generate.prefix_cache import PrefixCache
from posttrain.engine.generate.sampler import GenerationRequest, generate
from posttrain.engine.state import WeightsVersion
from posttrain.model.kv_shape import kv_shape
from posttrain.model.lora import AdapterSpec, LoraModel
from posttrain.types import SamplingParams

ADAPTER = "bench"
RANDOM_CONFIGS = {
    "qwen3-40m": dict(
        vocab_size=32000,
        hidden_size=384,
        intermediate_size=1152,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
    ),
    "qwen3-0.5b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
}


@dataclass
class Shape:
    prompts: int
    prompt_tokens: int
    samples: int
    new_tokens: int


def build_model(name: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    if name == "tiny":
        model = AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL_DIR, dtype=dtype)
    else:
        torch.manual_seed(0)
        config = Qwen3Config(
            **RANDOM_CONFIGS[name], max_position_embeddings=4096, eos_token_id=0, pad_token_id=0
        )
        model = Qwen3Model(config).to(dtype)
    model = model.to(device).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def count_generated(rows: list[list[int]], eos: int) -> int:
    """Tokens each row generated, up to and including its first EOS."""
    return sum(row.index(eos) + 1 if eos in row else len(row) for row in rows)


def run_posttrain(gm: GeneratorModel, prompts: list[list[int]], shape: Shape, eos: int) -> int:
    gm.prefix_cache = PrefixCache(512 << 20)
    params = SamplingParams(max_tokens=shape.new_tokens, temperature=1.0, seed=0)
    requests = [GenerationRequest(tuple(p), shape.samples, params, ADAPTER) for p in prompts]
    results = generate(gm, requests, versions={ADAPTER: WeightsVersion(1, 0)})
    return sum(len(s.tokens) for r in results for s in r.sequences)


@torch.no_grad()
def run_transformers(
    model: torch.nn.Module, lora: LoraModel, prompts: list[list[int]], shape: Shape, eos: int
) -> int:
    ids = torch.tensor([p for p in prompts for _ in range(shape.samples)], device=model.device)
    with lora.route([(ADAPTER, None)]):
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=shape.new_tokens,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    return count_generated(out[:, ids.shape[1] :].tolist(), eos)


@torch.no_grad()
def run_naive(
    model: torch.nn.Module, lora: LoraModel, prompts: list[list[int]], shape: Shape, eos: int
) -> int:
    ids = torch.tensor([p for p in prompts for _ in range(shape.samples)], device=model.device)
    generator = torch.Generator().manual_seed(0)
    cache = DynamicCache()
    rows: list[list[int]] = [[] for _ in range(ids.shape[0])]
    with lora.route([(ADAPTER, None)]):
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        for _ in range(shape.new_tokens):
            logprobs = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
            tokens = torch.multinomial(logprobs.exp().cpu(), 1, generator=generator)
            for row, token in zip(rows, tokens[:, 0].tolist(), strict=True):
                row.append(token)
            if all(eos in row for row in rows):
                break
            out = model(input_ids=tokens.to(model.device), cache=cache, use_cache=True)
    return count_generated(rows, eos)


def timed(run: Callable[[], int], device: torch.device) -> float:
    """Generated tokens per second of one run."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start)


def bench_model(name: str, shape: Shape, reps: int, device: torch.device, dtype: torch.dtype):
    model = build_model(name, device, dtype)
    kv = kv_shape(model)
    lora = LoraModel(model)
    lora.add_adapter(
        ADAPTER, AdapterSpec(rank=8, alpha=16, dropout=0.0, seed=0, train_unembed=True)
    )
    tokenizer = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)  # decodes stop strings only
    eos = int(model.config.eos_token_id)
    gm = GeneratorModel(model, lora, tokenizer, frozenset({eos}), PrefixCache(0), 1024, kv)
    vocab = model.config.vocab_size
    params = sum(p.numel() for p in model.parameters())
    print(f"\n{name}: {params / 1e6:.1f}M parameters, {dtype}, {device}, {shape}")
    generator = torch.Generator().manual_seed(1)

    def fresh_prompts(size: Shape) -> list[list[int]]:
        # Token ids from 3 up: skips the built-in model's special tokens (EOS is 0).
        return torch.randint(
            3, vocab, (size.prompts, size.prompt_tokens), generator=generator
        ).tolist()

    runners = {
        "posttrain": lambda p, s: run_posttrain(gm, p, s, eos),
        "transformers": lambda p, s: run_transformers(model, lora, p, s, eos),
        "naive": lambda p, s: run_naive(model, lora, p, s, eos),
    }
    warmup = Shape(2, min(8, shape.prompt_tokens), 2, 4)
    for run in runners.values():
        run(fresh_prompts(warmup), warmup)
    speeds: dict[str, list[float]] = {key: [] for key in runners}
    for _ in range(reps):
        prompts = fresh_prompts(shape)
        for key, run in runners.items():
            speeds[key].append(timed(lambda run=run, p=prompts: run(p, shape), device))
    medians = {key: statistics.median(values) for key, values in speeds.items()}
    for key, value in medians.items():
        runs = ", ".join(f"{v:.0f}" for v in speeds[key])
        print(f"  {key:>12}: {value:10.1f} tokens/s  (runs: {runs})")
    for baseline in ("transformers", "naive"):
        ratio = medians["posttrain"] / medians[baseline]
        # Runs of one repetition are adjacent in time, so their ratio is robust to a shared
        # machine whose load drifts between repetitions.
        paired = statistics.median(
            ours / theirs
            for ours, theirs in zip(speeds["posttrain"], speeds[baseline], strict=True)
        )
        print(f"  posttrain / {baseline}: {ratio:.2f}x (per-repetition median {paired:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["tiny", "qwen3-40m"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--block-steps",
        type=int,
        default=None,
        help="decode passes per host read (default: the device's)",
    )
    parser.add_argument(
        "--static",
        choices=["on", "off"],
        default=None,
        help="static-shape decode passes (default: the device's; on CUDA in graphs)",
    )
    args = parser.parse_args()
    if args.block_steps is not None:
        sampler.CPU_BLOCK_STEPS = sampler.DECODE_BLOCK_STEPS = args.block_steps
    if args.static is not None:
        sampler.CPU_STATIC_DECODE = sampler.STATIC_DECODE = args.static == "on"
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shape = Shape(args.prompts, args.prompt_tokens, args.samples, args.new_tokens)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.models:
        bench_model(name, shape, args.reps, device, dtype)


if __name__ == "__main__":
    main()
