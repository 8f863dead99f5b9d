"""Prompts joining a running dynamic decode batch run inside the block's first decode pass
(engine/generate/joining_pass.py, model/joining_pass_cache.py): no prefill pass of their own,
and every request still gets what it gets alone (tokens, stop reasons, policy segments;
logprobs within 1e-5), on every decoder family whose attention is sdpa's; joins that need a
prefill apart (prompt logprobs, eager attention) take one. A publish between the admit and the
pass serves the join wholly on the new weights. A stream counts the admitted rows as running
and their rows as taken from its pool before they enter its cache. Built-in model and small
random-init families, CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_stream_joins import assert_same, engine_for, generator_of, request, run
from torch.utils._python_dispatch import TorchDispatchMode

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.generate import joining_pass, sampler
from posttrain.engine.generate.sample_stream import SampleStream
from posttrain.engine.generate.sampler import GenerationRequest
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.types import LoraConfig, PolicySegment, SampleRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).parent.parent / "model"))
import families  # noqa: E402


@pytest.fixture(scope="module")
def engine() -> LocalEngine:
    return engine_for({BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}, BUILTIN_MODEL_ID)


def longest() -> GenerationRequest:
    """The request that outlives every join: the generation's passes are its 29 decode passes
    plus the prefill passes, whatever joins it."""
    return request(
        (5, 6, 7, 8, 9, 10),
        2,
        SamplingParams(max_tokens=30, temperature=0.9, seed=5, stop_at_eos=False),
    )


def short_joins() -> dict[int, list[GenerationRequest]]:
    """Joins that all end before `longest` does: one adapter, then both at once, then a
    request that wants prompt logprobs (a prefill pass apart for that whole admit)."""
    return {
        2: [request((11, 12, 13), 3, SamplingParams(max_tokens=8, temperature=0.7, seed=3))],
        3: [
            request((21, 22, 23, 24, 25), 1, SamplingParams(max_tokens=6, temperature=0.0)),
            request((31, 32), 2, SamplingParams(max_tokens=9, top_p=0.5, seed=9), session="t"),
        ],
        4: [
            request(
                (51, 52, 53, 54),
                1,
                SamplingParams(max_tokens=5, temperature=0.5, seed=12),
                prompt_logprobs=True,
            )
        ],
    }


def counted(engine: LocalEngine, requests, joins) -> tuple[list, int]:
    """`run`'s results and how many passes went through the decoder."""
    _, gm = generator_of(engine)
    passes = []
    handle = gm.model.base_model.register_forward_hook(lambda *_: passes.append(1))
    try:
        return run(engine, requests, joins=joins), len(passes)
    finally:
        handle.remove()


@pytest.mark.parametrize(("steps", "static"), [(1, False), (4, False), (3, True)])
def test_a_join_beside_dynamic_passes_runs_no_prefill_pass_of_its_own(
    engine, monkeypatch, steps, static
):
    """Beside static passes (CUDA graphs on a GPU; here on the CPU) joins prefill apart: the
    joining pass would make a replayed pass an eager one (joining_pass.py)."""
    monkeypatch.setattr(sampler, "CPU_BLOCK_STEPS", steps)
    monkeypatch.setattr(sampler, "CPU_STATIC_DECODE", static)
    first, joins = longest(), short_joins()
    results, passes = counted(engine, [first], joins)
    monkeypatch.setattr(joining_pass, "JOIN_IN_DECODE_PASS", False)
    apart, passes_apart = counted(engine, [first], joins)
    # One prefill of the first request and its 29 decode passes; apart, one prefill pass per
    # admit too (beside static passes a prefill step per adapter: two for the admit of both,
    # prefill_graph.by_adapter). Inside the decode pass, only the admit that wants prompt
    # logprobs has one.
    prefills_apart = 4 if static else 3
    assert passes_apart == 1 + 29 + prefills_apart
    assert passes == 1 + 29 + (prefills_apart if static else 1)
    admitted = [q for boundary in sorted(joins) for q in joins[boundary]]
    for ours, theirs, q in zip(results, apart, [first, *admitted], strict=True):
        assert_same(ours, theirs)
        (alone,) = run(engine, [q])
        assert_same(ours, alone)


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        "qwen2",
        "gemma3_text",
        "phi3",
        "gpt_neox",
        "granite",
        "qwen3_moe",
        "deepseek_v3",
        "gemma2",
    ],
)
def test_joins_inside_the_decode_pass_get_what_they_get_alone_on_every_family(
    tmp_path, monkeypatch, family
):
    """Fused projections (Phi-3, GPT-NeoX), partial rotary (GPT-NeoX), sliding and global
    layers (Qwen2, Gemma 3), multipliers (Granite), experts (Qwen3-MoE), latent attention and
    sigmoid routing (DeepSeek-V3): the packed pass gives
    each family's joining rows what they get alone. Gemma 2's soft-capped attention is eager:
    its joins run a prefill pass apart."""
    monkeypatch.setattr(sampler, "CPU_BLOCK_STEPS", 2)
    engine = engine_for({"m": families.build(family, tmp_path / family)}, "m")
    first = request(
        (1, 40, 41, 42, 50, 60, 61, 62, 63),
        2,
        SamplingParams(max_tokens=20, seed=1, stop_at_eos=False),
    )
    joins = {
        2: [request((1, 33, 34, 35), 3, SamplingParams(max_tokens=7, temperature=0.6, seed=2))],
        4: [
            request(
                (1, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79), 1, SamplingParams(max_tokens=5, seed=6)
            ),
            request((1, 90), 2, SamplingParams(max_tokens=6, seed=4), session="t"),
        ],
    }
    results, passes = counted(engine, [first], joins)
    eager = family == "gemma2"
    assert passes == 1 + 19 + (2 if eager else 0)
    admitted = [q for boundary in sorted(joins) for q in joins[boundary]]
    for ours, q in zip(results, [first, *admitted], strict=True):
        (alone,) = run(engine, [q])
        assert_same(ours, alone)


def test_a_join_whose_prompt_the_prefix_cache_holds_runs_only_the_rest_in_the_pass():
    engine = LocalEngine(
        EngineConfig(device="cpu", logprob_chunk_tokens=5), {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}
    )
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=4, alpha=8, seed=1))
    engine.create_session("r", "t", LoraConfig(rank=4, alpha=8, seed=2))
    prompt = tuple(range(20, 44))
    run(engine, [request(prompt, 1, SamplingParams(max_tokens=2, seed=1))])  # caches it
    joined = request((*prompt, 7, 8, 9), 2, SamplingParams(max_tokens=6, temperature=0.8, seed=3))
    results, passes = counted(engine, [longest()], {2: [joined]})
    assert passes == 1 + 29
    hits = {s.prompt_cache_hit_tokens for s in results[1].sequences}
    assert hits == {len(prompt)}
    (alone,) = run(engine, [joined])
    assert_same(results[1], alone)


def test_a_publish_between_the_admit_and_its_pass_serves_the_join_on_the_new_weights(engine):
    """The admitted request's prompt has not run when the publish lands (PIPELINE, between
    blocks): it runs on the new weights, and its result has one policy segment, of the new
    version, as if it had arrived after the publish; the running rows switch at their next
    token."""
    resource, gm = generator_of(engine)
    first = longest()
    joined = request((11, 12, 13), 2, SamplingParams(max_tokens=8, temperature=0.7, seed=3))
    decoding = sampler.Decoding(gm, [first], resource.served, block_steps=2)
    decoding.block()
    decoding.admit([joined])
    assert decoding.joining() == (2, 1)
    engine.publish("r", "s", version=41)
    decoding.weights_published(True)
    while decoding.running:
        decoding.block()
    results = decoding.results()
    assert results[1].policy_segments == [PolicySegment(0, 41)]
    # The running rows had their first token and one block of 2 when the publish landed.
    assert results[0].policy_segments[-1] == PolicySegment(3, 41)
    for ours, q in zip(results, [first, joined], strict=True):
        (alone,) = run(engine, [q])
        assert alone.policy_segments == [PolicySegment(0, 41)]
        assert [s.tokens for s in ours.sequences] == [s.tokens for s in alone.sequences]
    assert_same(results[1], run(engine, [joined])[0])


def test_a_stream_counts_admitted_rows_running_and_taken_from_its_pool():
    """Between the admit and the block that joins them, the admitted rows count as running
    (scheduling bounds) and as taken from the pool (the next join's memory reserve)."""
    engine = engine_for({BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}, BUILTIN_MODEL_ID)
    resource = engine._resource("r")
    s, t = engine._session("r", "s")[1], engine._session("r", "t")[1]
    stream = SampleStream(engine.config, resource, resource.loaded.model, block_steps=2)
    stream.reserve_rows(8)
    running = SampleRequest(
        ((5, 6, 7, 8), (9, 10)), 2, SamplingParams(max_tokens=20, seed=5, stop_at_eos=False)
    )
    stream.admit([(s, running)])
    stream.block()
    before = stream.room()
    assert (stream.running_rows(), before.own_free_rows, before.prefix_free_rows) == (4, 4, 6)
    stream.admit([(t, SampleRequest(((11, 12, 13),), 3, SamplingParams(max_tokens=6, seed=3)))])
    room = stream.room()
    assert stream.running_rows() == 7
    assert (room.own_free_rows, room.prefix_free_rows) == (1, 5)
    cache = stream.decoding.cache
    assert cache is not None and cache.own.num_rows == 4  # not in the cache yet
    stream.block()
    assert stream.decoding.joining() == (0, 0)
    assert 4 <= cache.own.num_rows == stream.running_rows() <= 7


def test_admits_before_a_block_share_its_first_pass(engine):
    """Two admits between the same blocks (a scheduler's boundary may admit more than once):
    their prompts run in one pass, and each request gets what it gets alone."""
    resource, gm = generator_of(engine)
    first = longest()
    b = request((11, 12, 13), 3, SamplingParams(max_tokens=8, temperature=0.7, seed=3))
    c = request((31, 32), 2, SamplingParams(max_tokens=6, seed=9), session="t")
    decoding = sampler.Decoding(gm, [first], resource.served, block_steps=2)
    decoding.block()
    passes = []
    handle = gm.model.base_model.register_forward_hook(lambda *_: passes.append(1))
    try:
        decoding.admit([b])
        decoding.admit([c])
        assert decoding.joining() == (5, 2)
        decoding.block()
    finally:
        handle.remove()
    assert len(passes) == 2  # the block's two passes, the first with both prompts
    while decoding.running:
        decoding.block()
    for ours, q in zip(decoding.results(), [first, b, c], strict=True):
        (alone,) = run(engine, [q])
        assert_same(ours, alone)


class _Reads(TorchDispatchMode):
    """Operations that read the device back (on CUDA, each a synchronisation)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func.overloadpacket.__name__ in ("_local_scalar_dense", "nonzero")
        return func(*args, **(kwargs or {}))


def test_a_join_inside_the_decode_pass_reads_back_no_more_than_a_prefill_apart(engine, monkeypatch):
    """The packed pass spreads and gathers the prompts' positions by an index made on the host,
    not by a boolean mask (whose indexing reads the device back, once per layer and way)."""
    resource, gm = generator_of(engine)
    reads = {}
    for inside in (False, True):
        monkeypatch.setattr(joining_pass, "JOIN_IN_DECODE_PASS", inside)
        decoding = sampler.Decoding(gm, [longest()], resource.served, block_steps=2)
        decoding.block()
        mode = _Reads()
        with mode:
            decoding.admit(
                [
                    request((11, 12, 13), 2, SamplingParams(max_tokens=8, seed=2)),
                    request((1, 2), 1, SamplingParams(max_tokens=8, seed=3), session="t"),
                ]
            )
            decoding.block()
        reads[inside] = mode.reads
    assert gm.model.config.num_hidden_layers >= 2
    assert 0 < reads[True] <= reads[False], reads
