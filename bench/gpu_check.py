"""GPU check: correctness on the device and the numbers that say whether posttrain uses it well,
in ONE run that ends within --budget-s (450 s: under 8 minutes on an H200 with the model build;
bench/gpu_run.sh is the one command, with a hard timeout).

Builds a randomly initialised Qwen3 of the Qwen3-0.6B shape (28 layers, hidden 1024, 16 query /
8 KV heads of 128, MLP 3072, vocabulary 151,936, tied head: 596M parameters, 440M in the layers'
matmuls + the 156M head), bfloat16 on CUDA, saves it in HF format (no hub access) and runs
posttrain's LocalEngine on it: resource r (LoRA rank 32 sessions: s0, and a0..a7 for the
multi-LoRA section) and resource f (one full-weight session, fw). Sections, in order; each one
that fails prints its error in the report and the others still run; one whose estimate (scaled
by how much slower than estimated the last decode-bound section ran) exceeds the budget left is
skipped, saying so.

Section (estimate on an H200, written before the first run; ESTIMATE_S holds the times it
measured): what it prints.

- setup (~25 s): model build and save (1.2 GB), two resources, the full-weight generator copy;
- correctness (~10 s): sampler vs forward_only logprobs, max abs diff, LoRA and full weight,
  in bf16; the fused shared-prefix attention vs explicit matmuls (max diff, speed-up);
- fb_lora, fb_full, fb_transformers (~5, ~5, ~15 s): 8 x 1024 tokens of cross-entropy
  forward-backward through posttrain LoRA r32 and full weight, then through transformers full
  weight and PEFT LoRA r32 (same layers; same tokens, `model(ids, labels=ids).loss.backward()`
  on the model from_pretrained): tokens/s, TFLOP/s, MFU, peak GiB, posttrain / transformers;
- sampling (~40 s): the RL shape (16 prompts x 256 tokens x 8 samples x 128 new tokens):
  decode ms/step and tokens/s against the memory-bandwidth bound; sampler vs `generate`
  (dynamic cache, same model and adapter);
- decode_paths (~70 s): CUDA graphs (the default) / static eager / dynamic blocks of 8 /
  per-token on the RL shape, graphs vs blocks on 4 prompts x 16 new tokens, each path's and
  both `generate`s' whole-call tokens/s as a fraction of the bandwidth limit, and the line
  saying which `--cuda-graphs` default these support;
- multi_lora (~30 s): 8 adapters x 2 prompts x 8 samples x 32 new tokens in one batch vs the 8
  one at a time vs all rows on one adapter, tokens/s;
- stream (~30 s): one-sample operations (256 + 64 tokens) one per call vs 32 in one call,
  ops/s; a SampleStream admitting one per decode block, where posttrain has one;
- agents (~30 s): bench/closed_loop.py's closed loop on the LoRA session, 32 agents x 3
  turns of one-sample operations (256 prompt + 16-160 new tokens): operations joining the
  running generation vs whole batches (the sampler before continuous batching), ops/s and
  tokens/s while all run and over the whole run, median latency, in how many operations both
  ways returned the same tokens (where not, the first difference is a draw on a CDF boundary
  within the row-count-dependent rounding: neighbouring ids); both ways again with dynamic
  passes (`--cuda-graphs off`), and joining with each join prefilled apart (dynamic passes
  carry joins in their first pass); with graphs, joining against joins that always append
  (a capture each; joins take a layout's padding rows where they fit) and the captures made;
- weights_sync (~2 s): `publish` of the LoRA adapter (101 MB fp32) and the full weight (1.2 GB);
- generate_static (child process, <= 150 s): transformers `generate` with
  `cache_implementation="static"`, compiled on CUDA (its default), on the RL shape;
- fsdp2, vllm (child processes, what is left): bench/gpu_fsdp2.py and bench/gpu_vllm.py
  `run(device, small)` where present (FSDP2: else its `fsdp2_check(device)`; vLLM from the
  interpreter in POSTTRAIN_VLLM_PYTHON or .venv-vllm), their dicts as they return them, else
  `skipped: <reason>`.

Estimates from FLOPs and bytes: a LoRA forward-backward of 8,192 tokens is 4 x 596M (frozen
base: forward and input gradients) + 6 x 25M (adapter) per token + causal attention 2.9 TFLOP =
23.7 TFLOP, full weight 6 x 596M per token + 2.9 = 32.2 TFLOP: 0.06-0.1 s at 30-40% of the
989 TFLOP/s bf16 peak, 16 timed steps. A decode step of 128 rows reads 1.19 GB of weights, the
adapter and 1.4 GB of KV (4,096 prompt tokens + 128 rows x 64 own on average, 112 KiB a token):
0.57 ms at 4.8 TB/s (the bound, ~225k tokens/s); eager steps are launch-bound (~4k kernels,
20-40 ms), so a 128-token call is ~3-5 s eager and well under 1 s replayed from graphs. The
static-cache `generate` spends most of its time compiling (first call, reported apart).

Prints one summary line per number, the `--cuda-graphs` default the decode paths support, and
the report as JSON (last line; --json writes it too, after every section, so a run cut short
keeps what it measured).

    bench/gpu_run.sh                                        # the GPU session's one command
    python bench/gpu_check.py --device cuda                 # the same, without the timeout
    python bench/gpu_check.py --device cpu --small          # a dry run of every step, here
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.config import EngineConfig  # noqa: E402
from posttrain.engine.generate import sampler  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.types import (  # noqa: E402
    AdamParams,
    ForwardBackwardRequest,
    LoraConfig,
    OptimStepRequest,
)

# isort: split
import gpu_check_ops as ops  # noqa: E402  (bench/ is this script's folder)
import gpu_check_sample as sample  # noqa: E402
from gpu_check_common import CE, QWEN3_0_6B, SMALL, build_model, ce_sample, one_pass  # noqa: E402
from gpu_check_isolated import optional_section, static_section  # noqa: E402
from gpu_check_report import summary  # noqa: E402
from gpu_check_train import ForwardBackward, fb_ratios  # noqa: E402

# Seconds each section took on the H200 run (docs/benchmarks.md, "GPU check"; the sampler
# sections at the dynamic-blocks default of then): a section is skipped when less than this,
# scaled by `pace`, is left of --budget-s. They add up to more than one call's budget, so
# the children may find none left: a second call with --skip gets them (bench/gpu_run.sh).
ESTIMATE_S = {
    "correctness": 6,
    "full_weight": 5,
    "fb_lora": 3,
    "fb_full": 2,
    "fb_transformers": 5,
    "sampling": 92,
    "decode_paths": 137,
    "multi_lora": 62,
    "stream": 75,  # 57 s then; since, the same stream on the 8 adapters in turn too
    "agents": 150,  # 62 s with dynamic passes, run since with graphs too, joins apart, appending
    "weights_sync": 1,
    "generate_static": 80,
}
CHILD_CAP_S = {"generate_static": 150, "fsdp2": 120, "vllm": 240}
RANK, ALPHA = 32, 64


class Run:
    """The report and the clock: runs sections within the budget, each failure its own."""

    def __init__(self, args, report: dict) -> None:
        self.args, self.report = args, report
        self.started = time.perf_counter()
        self.report["sections"] = {}
        # How much slower than estimated the last decode-bound section (estimate >= 30 s) ran,
        # at least 1: later estimates are scaled by it, so a slow device skips sections rather
        # than overrun the budget.
        self.pace = 1.0

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.started)

    def section(self, name: str, fn) -> None:
        sections = self.report["sections"]
        estimate = 0 if self.args.small else ESTIMATE_S.get(name, 0) * self.pace
        if name in self.args.skip:
            sections[name] = "skipped: --skip"
        elif estimate > self.left():
            sections[name] = f"skipped: ~{estimate:.0f} s estimated, {self.left():.0f} s left"
        else:
            start = time.perf_counter()
            try:
                self.report.update(fn())
                sections[name] = f"ok in {time.perf_counter() - start:.1f} s"
            except Exception as exc:  # noqa: BLE001  (a failing section must not stop the run)
                traceback.print_exc()
                sections[name] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            if ESTIMATE_S.get(name, 0) >= 30:
                self.pace = max(1.0, (time.perf_counter() - start) / ESTIMATE_S[name])
        self.report["pace"] = self.pace
        self.write()

    def child(self, name: str, fn, *, nested: bool = True) -> None:
        """A child-process section: `fn(timeout)` gets what is left of the budget, capped; its
        dict goes under `name` (or, not `nested`, into the report), a `skipped: ...` string
        under `name` and into the sections."""
        start = time.perf_counter()
        if name in self.args.skip:
            result = "skipped: --skip"
        else:
            result = fn(min(CHILD_CAP_S[name], self.left() - 5))
        if isinstance(result, str) or nested:
            self.report[name] = result
        else:
            self.report.update(result)
        ok = f"ok in {time.perf_counter() - start:.1f} s"
        self.report["sections"][name] = result if isinstance(result, str) else ok
        self.write()

    def write(self) -> None:
        self.report["wall_seconds"] = time.perf_counter() - self.started
        if self.args.json is not None:
            self.args.json.write_text(json.dumps(self.report))


def setup(args, device, dtype_name: str, directory: Path) -> tuple[LocalEngine, int]:
    """The engine with resource r and its trained, published LoRA session s0."""
    # cuda_graphs=False with STATIC_DECODE on: the same default path on CUDA (static passes in
    # CUDA graphs, --cuda-graphs on), which the decode paths section can switch off for its
    # dynamic ways (gm.cuda_graphs would keep them static); no effect on the CPU dry run.
    config = EngineConfig(device=args.device, dtype=dtype_name, cuda_graphs=False)
    sampler.STATIC_DECODE = True
    engine = LocalEngine(config, {"bench": directory})
    engine.load_resource("r", "bench", muon_scaling=None)
    engine.create_session("r", "s0", LoraConfig(rank=RANK, alpha=ALPHA, seed=0))
    vocab = engine.model_info("bench").vocab_size
    train_and_publish(engine, "s0", vocab, torch.Generator().manual_seed(1))
    return engine, vocab


def train_and_publish(engine: LocalEngine, session: str, vocab: int, generator) -> None:
    """One step, so the adapter's weights are not zero, and its publish to the generator."""
    one_pass(engine, ForwardBackwardRequest((ce_sample(generator, 64, vocab),), CE), "r", session)
    engine.optim_step("r", session, OptimStepRequest(adam=AdamParams(learning_rate=1e-3)))
    engine.publish("r", session, version=1)


def full_weight(engine: LocalEngine, vocab: int, generator) -> dict:
    """Resource f with its full-weight session fw; the sampler / trainer logprob check on it."""
    engine.load_resource("f", "bench", muon_scaling=None)
    engine.create_session("f", "fw", None)
    diff = sample.check_logprobs(engine, vocab, generator, "f", "fw")
    return {"sampler_vs_forward_full_weight_max_abs_diff": diff}


def multi_lora(engine: LocalEngine, args, device, generator, vocab) -> dict:
    for index in range(ops.ADAPTERS):
        if f"a{index}" not in engine._resource("r").sessions:
            engine.create_session("r", f"a{index}", LoraConfig(rank=RANK, alpha=ALPHA, seed=index))
            train_and_publish(engine, f"a{index}", vocab, generator)
    return ops.measure_multi_lora(engine, args, device, generator, vocab)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny model and shapes (dry run)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers (rehearsal)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--fb-rows", type=int, default=None)
    parser.add_argument("--fb-tokens", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--short-tokens", type=int, default=None, help="decode paths, short")
    parser.add_argument("--lora-prompts", type=int, default=None, help="per adapter")
    parser.add_argument("--lora-tokens", type=int, default=None)
    parser.add_argument("--lora-repeats", type=int, default=None)
    parser.add_argument("--stream-tokens", type=int, default=None)
    parser.add_argument("--agents", type=int, default=None, help="closed-loop agents")
    parser.add_argument("--agent-turns", type=int, default=None)
    parser.add_argument("--agent-tokens", type=int, nargs=2, default=None, metavar=("LOW", "HIGH"))
    parser.add_argument(
        "--static-generate",
        default="compiled",
        choices=("compiled", "eager"),
        help="transformers' static-cache generate: compiled (its CUDA default) or eager",
    )
    parser.add_argument("--budget-s", type=float, default=450.0, help="the whole run's seconds")
    parser.add_argument("--skip", default="", help="comma-separated section names to skip")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument(
        "--bandwidth-tbs", type=float, default=None, help="memory bandwidth (CUDA: H200's 4.8)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()
    defaults = dict(repeats=(2, 3), fb_rows=(2, 8), fb_tokens=(32, 1024), prompt_tokens=(16, 256))
    defaults.update(new_tokens=(8, 128), short_tokens=(4, 16), lora_prompts=(1, 2))
    defaults.update(lora_tokens=(4, 32), lora_repeats=(1, 2), stream_tokens=(4, 64))
    defaults.update(agents=(3, 32), agent_turns=(2, 3), agent_tokens=((2, 8), (16, 160)))
    for key, (if_small, otherwise) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, if_small if args.small else otherwise)
    if args.small:
        args.prompts, args.samples = min(args.prompts, 2), min(args.samples, 2)
    if args.bandwidth_tbs is None and args.device.startswith("cuda"):
        args.bandwidth_tbs = 4.8
    args.skip = {s for s in args.skip.split(",") if s}
    return args


def main() -> None:
    args = parse_args()
    # A TERM (gpu_run.sh's timeout) unwinds, so a child section kills its process group.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    device = torch.device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    config = SMALL if args.small else QWEN3_0_6B
    if args.layers is not None:
        config = {**config, "num_hidden_layers": args.layers}
    report: dict[str, object] = {
        "device": args.device,
        "dtype": dtype_name,
        "model": ("small" if args.small else "qwen3-0.6b shape, random init")
        + ("" if args.layers is None else f", {args.layers} layers"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "budget_s": args.budget_s,
    }
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(0)
    run = Run(args, report)
    directory = Path(tempfile.mkdtemp(prefix="gpu_check-")) / "bench-qwen3"
    atexit.register(shutil.rmtree, directory.parent, True)  # the model (1.2 GB on the GPU run)
    try:
        build_model(directory, config, device, dtype)
        engine, vocab = setup(args, device, dtype_name, directory)
        fb = ForwardBackward(
            engine, config, args, device, dtype, torch.Generator().manual_seed(2), vocab
        )
        report["sections"]["setup"] = "ok"
    except Exception as exc:  # noqa: BLE001  (the children may still run)
        traceback.print_exc()
        engine, vocab = None, 0
        report["sections"]["setup"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
    report["setup_seconds"] = time.perf_counter() - run.started
    generator = torch.Generator().manual_seed(0)

    def correctness() -> dict:
        result = {
            "sampler_vs_forward_max_abs_diff": sample.check_logprobs(engine, vocab, generator)
        }
        return result | sample.check_fused_attention(config, device, dtype)

    in_process = {
        "correctness": correctness,
        "full_weight": lambda: full_weight(engine, vocab, generator),
        "fb_lora": lambda: fb.posttrain_lora(),
        "fb_full": lambda: fb.posttrain_full(),
        "fb_transformers": lambda: fb.transformers(directory),
        "sampling": lambda: sample.measure_sampling(
            engine, config, args, device, dtype, generator, vocab
        ),
        "decode_paths": lambda: sample.measure_decode_paths(engine, args, device, generator, vocab),
        "multi_lora": lambda: multi_lora(engine, args, device, generator, vocab),
        "stream": lambda: ops.measure_stream(engine, args, device, generator, vocab),
        "agents": lambda: ops.measure_agents(engine, args, vocab),
        "weights_sync": lambda: ops.measure_weights_sync(engine, args, device),
    }
    for name, fn in in_process.items():
        if engine is None:
            report["sections"][name] = "skipped: the setup failed"
        else:
            run.section(name, fn)
    report.update(fb_ratios(report))
    choice, line = sample.cuda_graphs_decision(report, device)
    report["cuda_graphs_default_supported"], report["cuda_graphs_decision"] = choice, line
    engine = fb = None  # the children get the device to themselves (vLLM sizes by it)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    shape = [args.prompts, args.prompt_tokens, args.samples, args.new_tokens]
    compiled = args.static_generate == "compiled"
    static_args = [str(directory), args.device, dtype_name, shape, args.repeats, compiled]

    def static(timeout: float) -> dict | str:
        if timeout < (0 if args.small else ESTIMATE_S["generate_static"]):
            return f"skipped: {timeout:.0f} s of the budget left"
        result = static_section(static_args, timeout)
        if isinstance(result, dict) and "sampler_tokens_per_s" in report:
            result["sampler_over_generate_static"] = (
                report["sampler_tokens_per_s"] / result["generate_static_tokens_per_s"]
            )
        return result

    run.child("generate_static", static, nested=False)
    # run(device, small), or the FSDP2 module's fsdp2_check(device, ...) (smaller when small)
    fsdp2_small = dict(steps=1, rows=2, tokens=16) if args.small else {}
    fsdp2_calls = [("run", [args.device, args.small], {})]
    fsdp2_calls.append(("fsdp2_check", [args.device], fsdp2_small))
    run.child("fsdp2", lambda t: optional_section("gpu_fsdp2", fsdp2_calls, t))
    vllm_calls = [("run", [args.device, args.small], {})]
    # vLLM runs from its own interpreter (gpu_vllm.run finds it), not from this one
    run.child("vllm", lambda t: optional_section("gpu_vllm", vllm_calls, t))
    report.update(sample.bound_fractions(report))
    run.write()
    print(summary(report))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
