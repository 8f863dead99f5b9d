"""GPU checks for the engine: correctness on CUDA and throughput ratios in one process.

Builds a randomly initialised Qwen3 of a chosen size (no hub access anywhere), saves it in HF
format, and runs posttrain's LocalEngine on it:

1. sampler logprobs vs forward_only logprobs of the same tokens (max |diff|; bf16 weights on
   CUDA, float32 logprob math);
2. forward-backward throughput: 4 LoRA sessions in one shared pass vs one after another
   (ratio; medians of several repetitions);
3. sampling throughput (generated tokens/s) for 32 rows.

    python bench/gpu_check.py --device cuda            # on the GPU machine
    python bench/gpu_check.py --device cpu --small     # a quick dry run here
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from posttrain.config import BUILTIN_MODEL_DIR, EngineConfig
from posttrain.engine.local import LocalEngine
from posttrain.types import (
    AdamParams,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoraConfig,
    LossConfig,
    LossType,
    OptimStepRequest,
    SampleRequest,
    SamplingParams,
    TrainingSample,
)

CE = LossConfig(LossType.CROSS_ENTROPY)


def build_model(directory: Path, *, small: bool) -> None:
    """A random Qwen3 with the built-in tokenizer's vocabulary padded to a realistic size."""
    hidden, layers, vocab = (128, 2, 512) if small else (1024, 12, 32768)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=max(2, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR).save_pretrained(directory)
    print(
        f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
        f"hidden {hidden}, layers {layers}, vocab {vocab}"
    )


def ce_sample(generator: torch.Generator, length: int, vocab: int) -> TrainingSample:
    tokens = torch.randint(3, vocab, (length + 1,), generator=generator).tolist()
    return TrainingSample(
        tuple(tokens[:-1]),
        {"target_tokens": tuple(float(t) for t in tokens[1:]), "weights": (1.0,) * length},
    )


def timed(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def one_pass(
    engine: LocalEngine, session_id: str, request: ForwardBackwardRequest
) -> ForwardBackwardResult:
    """One session's forward-backward: the engine's batched method with one item."""
    (outcome,) = engine.forward_backward_batch("r", [(session_id, request)])
    assert not isinstance(outcome, Exception), outcome
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="base weights"
    )
    args = parser.parse_args()
    report: dict[str, object] = {"device": args.device, "dtype": args.dtype}
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name(0)
    directory = Path(tempfile.mkdtemp()) / "bench-qwen3"
    build_model(directory, small=args.small)
    engine = LocalEngine(EngineConfig(device=args.device, dtype=args.dtype), {"bench": directory})
    engine.load_resource("r", "bench", muon_scaling=None)
    vocab = engine.model_info("bench").vocab_size
    names = [f"s{i}" for i in range(4)]
    for index, name in enumerate(names):
        engine.create_session("r", name, LoraConfig(rank=16, alpha=32, seed=index))
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    seq = 64 if args.small else 512
    rows = 4 if args.small else 8

    # 1. sampler vs forward logprobs on this device.
    one_pass(
        engine,
        "s0",
        ForwardBackwardRequest(tuple(ce_sample(generator, seq, vocab) for _ in range(rows)), CE),
    )
    engine.optim_step("r", "s0", OptimStepRequest(adam=AdamParams(learning_rate=1e-3)))
    engine.publish("r", "s0", version=1)
    prompt = tuple(torch.randint(3, vocab, (16,), generator=generator).tolist())
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=1)
    ((result,),) = engine.sample_batch("r", [("s0", SampleRequest((prompt,), 4, params))])
    worst = 0.0
    for sequence in result.sequences:
        full = list(prompt) + sequence.tokens
        n = len(full) - 1
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(sequence.tokens)
        sample = TrainingSample(
            tuple(full[:-1]),
            {"target_tokens": tuple(float(t) for t in full[1:]), "weights": tuple(weights)},
        )
        assert len(weights) == n
        scored = one_pass(
            engine,
            "s0",
            ForwardBackwardRequest((sample,), CE, forward_only=True, return_loss_fn_outputs=True),
        )
        forward = scored.loss_fn_outputs[0][len(prompt) - 1 :]
        worst = max(worst, max(abs(a - b) for a, b in zip(forward, sequence.logprobs, strict=True)))
    report["sampler_vs_forward_max_abs_diff"] = worst

    # 2. forward-backward: 4 sessions shared pass vs sequential.
    batches = {
        n: ForwardBackwardRequest(tuple(ce_sample(generator, seq, vocab) for _ in range(rows)), CE)
        for n in names
    }

    def sequential() -> None:
        for n in names:
            one_pass(engine, n, batches[n])

    def shared() -> None:
        engine.forward_backward_batch("r", [(n, batches[n]) for n in names])

    sequential()  # warm-up
    t_seq = timed(sequential, args.repeats, device)
    t_shared = timed(shared, args.repeats, device)
    tokens = len(names) * rows * seq
    report["fb_tokens"] = tokens
    report["fb_sequential_tokens_per_s"] = tokens / t_seq
    report["fb_shared_tokens_per_s"] = tokens / t_shared
    report["fb_shared_speedup"] = t_seq / t_shared

    # 3. sampling throughput.
    sample_rows = 8 if args.small else 32
    prompts = tuple(
        tuple(torch.randint(3, vocab, (32,), generator=generator).tolist())
        for _ in range(sample_rows)
    )
    gen_params = SamplingParams(max_tokens=64, temperature=1.0, seed=3)

    def sample() -> int:
        (results,) = engine.sample_batch("r", [("s0", SampleRequest(prompts, 1, gen_params))])
        return sum(len(s.tokens) for r in results for s in r.sequences)

    sample()
    generated = sample()
    t_sample = timed(sample, args.repeats, device)
    report["sample_rows"] = sample_rows
    report["sample_tokens_per_s"] = generated / t_sample
    if device.type == "cuda":
        report["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
