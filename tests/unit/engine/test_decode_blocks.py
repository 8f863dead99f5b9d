"""Decoding in blocks of K passes with one host read per block (engine/generate/sampler.py) returns
byte for byte what the per-token path (K = 1) returns: every token, logprob, stop reason and
policy segment, for greedy, plain and shaped sampling, stop strings and tokens, max_tokens in
the middle of a block, rows ending at different steps, shared prompts with several samples,
several adapters in one pass, a family with sliding windows and another with soft-capping,
and MoE routes. Rows that stop inside a block compute a few passes more, whose tokens are
dropped; their random streams are their own, so nothing else changes."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.generate import sampler
from posttrain.engine.generate.decode_graph import DecodeStep
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.types import LoraConfig, SampleRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).parent.parent / "model"))
import families  # noqa: E402

# (passes per block, static passes): (1, False) is the per-token path every other way must
# reproduce. The prefix cache is off: a cached prompt runs a shorter prefill, whose logits may
# differ in the last bits.
WAYS = ((1, False), (3, False), (8, False), (1, True), (8, True))


def engine_for(models: dict[str, Path], model_id: str) -> LocalEngine:
    engine = LocalEngine(
        EngineConfig(device="cpu", logprob_chunk_tokens=5, prefix_cache_mib=0), models
    )
    engine.load_resource("r", model_id, muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=4, alpha=8, seed=1))
    engine.create_session("r", "t", LoraConfig(rank=4, alpha=8, seed=2))
    return engine


def run_blocks(
    engine, monkeypatch, items, *, static_runs: bool = True
) -> dict[tuple[int, bool], list]:
    """The sample_batch results of `items` per way of decoding (the CPU defaults switched).
    `static_runs`: whether the model is one static passes serve (else they fall back)."""
    results = {}
    passes = []
    run = DecodeStep.run
    monkeypatch.setattr(DecodeStep, "run", lambda step, u: (passes.append(1), run(step, u)))
    for steps, static in WAYS:
        monkeypatch.setattr(sampler, "CPU_BLOCK_STEPS", steps)
        monkeypatch.setattr(sampler, "CPU_STATIC_DECODE", static)
        passes.clear()
        results[steps, static] = engine.sample_batch("r", items)
        assert bool(passes) == (static and static_runs), (steps, static)
    return results


def assert_identical(results: dict[tuple[int, bool], list], *, exact: bool = False) -> None:
    """The same tokens, stop reasons and segments as the per-token path; logprobs byte-identical
    when `exact` (blocks of dynamic passes), else equal up to float32 rounding. Why not always
    exact: a matrix product's rows depend in their last bits on how many rows it has (CPU and
    GPU BLAS pick kernels by size; on this CPU 1-3, 5-7 and 9-11 rows differ from 16), and the
    per-token path drops a finished row at once while a block keeps it to the block's end.
    With no row ending inside a block, both run the same shapes and agree byte for byte.
    Static passes also attend over the whole own capacity (the masked columns change the
    fused kernel's blocking), so they agree up to rounding only."""
    reference = results[1, False]
    for (steps, static), got in results.items():
        for ours, theirs in zip(got, reference, strict=True):
            assert len(ours) == len(theirs)
            for a, b in zip(ours, theirs, strict=True):
                assert a.policy_segments == b.policy_segments
                for x, y in zip(a.sequences, b.sequences, strict=True):
                    assert x.tokens == y.tokens, steps
                    assert x.stop_reason == y.stop_reason, steps
                    if exact and not static:
                        assert x.logprobs == y.logprobs, steps
                    else:
                        torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


def mixed_items(encode) -> list[tuple[str, SampleRequest]]:
    """Rows of two adapters ending at many different steps, inside blocks and on their edges."""
    return [
        ("s", SampleRequest((encode("12+34="),), 3, SamplingParams(max_tokens=5, seed=1))),
        (
            "t",
            SampleRequest(
                (encode("reverse ab:"),),
                4,
                SamplingParams(max_tokens=11, temperature=0.8, stop=("a",), seed=2),
            ),
        ),
        (
            "s",
            SampleRequest(
                (encode("1 2 3"), encode("hello")),
                2,
                SamplingParams(max_tokens=20, temperature=0.7, top_k=20, top_p=0.9, seed=3),
            ),
        ),
        (
            "t",
            SampleRequest(
                (encode("reverse reverse reverse"),),
                2,
                SamplingParams(max_tokens=13, temperature=0.0),
            ),
        ),
        (
            "s",
            SampleRequest(
                (encode("7+8="),),
                3,
                SamplingParams(max_tokens=17, temperature=1.3, top_p=0.5, seed=9),
            ),
        ),
    ]


@pytest.fixture(scope="module")
def builtin() -> LocalEngine:
    return engine_for({BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}, BUILTIN_MODEL_ID)


def test_blocks_of_mixed_rows_and_two_adapters_equal_the_per_token_path(builtin, monkeypatch):
    tokenizer = builtin._resource("r").loaded.tokenizer

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    results = run_blocks(builtin, monkeypatch, mixed_items(encode))
    lengths = {len(s.tokens) for per_op in results[1, False] for r in per_op for s in r.sequences}
    assert len(lengths) >= 5, lengths  # rows really ended at different steps
    assert_identical(results)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=19, temperature=0.0),
        SamplingParams(max_tokens=19, temperature=1.0, seed=4),
        SamplingParams(max_tokens=19, temperature=0.9, top_k=5, seed=5),
        SamplingParams(max_tokens=19, temperature=1.1, top_p=0.8, seed=6),
        SamplingParams(max_tokens=19, temperature=1.0, stop=(" ",), seed=7),
    ],
    ids=["greedy", "plain", "top-k", "top-p", "stop-string"],
)
def test_blocks_of_one_kind_equal_the_per_token_path(builtin, monkeypatch, params):
    prompts = ((5, 6, 7), (9, 10, 11, 12))
    items = [("s", SampleRequest(prompts, 4, params)), ("t", SampleRequest(prompts[:1], 2, params))]
    assert_identical(run_blocks(builtin, monkeypatch, items))


def test_rows_that_all_run_to_max_tokens_are_byte_identical(builtin, monkeypatch):
    # max_tokens 19 = the first token and 18 passes: blocks of 3 end together with the rows,
    # blocks of 8 run 8, 8 and a shortened 2. No row leaves early, so the shapes match.
    params = SamplingParams(max_tokens=19, temperature=1.0, seed=11)
    items = [
        ("s", SampleRequest(((20, 21, 22),), 4, params)),
        ("t", SampleRequest(((30,),), 3, params)),
    ]
    results = run_blocks(builtin, monkeypatch, items)
    lengths = {len(s.tokens) for per_op in results[1, False] for r in per_op for s in r.sequences}
    assert lengths == {19}, lengths  # no EOS: every row ran its max_tokens
    assert_identical(results, exact=True)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "llama"])
def test_blocks_equal_the_per_token_path_on_other_families(tmp_path, monkeypatch, family):
    directory = families.build(family, tmp_path / family)
    engine = engine_for({"m": directory}, "m")
    items = [
        ("s", SampleRequest(((1, 40, 41, 42, 50, 60),), 3, SamplingParams(max_tokens=10, seed=1))),
        (
            "t",
            SampleRequest(
                ((1, 33, 34, 35, 36, 90, 91),),
                2,
                SamplingParams(max_tokens=14, temperature=0.6, top_k=7, seed=2),
            ),
        ),
    ]
    # Sliding windows (Mistral) and eager attention (Gemma 2) fall back to dynamic passes.
    static_runs = family == "llama"
    assert_identical(run_blocks(engine, monkeypatch, items, static_runs=static_runs))


def test_moe_routes_of_blocks_equal_the_per_token_path(tmp_path, monkeypatch):
    directory = families.build("olmoe", tmp_path / "olmoe")
    engine = engine_for({"m": directory}, "m")
    params = SamplingParams(max_tokens=11, temperature=1.0, seed=3)
    items = [
        ("s", SampleRequest(((1, 40, 41, 42),), 3, params, return_routed_experts=True)),
        ("t", SampleRequest(((1, 50, 51),), 2, SamplingParams(max_tokens=6, seed=4))),
    ]
    results = run_blocks(engine, monkeypatch, items, static_runs=False)  # MoE: dynamic passes
    assert_identical(results)
    for steps, got in results.items():
        for a, b in zip(got[0][0].sequences, results[1, False][0][0].sequences, strict=True):
            assert a.routed_experts is not None, steps
            assert a.routed_experts == b.routed_experts, steps


class _Trace(TorchDispatchMode):
    """The operations a pass dispatches, with the shapes of their tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        self.ops.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


def test_every_static_pass_of_a_layout_runs_the_same_operations_on_the_same_shapes(
    builtin, monkeypatch
):
    """What a CUDA graph needs, checked on the CPU: within one layout every pass dispatches
    the same operations on the same shapes (so one capture serves them all) and reads
    nothing back to the host."""
    monkeypatch.setattr(sampler, "CPU_BLOCK_STEPS", 8)
    monkeypatch.setattr(sampler, "CPU_STATIC_DECODE", True)
    traces: dict[int, list[list[tuple]]] = {}
    steps: list[DecodeStep] = []  # kept alive: a collected step's id could name a later one
    run_pass = DecodeStep._pass

    def traced(step) -> None:
        with _Trace() as trace:
            run_pass(step)
        if id(step) not in traces:
            steps.append(step)
        traces.setdefault(id(step), []).append(trace.ops)

    monkeypatch.setattr(DecodeStep, "_pass", traced)
    tokenizer = builtin._resource("r").loaded.tokenizer

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    builtin.sample_batch("r", mixed_items(encode))
    assert len(traces) >= 2  # rows ended: the batch changed layout at least once
    assert max(map(len, traces.values())) >= 8  # a layout served a whole block of passes
    for passes in traces.values():
        assert len(passes[0]) > 100  # the whole forward, head and draw
        assert all(ops == passes[0] for ops in passes)
        assert not any("_local_scalar_dense" in name for name, _ in passes[0])


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_publish_between_blocks_switches_at_the_block_edge(builtin, monkeypatch, static):
    """PIPELINE weights-syncs land between blocks: the 2nd boundary comes after 1 + K tokens,
    and the tokens after it are what the new weights give (the row's KV recomputed)."""
    monkeypatch.setattr(sampler, "CPU_BLOCK_STEPS", 4)
    monkeypatch.setattr(sampler, "CPU_STATIC_DECODE", static)
    version = 7 + static  # the engine is the module's: each case publishes a new version
    calls = []

    def publish_on_the_second_boundary() -> None:
        calls.append(1)
        if len(calls) == 2:
            builtin.publish("r", "s", version=version)

    params = SamplingParams(max_tokens=12, temperature=0.0)
    ((result,),) = builtin.sample_batch(
        "r",
        [("s", SampleRequest(((5, 6, 7),), 2, params))],
        between_tokens=publish_on_the_second_boundary,
    )
    assert [(p.start_token, p.version) for p in result.policy_segments][-1] == (5, version)
    assert len(calls) == 3  # blocks of 4, 4 and 3 passes after the first token
    # The publish served the same weights, so the greedy tokens are those of no publish.
    ((plain,),) = builtin.sample_batch("r", [("s", SampleRequest(((5, 6, 7),), 2, params))])
    for ours, theirs in zip(result.sequences, plain.sequences, strict=True):
        assert ours.tokens == theirs.tokens
        torch.testing.assert_close(ours.logprobs, theirs.logprobs, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_equals_the_eager_static_passes(monkeypatch):
    """On CUDA: the same static passes replayed from captured graphs give byte-identical
    tokens and logprobs to running them eagerly, and match the per-token path."""
    engine = LocalEngine(
        EngineConfig(device="cuda", dtype="float32", logprob_chunk_tokens=5, prefix_cache_mib=0),
        {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR},
    )
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=4, alpha=8, seed=1))
    engine.create_session("r", "t", LoraConfig(rank=4, alpha=8, seed=2))
    tokenizer = engine._resource("r").loaded.tokenizer

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    captured = []
    capture = DecodeStep._captured
    monkeypatch.setattr(
        DecodeStep, "_captured", lambda step: captured.append(capture(step)) or captured[-1]
    )
    results = {}
    for way, (steps, static, graphs) in {
        "per-token": (1, False, False),
        "eager static": (8, True, False),
        "graphs": (8, True, True),
    }.items():
        monkeypatch.setattr(sampler, "DECODE_BLOCK_STEPS", steps)
        monkeypatch.setattr(sampler, "STATIC_DECODE", static)
        monkeypatch.setattr(sampler, "CUDA_GRAPHS", graphs)
        results[way] = engine.sample_batch("r", mixed_items(encode))
    assert captured and all(graph is not None for graph in captured)
    for ours, eager, reference in zip(
        results["graphs"], results["eager static"], results["per-token"], strict=True
    ):
        for a, b, c in zip(ours, eager, reference, strict=True):
            for x, y, z in zip(a.sequences, b.sequences, c.sequences, strict=True):
                assert x.tokens == y.tokens and x.logprobs == y.logprobs
                assert x.tokens == z.tokens
                torch.testing.assert_close(x.logprobs, z.logprobs, atol=1e-4, rtol=0)


def test_cuda_graphs_setting_reaches_the_sampler_and_picks_static_passes_off_the_cpu(
    monkeypatch,
):
    """EngineConfig.cuda_graphs (on by default, `--cuda-graphs off`) travels to the sampler's
    model, where it picks static passes (captured in graphs) on CUDA and changes nothing on
    the CPU."""
    from posttrain.engine.generate import generator

    engine = LocalEngine(
        EngineConfig(device="cpu", dtype="float32", cuda_graphs=True, prefix_cache_mib=0),
        {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR},
    )
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=4, alpha=8, seed=1))
    seen = []
    generate = generator.generate
    monkeypatch.setattr(
        generator, "generate", lambda gm, *a, **k: seen.append(gm) or generate(gm, *a, **k)
    )
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=3)
    engine.sample_batch("r", [("s", SampleRequest(((5, 6, 7),), 2, params))])
    (gm,) = seen
    assert gm.cuda_graphs
    assert sampler.use_static_passes(gm, torch.device("cuda"))
    assert not sampler.use_static_passes(gm, torch.device("cpu"))  # CPU_STATIC_DECODE only
    off = dataclasses.replace(gm, cuda_graphs=False)
    assert not sampler.use_static_passes(off, torch.device("cuda"))  # --cuda-graphs off
