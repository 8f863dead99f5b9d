"""The sampler sections of bench/gpu_check.py: correctness on the device (sampler logprobs vs the
trainer's forward pass; the fused shared-prefix attention kernel vs explicit matmuls), the
decode step against the memory-bandwidth bound and transformers `generate` (dynamic cache, in
this process), and the decode paths that decide `--cuda-graphs`."""

from __future__ import annotations

import statistics

import torch
from gpu_check_common import (
    CE,
    count_generated,
    one_pass,
    random_tokens,
    rl_prompts,
    seconds,
    switched,
    timed,
)

from posttrain.engine.generate import sampler
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.model.attention_kernels import matmul_attention, partial_attention
from posttrain.types import ForwardBackwardRequest, SampleRequest, SamplingParams, TrainingSample


def check_logprobs(engine: LocalEngine, vocab: int, generator, resource="r", session="s0") -> float:
    """Max |sampler logprob - forward_only logprob| over 4 samples of 32 tokens."""
    prompt = random_tokens(generator, 16, vocab)
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=1)
    ((result,),) = engine.sample_batch(resource, [(session, SampleRequest((prompt,), 4, params))])
    worst = 0.0
    for sequence in result.sequences:
        full = list(prompt) + sequence.tokens
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(sequence.tokens)
        sample = TrainingSample(
            tuple(full[:-1]),
            {"target_tokens": tuple(float(t) for t in full[1:]), "weights": tuple(weights)},
        )
        request = ForwardBackwardRequest(
            (sample,), CE, forward_only=True, return_loss_fn_outputs=True
        )
        scored = one_pass(engine, request, resource, session)
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


def _sample_tokens(engine, items, resource: str = "r") -> int:
    """Generated tokens of one engine.sample_batch over `items`."""
    results = engine.sample_batch(resource, items)
    return sum(len(s.tokens) for per_item in results for r in per_item for s in r.sequences)


def measure_sampling(engine, config, args, device, dtype, generator, vocab) -> dict:
    """Decode steps and tokens/s of the sampler, and `generate`'s tokens/s, on the RL shape.
    A decode step's time is the difference between a call of --new-tokens and one of a single
    token (the prefill and first draw) on fresh prompts of the same shape, over the steps
    between: replayed CUDA graphs run no Python module, so no hook can time a pass."""
    resource, session = engine._session("r", "s0")
    model = resource.loaded.model

    def posttrain(prompts, max_tokens: int = args.new_tokens) -> int:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=3)
        return _sample_tokens(engine, [("s0", SampleRequest(tuple(prompts), args.samples, params))])

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

    posttrain(rl_prompts(args, vocab, generator))  # warm-ups
    posttrain(rl_prompts(args, vocab, generator), 1)
    transformers(rl_prompts(args, vocab, generator))
    ours, theirs, steps = [], [], []
    for _ in range(args.repeats):
        prompts = rl_prompts(args, vocab, generator)
        full_s, tokens = seconds(lambda: posttrain(prompts), device)  # noqa: B023
        ours.append(tokens / full_s)
        first = rl_prompts(args, vocab, generator)
        first_s, _ = seconds(lambda: posttrain(first, 1), device)  # noqa: B023
        steps.append((full_s - first_s) / max(1, args.new_tokens - 1))
        generate_s, tokens = seconds(lambda: transformers(prompts), device)  # noqa: B023
        theirs.append(tokens / generate_s)
    rows = args.prompts * args.samples
    step_s = statistics.median(steps)
    # Bytes one decode step reads: weights (the tied head once), the adapter, and KV: each
    # prompt's once, each row's own at the mean own length.
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    adapter = resource.lora.adapter_parameters(session.generator_key)
    weight_bytes += sum(p.numel() * p.element_size() for _, p in adapter)
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


WAYS = {
    "graphs": dict(static=True, graphs=True, block=sampler.DECODE_BLOCK_STEPS),
    "static_eager": dict(static=True, graphs=False, block=sampler.DECODE_BLOCK_STEPS),
    # --cuda-graphs off (the CUDA default before the H200 run): dynamic passes, one host read
    # per block
    "blocks": dict(static=False, graphs=False, block=sampler.DECODE_BLOCK_STEPS),
    "per_token": dict(static=False, graphs=False, block=1),
}


def _decode_rates(engine, args, device, generator, vocab, ways, prompts, new_tokens) -> dict:
    """Per way, the tokens/s of --repeats whole sample calls (prefill and captures included),
    the ways alternated, after one warm-up round (which also captures)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=5)
    rates: dict[str, list[float]] = {way: [] for way in ways}
    for repeat in range(args.repeats + 1):
        batch = [random_tokens(generator, args.prompt_tokens, vocab) for _ in range(prompts)]
        for way in ways:
            setting = WAYS[way]
            request = SampleRequest(tuple(batch), args.samples, params)
            with switched(
                sampler,
                STATIC_DECODE=setting["static"],
                CPU_STATIC_DECODE=setting["static"],
                CUDA_GRAPHS=setting["graphs"],
                DECODE_BLOCK_STEPS=setting["block"],
                CPU_BLOCK_STEPS=setting["block"],
            ):
                elapsed, tokens = seconds(lambda: _sample_tokens(engine, [("s0", request)]), device)  # noqa: B023
            if repeat:
                rates[way].append(tokens / elapsed)
    return rates


def measure_decode_paths(engine, args, device, generator, vocab) -> dict:
    """Sampler tokens/s on the RL shape four ways: static-shape passes in blocks of 8 replayed
    from CUDA graphs (on CUDA, the default; eager elsewhere), the same passes eager,
    dynamic passes in blocks of 8 (`--cuda-graphs off`), and per-token
    dynamic passes (one host read per token); then graphs vs dynamic blocks on a short
    generation (--short-tokens, a quarter of the prompts), where a capture per call weighs most."""
    rates = _decode_rates(
        engine, args, device, generator, vocab, list(WAYS), args.prompts, args.new_tokens
    )
    report = {f"decode_{way}_tokens_per_s": statistics.median(r) for way, r in rates.items()}
    for way in ("per_token", "blocks", "static_eager"):
        report[f"decode_graphs_over_{way}"] = statistics.median(
            g / p for g, p in zip(rates["graphs"], rates[way], strict=True)
        )
    short_prompts = max(1, args.prompts // 4)
    short = _decode_rates(
        engine,
        args,
        device,
        generator,
        vocab,
        ["graphs", "blocks"],
        short_prompts,
        args.short_tokens,
    )
    report["decode_short_shape"] = (
        f"{short_prompts} prompts x {args.prompt_tokens} tokens x {args.samples} samples"
        f" x {args.short_tokens} new tokens"
    )
    report["decode_short_graphs_tokens_per_s"] = statistics.median(short["graphs"])
    report["decode_short_blocks_tokens_per_s"] = statistics.median(short["blocks"])
    report["decode_short_graphs_over_blocks"] = statistics.median(
        g / b for g, b in zip(short["graphs"], short["blocks"], strict=True)
    )
    return report


def cuda_graphs_decision(report: dict, device: torch.device) -> tuple[str | None, str]:
    """('on' / 'off' / None, the line saying which `--cuda-graphs` default the decode-path
    numbers support): on only if graphs beat dynamic blocks by 5% on the RL shape and do not
    lose on the short generation."""
    rl = report.get("decode_graphs_over_blocks")
    short = report.get("decode_short_graphs_over_blocks")
    eager = report.get("decode_graphs_over_static_eager")
    if rl is None or short is None:
        return None, "--cuda-graphs default: undecided (the decode paths did not run)"
    numbers = (
        f"graphs / dynamic blocks {rl:.2f}x on the RL shape, {short:.2f}x on the short"
        f" generation; graphs / static eager {eager:.2f}x"
    )
    if device.type != "cuda":
        return None, (
            f"--cuda-graphs default: no decision from a {device.type} run (graphs replay only"
            f" on CUDA; here the static passes ran eagerly): {numbers}"
        )
    choice = "on" if rl >= 1.05 and short >= 1.0 else "off"
    return choice, f"--cuda-graphs default supported by these numbers: {choice} ({numbers})"


def bound_fractions(report: dict) -> dict:
    """Whole-call tokens/s (prefill included) of each decode path and of the static-cache
    `generate`, as fractions of the RL shape's memory-bandwidth limit: graphs on and off
    against the bound and against each other on one scale."""
    limit = report.get("decode_bandwidth_limit_tokens_per_s")
    if not limit:
        return {}
    keys = [f"decode_{way}_tokens_per_s" for way in WAYS]
    keys += ["sampler_tokens_per_s", "generate_tokens_per_s", "generate_static_tokens_per_s"]
    return {
        key.replace("tokens_per_s", "fraction_of_bound"): report[key] / limit
        for key in keys
        if isinstance(report.get(key), float)
    }
