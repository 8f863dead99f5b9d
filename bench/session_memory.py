"""Memory of one session on a model resource: what adding a session costs beside the base model.

A LoRA resource loads the base weights once; each session adds its trainer adapter, its
generator adapter (the copy weights-sync publishes to) and its optimizer state (AdamW: two
moments per adapter tensor, after the first step). Gradients exist only between a
forward-backward and the next optim-step, so they are reported apart. A full-weight session,
for comparison, trains the base weights in place and adds a generator copy of the model and
the optimizer state of every weight.

Counts are exact tensor bytes (numel * element size) read from the engine's own objects after
one forward-backward and optim-step, not process RSS. Also checks that N sessions cost N times
one session's bytes (the base is shared).

`--project CONFIG_JSON` adds a projection for a model too large to load here: the model is
built from its config.json on the meta device (shapes, no weights), the adapters are created
exactly as the engine creates them, and the optimizer state is taken as AdamW's two float32
moments per adapter tensor (what the measured rows show). The base is counted in bfloat16,
the dtype the loader uses on CUDA.

Then, the shared pass (the memory half of the multi-LoRA benchmark; bench/multilora.py measures
its throughput): --sessions sessions of the first rank, after one shared forward-backward of
--batch samples of --seq-tokens tokens each (engine.forward_backward_batch, as the scheduler
batches them) and one optim-step each; the sum over every tensor the engine holds for the
resource (base parameters and buffers, every adapter, optimizer state, any gradient) against
the bound base + sessions x (adapter + optimizer state) + 20%. Process RSS growth over the
same steps is printed beside it, read after malloc_trim so freed activation memory does not
count (it still holds allocator and autograd bookkeeping, so it is an upper bound on the
sessions' footprint).

Every count comes from the engine's public read-only methods (session_footprint,
resource_footprint; engine/memory/footprint.py).

    python bench/session_memory.py [--ranks 8 32] [--sessions 8] [--model PATH] [--device cpu]
                                   [--batch 4] [--seq-tokens 128] [--project config.json]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import random
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from posttrain.config import BUILTIN_MODEL_DIR, EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.memory.footprint import SessionFootprint, nbytes
from posttrain.model.lora import AdapterSpec, LoraModel
from posttrain.types import (
    AdamParams,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    OptimStepRequest,
    TrainingSample,
)

MODEL_ID = "bench-model"
RESOURCE = "mr-bench"
SAMPLE = TrainingSample(
    tokens=(1, 2, 3, 4, 5, 6, 7),
    loss_fn_inputs={"target_tokens": (2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0), "weights": (1.0,) * 7},
)
CE = LossConfig(LossType.CROSS_ENTROPY)
STEP = OptimStepRequest(adam=AdamParams(learning_rate=1e-3))
MIB = 1 << 20


def session_bytes(engine: LocalEngine, session_id: str) -> SessionFootprint:
    """Per-session bytes after one forward-backward (gradients) and one optim-step (the rest)."""
    request = ForwardBackwardRequest((SAMPLE,), CE)
    (outcome,) = engine.forward_backward_batch(RESOURCE, [(session_id, request)])
    assert not isinstance(outcome, Exception), outcome
    gradients = engine.session_footprint(RESOURCE, session_id).gradient_bytes
    engine.optim_step(RESOURCE, session_id, STEP)
    after = engine.session_footprint(RESOURCE, session_id)
    return SessionFootprint(
        after.weights_bytes, after.generator_bytes, after.optimizer_bytes, gradients
    )


def measure(model_dir: Path, device: str, ranks: list[int], num_sessions: int) -> None:
    engine = LocalEngine(EngineConfig(device=device), {MODEL_ID: model_dir})
    engine.load_resource(RESOURCE, MODEL_ID, muon_scaling=None)
    base = engine.resource_footprint(RESOURCE).base_bytes
    print(f"model {model_dir} on {device}: base weights {base / MIB:.3f} MiB ({base} bytes)")
    header = f"{'session':<16}{'weights':>12}{'generator':>12}{'optimizer':>12}"
    print(f"{header}{'resident':>12}{'/ base':>9}{'+ grads':>12}")
    for rank in ranks:
        ids = [f"ts-r{rank}-{i}" for i in range(num_sessions)]
        for index, session_id in enumerate(ids):
            engine.create_session(RESOURCE, session_id, LoraConfig(rank=rank, seed=index))
        measured = [session_bytes(engine, session_id) for session_id in ids]
        assert all(m == measured[0] for m in measured), "sessions of one rank differ in size"
        report(f"LoRA rank {rank}", measured[0], base)
        total = sum(m.resident_bytes for m in measured)
        print(
            f"  {num_sessions} sessions: {total / MIB:.3f} MiB beside the base"
            f" ({total / base:.3f} x base)"
        )
        for session_id in ids:
            engine.drop_session(RESOURCE, session_id)
    engine.create_session(RESOURCE, "ts-full", None)
    report("full weights", session_bytes(engine, "ts-full"), base)
    engine.drop_session(RESOURCE, "ts-full")


def project(config_path: Path, ranks: list[int]) -> None:
    """Bytes per LoRA session for a model built from config.json on the meta device."""
    config = AutoConfig.from_pretrained(config_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    base = sum(p.numel() for p in model.parameters()) * torch.bfloat16.itemsize
    lora = LoraModel(model)
    print(f"projection for {config_path}: base weights {base / MIB:.1f} MiB in bfloat16")
    for rank in ranks:
        named = lora.add_adapter(f"r{rank}", AdapterSpec(rank, 2 * rank, 0.0, 0, True))
        weights = nbytes(p for _, p in named)
        report(f"LoRA rank {rank}", SessionFootprint(weights, weights, 2 * weights, weights), base)


def report(name: str, parts: SessionFootprint, base: int) -> None:
    weights, generator = parts.weights_bytes / MIB, parts.generator_bytes / MIB
    optimizer, gradients = parts.optimizer_bytes / MIB, parts.gradient_bytes / MIB
    resident = parts.resident_bytes
    print(
        f"{name:<16}{weights:>11.3f}M{generator:>11.3f}M{optimizer:>11.3f}M"
        f"{resident / MIB:>11.3f}M{resident / base:>9.3f}{gradients:>11.3f}M"
    )


# ------------------------------------------------------------------ the shared pass


def rss_bytes() -> int:
    """Resident set size after garbage collection and, on glibc, returning freed heap pages
    (without that, activations freed after a step stay resident and hide the trend)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def training_batch(
    seed: int, vocab: int, batch: int, seq_tokens: int
) -> tuple[TrainingSample, ...]:
    """`batch` cross-entropy samples of `seq_tokens` random input tokens, every target weighted
    1 (tokens from 3 up: past the built-in vocabulary's special tokens)."""
    rng = random.Random(1000 + seed)
    samples = []
    for _ in range(batch):
        tokens = [rng.randrange(3, vocab) for _ in range(seq_tokens + 1)]
        inputs = {"target_tokens": tuple(map(float, tokens[1:])), "weights": (1.0,) * seq_tokens}
        samples.append(TrainingSample(tuple(tokens[:-1]), inputs))
    return tuple(samples)


def shared_pass(
    model_dir: Path, device: str, rank: int, num_sessions: int, batch: int, seq_tokens: int
) -> None:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    transformers.utils.logging.disable_progress_bar()
    engine = LocalEngine(EngineConfig(device=device), {MODEL_ID: model_dir})
    rss_start = rss_bytes()
    engine.load_resource(RESOURCE, MODEL_ID, muon_scaling=None)
    base = engine.resource_footprint(RESOURCE).base_bytes
    rss_base = rss_bytes()
    ids = [f"ts-{i}" for i in range(num_sessions)]
    for index, session_id in enumerate(ids):
        engine.create_session(RESOURCE, session_id, LoraConfig(rank=rank, seed=index))
    requests = [
        (session_id, ForwardBackwardRequest(training_batch(index, vocab, batch, seq_tokens), CE))
        for index, session_id in enumerate(ids)
    ]
    step = OptimStepRequest(adam=AdamParams(learning_rate=1e-4))

    def train_step() -> None:
        outcomes = engine.forward_backward_batch(RESOURCE, requests)
        assert not any(isinstance(o, Exception) for o in outcomes), outcomes
        for session_id in ids:
            engine.optim_step(RESOURCE, session_id, step)

    train_step()
    rss_one = rss_bytes()
    for _ in range(3):
        train_step()
    rss_four = rss_bytes()

    parts = [engine.session_footprint(RESOURCE, session_id) for session_id in ids]
    adapter = sum(p.weights_bytes for p in parts)
    generator = sum(p.generator_bytes for p in parts)
    optimizer = sum(p.optimizer_bytes for p in parts)
    total = engine.resource_footprint(RESOURCE).total_bytes
    n = num_sessions
    print(f"shared pass, {n} sessions of LoRA rank {rank} after an optim-step each:")
    print(f"  base model weights          {base / MIB:9.3f} MiB")
    print(f"  per session: adapter        {adapter / n / MIB:9.3f} MiB")
    print(f"               generator copy {generator / n / MIB:9.3f} MiB (weights-sync's target)")
    print(f"               AdamW state    {optimizer / n / MIB:9.3f} MiB")
    print(f"  all engine tensors          {total / MIB:9.3f} MiB (base, buffers, adapters, state)")
    # adapter, generator and optimizer are totals over the n sessions.
    strict = base + (adapter + optimizer) * 1.2
    loose = (base + adapter + optimizer) * 1.2
    with_copy = base + (adapter + generator + optimizer) * 1.2
    for label, bound in (
        ("base + n x (adapter + AdamW) x 1.2", strict),
        ("(base + n x (adapter + AdamW)) x 1.2", loose),
        ("base + n x (adapter + copy + AdamW) x 1.2", with_copy),
    ):
        verdict = "within" if total <= bound else "OVER"
        print(f"  bound {label:<42}{bound / MIB:9.3f} MiB: {verdict} ({total / bound:.3f} of it)")
    print(
        f"  process RSS: +{(rss_base - rss_start) / MIB:.1f} MiB loading the model,"
        f" +{(rss_one - rss_base) / MIB:.1f} MiB for {n} sessions and their first step"
        f" (after malloc_trim), +{(rss_four - rss_one) / MIB:.1f} MiB over 3 more steps"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--sessions", type=int, default=8, help="sessions per rank at once")
    parser.add_argument("--model", type=Path, default=BUILTIN_MODEL_DIR, help="HF model dir")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=4, help="samples per session, shared pass")
    parser.add_argument("--seq-tokens", type=int, default=128, help="tokens per sample, ditto")
    parser.add_argument("--project", type=Path, default=None, help="config.json to project")
    args = parser.parse_args()
    torch.manual_seed(0)
    measure(args.model, args.device, args.ranks, args.sessions)
    print()
    shared_pass(args.model, args.device, args.ranks[0], args.sessions, args.batch, args.seq_tokens)
    if args.project is not None:
        project(args.project, args.ranks)


if __name__ == "__main__":
    main()
