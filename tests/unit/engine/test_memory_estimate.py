"""The memory estimate (engine/memory/estimate.py) against what the engine really allocates.

Two measurements, both of the real engine: the bytes autograd saves for backward during a
forward-backward (saved_tensors_hooks, each storage once, the model's own weights excluded),
and the peak resident set a pass adds, measured in a fresh subprocess (the kernel's resident
high-water mark, reset just before the pass, less the resident set then; torch's CPU
allocator keeps no statistics). The rule the
estimate keeps: never below the measured peak, and at most MAX_OVERESTIMATE times it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent.parent / "model"))
import families  # noqa: E402

from posttrain.config import BUILTIN_MODEL_DIR, EngineConfig  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.engine.memory import estimate  # noqa: E402
from posttrain.types import (  # noqa: E402
    AdamParams,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    OperationKind,
    OptimStepRequest,
    SampleRequest,
    SamplingParams,
    TrainingSample,
)

MAX_OVERESTIMATE = 2.5
# A model big enough that a pass's activations dwarf allocator noise, small enough for a CPU.
MLP_HEAVY = {"hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4}
ATTENTION_HEAVY = {"hidden_size": 192, "intermediate_size": 256, "num_attention_heads": 8}
COMMON = {"num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 4096}
CE = LossConfig(LossType.CROSS_ENTROPY)
# DeepSeek-V3's multi-head latent attention with its attention wide enough to dominate a layer:
# 16 heads of 96-wide queries and keys and 64-wide values, expanded from 64 + 32 latent numbers
# a position (its cache's), the queries from a 128-wide latent.
LATENT_ATTENTION = {
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
}
LATENT_SIZE = families.Size(hidden_size=256, num_hidden_layers=2, max_position_embeddings=4096)


def build_model(directory: Path, overrides: dict[str, int]) -> Path:
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(BUILTIN_MODEL_DIR)
    for key, value in {**COMMON, **overrides}.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config)
    # EOS logits 0 while the other tokens' greedy maximum is positive: rows run to max_tokens,
    # the sample estimate's worst case.
    eos = {config.eos_token_id, AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR).eos_token_id}
    with torch.no_grad():
        model.get_output_embeddings().weight[sorted(eos)] = 0.0
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(BUILTIN_MODEL_DIR / name, directory / name)
    return directory


def batch(rows: int, tokens: int) -> tuple[TrainingSample, ...]:
    targets = tuple(float(4 + t % 90) for t in range(tokens))
    sample = TrainingSample(
        tuple(3 + t % 90 for t in range(tokens)),
        {"target_tokens": targets, "weights": (1.0,) * tokens},
    )
    return (sample,) * rows


def engine_over(directory: Path, checkpointing: str = "auto") -> LocalEngine:
    config = EngineConfig(device="cpu", activation_checkpointing=checkpointing)
    engine = LocalEngine(config, {"m": directory})
    engine.load_resource("r", "m", muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=8, seed=1))
    return engine


@pytest.mark.parametrize("overrides", [MLP_HEAVY, ATTENTION_HEAVY], ids=["mlp", "attention"])
def test_saved_activations_are_counted_by_the_per_layer_model(tmp_path, overrides):
    engine = engine_over(build_model(tmp_path, overrides))
    loaded = engine._resource("r").loaded
    model = loaded.model
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    rows, tokens = 4, 512
    request = ForwardBackwardRequest(batch(rows, tokens), CE)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        (outcome,) = engine.forward_backward_batch("r", [("s", request)])
    assert not isinstance(outcome, Exception)
    shape = estimate.model_shape(model.config, loaded.kv, 4)
    counted = estimate.saved_activation_bytes(shape, rows * tokens)
    measured = sum(saved.values())
    assert measured <= counted <= 1.6 * measured, (measured, counted)


MEASURE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from test_memory_estimate import batch, engine_over, CE
    from posttrain.types import *

    engine = engine_over(Path({directory!r}), {checkpointing!r})
    kind, rows, tokens = {kind!r}, {rows}, {tokens}
    if kind == "forward-backward":
        def request(rows, tokens):
            return ForwardBackwardRequest(batch(rows, tokens), CE, forward_only={forward_only})
        run = lambda r: engine.forward_backward_batch("r", [("s", r)])
    else:
        def request(rows, tokens):
            params = SamplingParams(max_tokens=tokens, temperature=0.0)
            return SampleRequest(((5, 6, 7, 8),), num_samples=rows, sampling_params=params)
        run = lambda r: engine.sample_batch("r", [("s", r)])
    run(request(1, 4))  # warm up: first-call allocations are not the pass's
    big = request(rows, tokens)
    estimated = engine.peak_bytes("r", OperationKind(kind), [("s", big)])
    def status_bytes(field):
        line = next(x for x in Path("/proc/self/status").read_text().splitlines()
                    if x.startswith(field + ":"))
        return int(line.split()[1]) * 1024
    # Reset the resident high-water mark to now (clear_refs 5), so an earlier peak (loading
    # the model, the warm-up) cannot count as the pass's.
    Path("/proc/self/clear_refs").write_text("5")
    before = status_bytes("VmRSS")
    (outcome,) = run(big)
    peak = status_bytes("VmHWM")
    lengths = [len(q.tokens) for q in outcome[0].sequences] if kind == "sample" else []
    print(json.dumps({{"added": peak - before, "estimated": estimated, "lengths": lengths}}))
    """
)


def measure(
    directory: Path, kind: str, rows: int, tokens: int, *, forward_only=False, checkpointing="auto"
) -> dict:
    script = MEASURE.format(
        tests=str(Path(__file__).parent),
        directory=str(directory),
        kind=kind,
        rows=rows,
        tokens=tokens,
        forward_only=forward_only,
        checkpointing=checkpointing,
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("overrides", "rows", "tokens", "forward_only", "checkpointing"),
    [
        (MLP_HEAVY, 8, 512, False, "off"),
        (ATTENTION_HEAVY, 4, 1024, False, "off"),
        (MLP_HEAVY, 16, 1024, True, "off"),
        (MLP_HEAVY, 8, 1024, False, "on"),
    ],
    ids=["mlp", "attention", "forward-only", "checkpointed"],
)
def test_forward_backward_estimate_bounds_the_measured_peak(
    tmp_path, overrides, rows, tokens, forward_only, checkpointing
):
    directory = build_model(tmp_path / "model", overrides)
    # The larger of two fresh measurements: a pass whose pages happen to be resident already
    # reads low (a CI run measured 0.81x of the usual for the forward-only case), and the
    # larger is also the stricter for `added <= estimated`.
    results = [
        measure(
            directory,
            "forward-backward",
            rows,
            tokens,
            forward_only=forward_only,
            checkpointing=checkpointing,
        )
        for _ in range(2)
    ]
    result = max(results, key=lambda r: r["added"])
    added, estimated = result["added"], result["estimated"]
    assert added <= estimated <= MAX_OVERESTIMATE * added, results


def test_latent_attention_estimate_bounds_the_measured_peak(tmp_path):
    # Its training activations are the expanded heads' and the latents', not the cache's
    # widths; on a CPU, with unfused attention's scores (keys and values differ in width).
    directory = families.build(
        "deepseek_v3", tmp_path / "model", size=LATENT_SIZE, extra=LATENT_ATTENTION
    )
    results = [
        measure(directory, "forward-backward", 4, 512, checkpointing="off") for _ in range(2)
    ]
    result = max(results, key=lambda r: r["added"])
    added, estimated = result["added"], result["estimated"]
    assert added <= estimated <= MAX_OVERESTIMATE * added, results


def test_latent_attention_caches_its_latent_per_token(tmp_path):
    loaded = families.load("deepseek_v3", tmp_path / "model")
    config = loaded.model.config
    shape = estimate.model_shape(config, loaded.kv, 2)
    # What a training pass expands: every head's query and key, qk_nope + qk_rope wide.
    heads, key_dim = config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim
    assert shape.query_width == heads * key_dim
    request = SampleRequest(((1,) * 10,), num_samples=3, sampling_params=SamplingParams(200))
    none = SampleRequest(((1,) * 10,), num_samples=3, sampling_params=SamplingParams(1))
    grown = estimate.sample_bytes(shape, [request], chunk_tokens=1024)
    base = estimate.sample_bytes(shape, [none], chunk_tokens=1024)
    # A position costs the latent: (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes
    # (an even width here: no padding), counted as test_kv_cache_term_is_the_formula_of_the_brief.
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    assert latent % 2 == 0
    per_position = latent * config.num_hidden_layers * 2
    python = 3 * 199 * estimate.PYTHON_BYTES_PER_GENERATED_TOKEN
    assert grown - base == 2 * 3 * 199 * per_position + python


def test_sample_estimate_bounds_the_measured_peak_of_its_kv_cache(tmp_path):
    directory = build_model(tmp_path / "model", ATTENTION_HEAVY)
    rows, tokens = 48, 300
    result = measure(directory, "sample", rows, tokens)
    # Greedy rows of this model never meet EOS (build_model): every row reaches max_tokens, so
    # the comparison is with the pass the estimate describes.
    assert result["lengths"] == [tokens] * rows
    added, estimated = result["added"], result["estimated"]
    assert added <= estimated <= MAX_OVERESTIMATE * added, result


def test_kv_cache_term_is_the_formula_of_the_brief():
    shape = estimate.ModelShape(
        layers=4, hidden=128, query_width=128, kv_width=64, ffn_width=384, vocab=99, dtype_bytes=2
    )
    request = SampleRequest(((1,) * 10,), num_samples=3, sampling_params=SamplingParams(200))
    none = SampleRequest(((1,) * 10,), num_samples=3, sampling_params=SamplingParams(1))
    grown = estimate.sample_bytes(shape, [request], chunk_tokens=1024)
    base = estimate.sample_bytes(shape, [none], chunk_tokens=1024)
    # 3 rows x 199 more positions x 4 layers x 2 x 64 x 2 bytes, twice (the cache's growth
    # or compaction copy), plus their tokens' Python objects.
    per_position = 4 * 2 * 64 * 2
    python = 3 * 199 * estimate.PYTHON_BYTES_PER_GENERATED_TOKEN
    assert grown - base == 2 * 3 * 199 * per_position + python


def test_optimizer_moments_count_at_the_first_step_only(tmp_path):
    engine = engine_over(build_model(tmp_path, MLP_HEAVY))
    sample = ForwardBackwardRequest(batch(1, 8), CE)
    step = OptimStepRequest(adam=AdamParams(learning_rate=1e-3))
    kind = OperationKind.OPTIM_STEP
    engine.forward_backward_batch("r", [("s", sample)])
    first = engine.peak_bytes("r", kind, [("s", step)])
    engine.optim_step("r", "s", step)
    moments = engine.session_footprint("r", "s").optimizer_bytes
    engine.forward_backward_batch("r", [("s", sample)])
    later = engine.peak_bytes("r", kind, [("s", step)])
    # The estimate's moments are what the step then holds, up to AdamW's step counters.
    assert 0 <= moments - (first - later) < 4096


def test_peak_bytes_grows_with_the_batch(tmp_path):
    engine = engine_over(build_model(tmp_path, MLP_HEAVY))
    small = ForwardBackwardRequest(batch(2, 64), CE)
    large = ForwardBackwardRequest(batch(4, 64), CE)
    kind = OperationKind.FORWARD_BACKWARD
    small_bytes = engine.peak_bytes("r", kind, [("s", small)])
    large_bytes = engine.peak_bytes("r", kind, [("s", large)])
    assert small_bytes < large_bytes < 2 * small_bytes + 4 * 1024 * 1024
