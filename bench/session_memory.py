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

    python bench/session_memory.py [--ranks 8 32] [--sessions 8] [--model PATH] [--device cpu]
                                   [--project config.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM

from posttrain.config import BUILTIN_MODEL_DIR, EngineConfig
from posttrain.engine.local import LocalEngine
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


def nbytes(tensors: list[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_tensors(state: object) -> list[Tensor]:
    """Every tensor inside a (nested) optimizer state_dict."""
    if isinstance(state, Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in state_tensors(value)]
    return []


def session_bytes(engine: LocalEngine, session_id: str) -> dict[str, int]:
    """Per-session bytes: trainable weights, generator copy, optimizer state, gradients."""
    resource, session = engine._session(RESOURCE, session_id)
    params = [p for _, p in session.optimizer.named_params]
    engine.forward_backward(RESOURCE, session_id, ForwardBackwardRequest((SAMPLE,), CE))
    gradients = nbytes([p.grad for p in params if p.grad is not None])
    engine.optim_step(RESOURCE, session_id, STEP)
    if session.generator_model is not None:
        generator = nbytes(list(session.generator_model.parameters()))
    else:
        generator = nbytes([p for _, p in resource.lora.adapter_parameters(session.generator_key)])
    return {
        "weights": nbytes(params),
        "generator": generator,
        "optimizer": nbytes(state_tensors(session.optimizer.state_dict())),
        "gradients": gradients,
    }


def resident(parts: dict[str, int]) -> int:
    """What a session holds between steps (gradients are transient)."""
    return parts["weights"] + parts["generator"] + parts["optimizer"]


def measure(model_dir: Path, device: str, ranks: list[int], num_sessions: int) -> None:
    engine = LocalEngine(EngineConfig(device=device), {MODEL_ID: model_dir})
    engine.load_resource(RESOURCE, MODEL_ID, muon_scaling=None)
    base = nbytes(list(engine._resource(RESOURCE).loaded.model.parameters()))
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
        total = sum(resident(m) for m in measured)
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
        weights = nbytes([p for _, p in named])
        parts = {"weights": weights, "generator": weights, "optimizer": 2 * weights}
        report(f"LoRA rank {rank}", {**parts, "gradients": weights}, base)


def report(name: str, parts: dict[str, int], base: int) -> None:
    mib = {key: value / MIB for key, value in parts.items()}
    print(
        f"{name:<16}{mib['weights']:>11.3f}M{mib['generator']:>11.3f}M{mib['optimizer']:>11.3f}M"
        f"{resident(parts) / MIB:>11.3f}M{resident(parts) / base:>9.3f}{mib['gradients']:>11.3f}M"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--sessions", type=int, default=8, help="sessions per rank at once")
    parser.add_argument("--model", type=Path, default=BUILTIN_MODEL_DIR, help="HF model dir")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--project", type=Path, default=None, help="config.json to project")
    args = parser.parse_args()
    torch.manual_seed(0)
    measure(args.model, args.device, args.ranks, args.sessions)
    if args.project is not None:
        project(args.project, args.ranks)


if __name__ == "__main__":
    main()
