"""Long-context training memory and time: one forward-backward of one long sample, posttrain's
engine (decoder layers checkpointed) against transformers + peft with
`gradient_checkpointing_enable()` (a benchmark, not a timed test; issue 44).

Model: a randomly initialised Qwen3 of ~20M parameters (32k vocabulary, untied head, 4 layers
of width 256, grouped-query attention 4/2 heads of 64) whose config allows 131,072 positions,
float32, one LoRA session of rank 8 on every attention and MLP projection. `--quick`: a 2-layer,
128-wide model and short lengths, for the smoke test (tests/integration/test_bench_long_context.py).

Each measurement runs in a fresh process (bench/forward_backward.py's method): one short warm-up
step, then the kernel's peak-RSS mark is reset (/proc/self/clear_refs) and the measured step
runs; glibc maps every allocation of 64 KiB or more on its own (MALLOC_MMAP_THRESHOLD_), so
freed tensors leave the RSS at once and the peak follows live memory. Printed per length: the
process's peak RSS, the RSS before the step (weights, adapter, libraries), the step's growth
above it (`peak - weights` in the issue's terms: activations, KV, gradients), and seconds per
1k tokens. posttrain's step is `LocalEngine.forward_backward_batch` with
`--activation-checkpointing on`; transformers' is `model(input_ids, labels=...)` (its own loss)
and backward on the same model with the same adapter.

Targets (issue 44): growth(32k) <= 9 x growth(4k) (memory linear in tokens); the 32k
forward-backward within 8 GiB of peak RSS; at 16k, time per token <= 1.2x and peak RSS <= 0.8x
transformers + peft with checkpointing. Timings are of single runs in one process each, on a
shared machine: read the time ratio as rough.

    python bench/long_context.py                 # 4k, 8k, 16k, 32k; the baseline at 16k
    python bench/long_context.py --quick         # 2-layer model, 512 and 4096, no baseline
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from posttrain.config import BUILTIN_MODEL_DIR, EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.types import (
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    SampleRequest,
    SamplingParams,
    TrainingSample,
)

MODEL_ID = "qwen3-long"
RESOURCE, SESSION = "r", "s"
CE = LossConfig(LossType.CROSS_ENTROPY)
GIB = 1 << 30
MIB = 1 << 20
WARM_UP = 64
MODEL = dict(
    vocab_size=32000,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=False,
)
QUICK_MODEL = {**MODEL, "vocab_size": 4096, "hidden_size": 128, "num_hidden_layers": 2}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_model(directory: Path, quick: bool) -> None:
    torch.manual_seed(0)
    config = Qwen3Config(
        **(QUICK_MODEL if quick else MODEL),
        max_position_embeddings=131072,
        eos_token_id=0,
        pad_token_id=0,
    )
    Qwen3ForCausalLM(config).save_pretrained(directory)
    # load_model wants a tokenizer; the built-in one is never used on these token ids.
    AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR).save_pretrained(directory)


def sample_tokens(length: int, vocab: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length + 1,), generator=generator).tolist()


def proc_status_kib(field: str) -> int:
    match = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    assert match is not None, f"no {field} in /proc/self/status"
    return int(match.group(1))


# ------------------------------------------------------------------ the two variants (children)


def posttrain_runner(model_dir: str, vocab: int):  # type: ignore[no-untyped-def]
    config = EngineConfig(device="cpu", activation_checkpointing="on")
    engine = LocalEngine(config, {MODEL_ID: Path(model_dir)})
    engine.load_resource(RESOURCE, MODEL_ID, muon_scaling=None)
    engine.create_session(RESOURCE, SESSION, LoraConfig(rank=8, alpha=16, train_unembed=False))

    def step(length: int, seed: int) -> float:
        tokens = sample_tokens(length, vocab, seed)
        inputs = {"target_tokens": tuple(map(float, tokens[1:])), "weights": (1.0,) * length}
        request = ForwardBackwardRequest((TrainingSample(tuple(tokens[:-1]), inputs),), CE)
        (outcome,) = engine.forward_backward_batch(RESOURCE, [(SESSION, request)])
        assert not isinstance(outcome, Exception), outcome
        engine.discard_gradients(RESOURCE, SESSION)
        return outcome.loss

    return step


def sampler_runner(model_dir: str, vocab: int):  # type: ignore[no-untyped-def]
    """One greedy token after a prompt of `length` tokens, with the prompt's logprobs: the
    prefill in passes of 8,192 positions, each attending as a CausalChunk (no [Q, K] mask)."""
    engine = LocalEngine(EngineConfig(device="cpu"), {MODEL_ID: Path(model_dir)})
    engine.load_resource(RESOURCE, MODEL_ID, muon_scaling=None)
    engine.create_session(RESOURCE, SESSION, LoraConfig(rank=8, alpha=16, train_unembed=False))
    greedy = SamplingParams(max_tokens=1, temperature=0.0)

    def step(length: int, seed: int) -> float:
        prompt = tuple(sample_tokens(length - 1, vocab, seed))
        request = SampleRequest((prompt,), 1, greedy, prompt_logprobs=True)
        ((result,),) = engine.sample_batch(RESOURCE, [(SESSION, request)])
        assert not isinstance(result, Exception), result
        return float(result.prompt_logprobs[-1])

    return step


def transformers_runner(model_dir: str, vocab: int):  # type: ignore[no-untyped-def]
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model

    model = Qwen3ForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    model = get_peft_model(model, PeftLora(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.train()

    def step(length: int, seed: int) -> float:
        # transformers shifts the labels itself: `length` inputs, length - 1 targets.
        ids = torch.tensor([sample_tokens(length, vocab, seed)[:length]])
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        return float(out.loss)

    return step


def run_probe(spec: str) -> None:
    """One variant, one length, in this fresh process: a warm-up step, then the measured one;
    prints a JSON line (peak RSS, RSS before, seconds)."""
    probe = json.loads(spec)
    runners = {"posttrain": posttrain_runner, "sample": sampler_runner}
    make = runners.get(probe["variant"], transformers_runner)
    step = make(probe["model_dir"], probe["vocab"])
    step(WARM_UP, seed=2)
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = proc_status_kib("VmRSS") << 10
    start = time.perf_counter()
    step(probe["length"], seed=1)
    seconds = time.perf_counter() - start
    peak = proc_status_kib("VmHWM") << 10
    print(json.dumps(dict(peak=peak, before=before, seconds=seconds)))


# ------------------------------------------------------------------ the parent


def probe(variant: str, model_dir: str, vocab: int, length: int, threads: int) -> dict[str, float]:
    spec = json.dumps(dict(variant=variant, model_dir=model_dir, vocab=vocab, length=length))
    command = [sys.executable, __file__, "--threads", str(threads), "--probe", spec]
    environment = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(64 << 10))
    result = subprocess.run(command, check=True, capture_output=True, text=True, env=environment)
    measured: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return measured


def row(label: str, length: int, m: dict[str, float]) -> str:
    growth = m["peak"] - m["before"]
    per_k = m["seconds"] / length * 1024
    return (
        f"  {label:<22}{length:>7}{m['peak'] / MIB:>11.0f}{m['before'] / MIB:>10.0f}"
        f"{growth / MIB:>10.0f}{per_k:>12.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a small model and short lengths")
    parser.add_argument("--lengths", type=int, nargs="*", help="tokens per training sample")
    parser.add_argument("--baseline-at", type=int, help="length compared with transformers+peft")
    parser.add_argument("--sample-lengths", type=int, nargs="*", help="prompt tokens sampled")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe:
        run_probe(args.probe)
        return
    lengths = (
        args.lengths
        if args.lengths is not None
        else ([512, 4096] if args.quick else [4096, 8192, 16384, 32768])
    )
    baseline_at = args.baseline_at if args.baseline_at is not None else (0 if args.quick else 16384)
    sample_lengths = args.sample_lengths
    if sample_lengths is None:
        sample_lengths = [] if args.quick else [4096, 32768]
    threads = torch.get_num_threads()
    vocab = (QUICK_MODEL if args.quick else MODEL)["vocab_size"]
    print(f"torch {torch.__version__}, {threads} threads, cpu, float32")
    with tempfile.TemporaryDirectory() as directory:
        write_model(Path(directory), args.quick)
        config = Qwen3Config.from_pretrained(directory)
        with torch.device("meta"):
            params = sum(p.numel() for p in Qwen3ForCausalLM(config).parameters())
        print(
            f"{MODEL_ID}: {params / 1e6:.1f}M parameters (random), {config.num_hidden_layers}"
            f" layers, max_position_embeddings {config.max_position_embeddings}, LoRA rank 8"
        )
        print(
            f"  {'variant':<22}{'tokens':>7}{'peak MiB':>11}{'before':>10}{'growth':>10}"
            f"{'s / 1k tok':>12}"
        )
        ours: dict[int, dict[str, float]] = {}
        theirs = None
        # The baseline right after posttrain at its length: the longest run comes last.
        for length in sorted(set(lengths) | ({baseline_at} if baseline_at else set())):
            ours[length] = probe("posttrain", directory, vocab, length, threads)
            print(row("posttrain (ckpt on)", length, ours[length]), flush=True)
            if length == baseline_at:
                theirs = probe("transformers", directory, vocab, length, threads)
                print(row("transformers+peft ckpt", length, theirs), flush=True)
        sampled = {}
        for length in sample_lengths:
            sampled[length] = probe("sample", directory, vocab, length, threads)
            print(row("posttrain sample", length, sampled[length]), flush=True)
    if len(sampled) > 1:
        low, high = min(sampled), max(sampled)
        grown = [sampled[n]["peak"] - sampled[n]["before"] for n in (low, high)]
        print(
            f"sampling: growth({high}) / growth({low}) = {grown[1] / grown[0]:.2f}"
            f" ({high // low}x the prompt; the KV cache and prefix cache are linear in it)"
        )
    if not ours:
        return
    short, long = min(lengths), max(lengths)
    growth = {n: m["peak"] - m["before"] for n, m in ours.items()}
    factor = long // short
    ratio = growth[long] / growth[short]
    print(
        f"growth({long}) / growth({short}) = {ratio:.2f}   target <= {factor + 1}"
        f" (linear: {factor}x the tokens)"
    )
    print(
        f"peak RSS at {long}: {ours[long]['peak'] / GIB:.2f} GiB   target < 8 GiB"
        f" ({'met' if ours[long]['peak'] < 8 * GIB else 'MISSED'})"
    )
    if theirs is not None:
        mine = ours[baseline_at]
        time_ratio = mine["seconds"] / theirs["seconds"]
        peak_ratio = mine["peak"] / theirs["peak"]
        print(
            f"at {baseline_at}: time per token posttrain / transformers+peft {time_ratio:.2f}x"
            f"   target <= 1.2"
        )
        print(
            f"at {baseline_at}: peak RSS posttrain / transformers+peft {peak_ratio:.2f}x"
            f"   target <= 0.8"
        )


if __name__ == "__main__":
    main()
