"""GPU check (issue 16, item 3): correctness on the device and the numbers that say whether
posttrain uses it well, in ONE short run (< 5 minutes on an H200).

Builds a randomly initialised Qwen3 of the Qwen3-0.6B shape (28 layers, hidden 1024, vocab
151,936, tied head; no hub access), in bfloat16 on CUDA, saves it in HF format and runs
posttrain's LocalEngine on it (LoRA rank 32, as a session trains and samples):

1. correctness: sampler logprobs vs forward_only logprobs of the same tokens (max |diff|), and
   on CUDA the fused shared-prefix attention kernel (memory-efficient, with log-sum-exp) vs
   explicit matmuls on the model's head shapes;
2. forward-backward MFU: cross-entropy forward-backward of --fb-rows x --fb-tokens; FLOPs of
   the work done (frozen base: forward + input gradients = 4 x matmul parameters per token,
   LoRA 6x its parameters, causal attention) over the device's peak (--peak-tflops, else a
   table of known devices); `mfu_6n` uses the full-fine-tune convention 6N for comparison;
3. decode: the sampler's per-step time on the RL shape (a call of --new-tokens less one of a
   single token, over the steps between), its tokens/s, and the memory-bandwidth limit:
   bytes one step must read (weights, adapters, the prompts' KV once per prompt and each
   row's own KV) over --bandwidth-tbs;
4. sampler vs transformers `generate` on the RL shape (--prompts x --prompt-tokens,
   --samples each, --new-tokens), same model and adapter, generated tokens/s, medians;
5. decode paths: sampler tokens/s with static-shape passes replayed from CUDA graphs
   (`--cuda-graphs on`), the same passes eager, dynamic passes in blocks of 8 (the default),
   and the per-token dynamic passes (engine/generate/decode_graph.py): this decides the default;
6. weights-sync latency: `publish` of the session's trained adapter to its generator.

Prints a text summary and the report as JSON (last line; --json also writes it to a file).

    python bench/gpu_check.py --device cuda                 # on the GPU machine, < 5 minutes
    python bench/gpu_check.py --device cpu --small          # a dry run of every step, here
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.config import BUILTIN_MODEL_DIR, EngineConfig  # noqa: E402
from posttrain.engine.generate import sampler  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.model.attention_kernels import matmul_attention, partial_attention  # noqa: E402
from posttrain.types import (  # noqa: E402
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

# isort: split
from sampling import RANDOM_CONFIGS  # noqa: E402  (bench/ is this script's folder)

CE = LossConfig(LossType.CROSS_ENTROPY)
QWEN3_0_6B = {**RANDOM_CONFIGS["qwen3-0.5b"], "rope_theta": 1e6}  # Qwen3-0.6B's shape
SMALL = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    tie_word_embeddings=True,
)
# Dense bfloat16 peak TFLOP/s by device-name fragment (vendor data sheets, no sparsity).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def build_model(directory: Path, config: dict, device: torch.device, dtype: torch.dtype) -> None:
    """A random Qwen3 saved in HF format with the built-in tokenizer (EOS 0)."""
    torch.manual_seed(0)
    with device:  # initialise on the device: a 0.6B model initialises slowly on a CPU
        model = Qwen3ForCausalLM(
            Qwen3Config(**config, max_position_embeddings=4096, eos_token_id=0, pad_token_id=0)
        ).to(dtype)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR).save_pretrained(directory)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of `repeats` calls (after the caller's warm-up)."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ce_sample(generator: torch.Generator, length: int, vocab: int) -> TrainingSample:
    tokens = torch.randint(3, vocab, (length + 1,), generator=generator).tolist()
    return TrainingSample(
        tuple(tokens[:-1]),
        {"target_tokens": tuple(float(t) for t in tokens[1:]), "weights": (1.0,) * length},
    )


def one_pass(engine: LocalEngine, request: ForwardBackwardRequest) -> ForwardBackwardResult:
    (outcome,) = engine.forward_backward_batch("r", [("s0", request)])
    assert not isinstance(outcome, Exception), outcome
    return outcome


def check_logprobs(engine: LocalEngine, vocab: int, generator: torch.Generator) -> float:
    """Max |sampler logprob - forward_only logprob| over 4 samples of 32 tokens."""
    prompt = tuple(torch.randint(3, vocab, (16,), generator=generator).tolist())
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=1)
    ((result,),) = engine.sample_batch("r", [("s0", SampleRequest((prompt,), 4, params))])
    worst = 0.0
    for sequence in result.sequences:
        full = list(prompt) + sequence.tokens
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(sequence.tokens)
        sample = TrainingSample(
            tuple(full[:-1]),
            {"target_tokens": tuple(float(t) for t in full[1:]), "weights": tuple(weights)},
        )
        scored = one_pass(
            engine,
            ForwardBackwardRequest((sample,), CE, forward_only=True, return_loss_fn_outputs=True),
        )
        forward = scored.loss_fn_outputs[0][len(prompt) - 1 :]
        worst = max(worst, max(abs(a - b) for a, b in zip(forward, sequence.logprobs, strict=True)))
    return worst


def check_fused_attention(config: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """The shared-prefix parts of a decode step in the fused kernel vs explicit matmuls:
    128 rows in 16 groups over 256-token prompts, grouped-query heads stacked as the sampler
    stacks them."""
    generator = torch.Generator().manual_seed(4)
    heads, kv_heads, dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    groups, rows_per_group, prompt = 16, 8, 256
    stacked = rows_per_group * heads // kv_heads
    q = torch.randn(groups, kv_heads, stacked, dim, generator=generator).to(device, dtype)
    k = torch.randn(groups, kv_heads, prompt, dim, generator=generator).to(device, dtype)
    v = torch.randn(groups, kv_heads, prompt, dim, generator=generator).to(device, dtype)
    lengths = torch.randint(prompt // 2, prompt + 1, (groups,), generator=generator)
    hidden = torch.arange(prompt)[None, :] >= lengths[:, None]
    bias = torch.zeros(groups, 1, 1, prompt).masked_fill(hidden[:, None, None], float("-inf"))
    bias = bias.to(device)
    scale = dim**-0.5
    out, lse = partial_attention(q, k, v, bias, scale, fused=True)
    ref_out, ref_lse = matmul_attention(q.float(), k.float(), v.float(), bias, scale)
    fused_s = timed(lambda: partial_attention(q, k, v, bias, scale, fused=True), 20, device)
    plain_s = timed(lambda: matmul_attention(q, k, v, bias, scale), 20, device)
    return {
        "fused_attention_max_abs_diff_out": float((out.float() - ref_out).abs().max()),
        "fused_attention_max_abs_diff_lse": float((lse - ref_lse).abs().max()),
        "fused_attention_speedup_vs_matmuls": plain_s / fused_s,
    }


def matmul_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(base weights that enter a matrix product per token, the head included once; LoRA
    adapter parameters)."""
    base = lora = 0
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            lora += parameter.numel()
        elif parameter.dim() == 2 and "embed_tokens" not in name:
            base += parameter.numel()
    head = model.get_output_embeddings().base
    if head.weight is model.get_input_embeddings().weight:  # tied: the head still multiplies
        base += head.weight.numel()
    return base, lora


def measure_mfu(engine, config, args, device, generator, vocab) -> dict:
    model = engine._resource("r").loaded.model
    base, lora = matmul_parameters(model)
    rows, length = args.fb_rows, args.fb_tokens
    request = ForwardBackwardRequest(
        tuple(ce_sample(generator, length, vocab) for _ in range(rows)), CE
    )

    def step() -> None:
        one_pass(engine, request)
        engine.discard_gradients("r", "s0")

    step()  # warm-up
    seconds = timed(step, args.repeats, device)
    tokens = rows * length
    layers, heads, dim = (
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["head_dim"],
    )
    attention = 6 * layers * rows * length * length * heads * dim  # causal: half of 12
    flops = 4 * base * tokens + 6 * lora * tokens + attention
    flops_6n = 6 * base * tokens + attention
    peak = args.peak_tflops
    if peak is None and device.type == "cuda":
        name = torch.cuda.get_device_name(0)
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    report = {
        "fb_tokens": tokens,
        "fb_seconds": seconds,
        "fb_tokens_per_s": tokens / seconds,
        "fb_tflops_per_s": flops / seconds / 1e12,
        "peak_tflops": peak,
        "mfu": None if peak is None else flops / seconds / (peak * 1e12),
        "mfu_6n": None if peak is None else flops_6n / seconds / (peak * 1e12),
    }
    if device.type == "cuda":
        report["fb_max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return report


def rl_prompts(args, vocab: int, generator: torch.Generator) -> list[tuple[int, ...]]:
    return [
        tuple(torch.randint(3, vocab, (args.prompt_tokens,), generator=generator).tolist())
        for _ in range(args.prompts)
    ]


def count_generated(rows: list[list[int]], eos: int) -> int:
    """Tokens each row generated, up to and including its first EOS."""
    return sum(row.index(eos) + 1 if eos in row else len(row) for row in rows)


def measure_sampling(engine, config, args, device, dtype, generator, vocab) -> dict:
    """Decode steps and tokens/s of the sampler, and `generate`'s tokens/s, on the RL shape.
    A decode step's time is the difference between a call of --new-tokens and one of a single
    token (the prefill and first draw) on fresh prompts of the same shape, over the steps
    between: replayed CUDA graphs run no Python module, so no hook can time a pass."""
    resource, session = engine._session("r", "s0")
    model = resource.loaded.model

    def posttrain(prompts, max_tokens: int = args.new_tokens) -> int:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=3)
        request = SampleRequest(tuple(prompts), args.samples, params)
        (results,) = engine.sample_batch("r", [("s0", request)])
        return sum(len(s.tokens) for r in results for s in r.sequences)

    @torch.no_grad()
    def transformers(prompts) -> int:
        ids = torch.tensor([p for p in prompts for _ in range(args.samples)], device=device)
        with resource.lora.route([(session.generator_key, None)]):
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                eos_token_id=0,
                pad_token_id=0,
            )
        return count_generated(out[:, ids.shape[1] :].tolist(), 0)

    def seconds(fn) -> tuple[float, int]:
        sync(device)
        start = time.perf_counter()
        count = fn()
        sync(device)
        return time.perf_counter() - start, count

    posttrain(rl_prompts(args, vocab, generator))  # warm-ups
    posttrain(rl_prompts(args, vocab, generator), 1)
    transformers(rl_prompts(args, vocab, generator))
    ours, theirs, steps = [], [], []
    for _ in range(args.repeats):
        prompts = rl_prompts(args, vocab, generator)
        full_s, tokens = seconds(lambda: posttrain(prompts))  # noqa: B023
        ours.append(tokens / full_s)
        first = rl_prompts(args, vocab, generator)
        first_s, _ = seconds(lambda: posttrain(first, 1))  # noqa: B023
        steps.append((full_s - first_s) / max(1, args.new_tokens - 1))
        generate_s, tokens = seconds(lambda: transformers(prompts))  # noqa: B023
        theirs.append(tokens / generate_s)
    rows = args.prompts * args.samples
    step_s = statistics.median(steps)
    # Bytes one decode step reads: weights (the tied head once), adapters, and KV: each
    # prompt's once, each row's own at the mean own length.
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"]
    kv_per_token *= config["head_dim"] * dtype.itemsize
    kv_bytes = kv_per_token * (args.prompts * args.prompt_tokens + rows * args.new_tokens // 2)
    step_bytes = weight_bytes + kv_bytes
    report = {
        "rl_shape": f"{args.prompts} prompts x {args.prompt_tokens} tokens x {args.samples}"
        f" samples x {args.new_tokens} new tokens",
        "sampler_tokens_per_s": statistics.median(ours),
        "generate_tokens_per_s": statistics.median(theirs),
        "sampler_over_generate": statistics.median(ours) / statistics.median(theirs),
        "sampler_over_generate_paired": statistics.median(
            o / t for o, t in zip(ours, theirs, strict=True)
        ),
        "decode_rows": rows,
        "decode_step_ms": step_s * 1e3,
        "decode_tokens_per_s": rows / step_s,
        "decode_bytes_per_step": step_bytes,
        "decode_achieved_tb_per_s": step_bytes / step_s / 1e12,
    }
    if args.bandwidth_tbs:
        limit = rows * args.bandwidth_tbs * 1e12 / step_bytes
        report["decode_bandwidth_limit_tokens_per_s"] = limit
        report["decode_fraction_of_bandwidth_limit"] = (rows / step_s) / limit
    return report


def measure_decode_paths(engine, args, device, generator, vocab) -> dict:
    """Sampler tokens/s on the RL shape four ways, alternated: static-shape passes in blocks
    of 8 replayed from CUDA graphs (on CUDA; eager elsewhere; `--cuda-graphs on`), the same
    passes eager, dynamic passes in blocks of 8 (the CUDA default), and the per-token dynamic
    passes (one host read per token). Whole sample calls, prefill and captures included."""
    ways = {
        "graphs": dict(static=True, graphs=True, block=sampler.DECODE_BLOCK_STEPS),
        "static_eager": dict(static=True, graphs=False, block=sampler.DECODE_BLOCK_STEPS),
        # the CUDA default (--cuda-graphs off): dynamic passes, one host read per block
        "blocks": dict(static=False, graphs=False, block=sampler.DECODE_BLOCK_STEPS),
        "per_token": dict(static=False, graphs=False, block=1),
    }
    saved = {
        name: getattr(sampler, name)
        for name in ("STATIC_DECODE", "CPU_STATIC_DECODE", "CUDA_GRAPHS")
        + ("DECODE_BLOCK_STEPS", "CPU_BLOCK_STEPS")
    }
    params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=5)
    rates: dict[str, list[float]] = {way: [] for way in ways}
    try:
        for repeat in range(args.repeats + 1):  # the first round warms up (and captures)
            prompts = rl_prompts(args, vocab, generator)
            for way, setting in ways.items():
                sampler.STATIC_DECODE = sampler.CPU_STATIC_DECODE = setting["static"]
                sampler.CUDA_GRAPHS = setting["graphs"]
                sampler.DECODE_BLOCK_STEPS = sampler.CPU_BLOCK_STEPS = setting["block"]
                request = SampleRequest(tuple(prompts), args.samples, params)
                sync(device)
                start = time.perf_counter()
                (results,) = engine.sample_batch("r", [("s0", request)])
                sync(device)
                tokens = sum(len(q.tokens) for r in results for q in r.sequences)
                if repeat:
                    rates[way].append(tokens / (time.perf_counter() - start))
    finally:
        for name, value in saved.items():
            setattr(sampler, name, value)
    report = {f"decode_{way}_tokens_per_s": statistics.median(r) for way, r in rates.items()}
    report["decode_graphs_over_per_token"] = statistics.median(
        g / p for g, p in zip(rates["graphs"], rates["per_token"], strict=True)
    )
    return report


def measure_weights_sync(engine, args, device) -> dict:
    """Latency of `publish`: the session's trainer adapter copied to its generator."""
    version = iter(range(10, 10_000))
    engine.publish("r", "s0", version=next(version))  # warm-up
    seconds = timed(
        lambda: engine.publish("r", "s0", version=next(version)), max(5, args.repeats), device
    )
    return {"weights_sync_ms": seconds * 1e3}


def summary(report: dict) -> str:
    def get(key, fmt="{:.3g}"):
        value = report.get(key)
        return "n/a" if value is None else fmt.format(value)

    lines = [
        f"device {report['device']} ({report.get('gpu', 'cpu')}), {report['model']}",
        f"  sampler vs forward logprobs, max |diff|  {get('sampler_vs_forward_max_abs_diff')}",
        f"  fused prefix attention vs matmuls (out/lse)  "
        f"{get('fused_attention_max_abs_diff_out')} / {get('fused_attention_max_abs_diff_lse')}",
        f"  forward-backward  {get('fb_tokens_per_s', '{:,.0f}')} tokens/s,"
        f" {get('fb_tflops_per_s')} TFLOP/s, MFU {get('mfu', '{:.1%}')}"
        f" (6N convention {get('mfu_6n', '{:.1%}')}; target >= 40%)",
        f"  decode  {get('decode_step_ms')} ms/step for {report.get('decode_rows')} rows,"
        f" {get('decode_tokens_per_s', '{:,.0f}')} tokens/s,"
        f" {get('decode_achieved_tb_per_s')} TB/s read;"
        f" {get('decode_fraction_of_bandwidth_limit', '{:.1%}')} of the bandwidth limit"
        f" ({get('decode_bandwidth_limit_tokens_per_s', '{:,.0f}')} tokens/s)",
        f"  sampler vs generate ({report.get('rl_shape')})"
        f"  {get('sampler_over_generate', '{:.2f}')}x"
        f" (paired {get('sampler_over_generate_paired', '{:.2f}')}x; target >= 3x):"
        f" {get('sampler_tokens_per_s', '{:,.0f}')} vs {get('generate_tokens_per_s', '{:,.0f}')}"
        " tokens/s",
        f"  decode paths  {get('decode_graphs_tokens_per_s', '{:,.0f}')} tokens/s static"
        " passes in CUDA graphs (eager off CUDA),"
        f" {get('decode_static_eager_tokens_per_s', '{:,.0f}')} static eager,"
        f" {get('decode_blocks_tokens_per_s', '{:,.0f}')} dynamic blocks (the default),"
        f" {get('decode_per_token_tokens_per_s', '{:,.0f}')} per-token dynamic"
        f" ({get('decode_graphs_over_per_token', '{:.2f}')}x)",
        f"  weights sync (publish)  {get('weights_sync_ms')} ms",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny model and shapes (dry run)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--fb-rows", type=int, default=None)
    parser.add_argument("--fb-tokens", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument(
        "--bandwidth-tbs",
        type=float,
        default=None,
        help="memory bandwidth (CUDA default: H200's 4.8)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()
    small = args.small
    defaults = dict(repeats=(2, 3), fb_rows=(2, 8), fb_tokens=(32, 1024))
    defaults.update(prompt_tokens=(16, 256), new_tokens=(8, 128))
    for key, (if_small, otherwise) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, if_small if small else otherwise)
    if small:
        args.prompts, args.samples = min(args.prompts, 2), min(args.samples, 2)
    device = torch.device(args.device)
    if args.bandwidth_tbs is None and device.type == "cuda":
        args.bandwidth_tbs = 4.8
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    config = SMALL if small else QWEN3_0_6B
    report: dict[str, object] = {
        "device": args.device,
        "dtype": dtype_name,
        "model": "small" if small else "qwen3-0.6b shape, random init",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(0)
    started = time.perf_counter()
    directory = Path(tempfile.mkdtemp()) / "bench-qwen3"
    build_model(directory, config, device, dtype)
    engine = LocalEngine(EngineConfig(device=args.device, dtype=dtype_name), {"bench": directory})
    engine.load_resource("r", "bench", muon_scaling=None)
    engine.create_session("r", "s0", LoraConfig(rank=32, alpha=64, seed=0))
    vocab = engine.model_info("bench").vocab_size
    generator = torch.Generator().manual_seed(0)
    # A trained, published adapter, so the sampler and the checks use non-zero LoRA weights.
    one_pass(engine, ForwardBackwardRequest((ce_sample(generator, 64, vocab),), CE))
    engine.optim_step("r", "s0", OptimStepRequest(adam=AdamParams(learning_rate=1e-3)))
    engine.publish("r", "s0", version=1)

    report["sampler_vs_forward_max_abs_diff"] = check_logprobs(engine, vocab, generator)
    if device.type in ("cuda", "cpu"):
        report.update(check_fused_attention(config, device, dtype))
    report.update(measure_mfu(engine, config, args, device, generator, vocab))
    report.update(measure_sampling(engine, config, args, device, dtype, generator, vocab))
    report.update(measure_decode_paths(engine, args, device, generator, vocab))
    report.update(measure_weights_sync(engine, args, device))
    report["wall_seconds"] = time.perf_counter() - started
    print(summary(report))
    text = json.dumps(report)
    if args.json is not None:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
