"""Joins beside static passes prefill through a PrefillStep of their bucket, made once and
reused (engine/generate/prefill_graph.py; a CUDA graph on a GPU, eager on the CPU): its KV and
first-token logits are a prefill pass's (within 1e-5), from the prefix cache's hit on as a
prefill pass's are, every pass of a step runs the same operations on the same shapes and reads
nothing back (what a capture needs), and every request still gets what it gets alone. Prompt
logprobs prefill apart. Built-in model, CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_padding_joins import (
    agent_turn,
    closed_loop,
    sampler_alone,
    static_blocks,  # noqa: F401  (autouse: static blocks of 2 passes)
)
from test_stream_joins import assert_same, engine_for, generator_of, request

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.generate import prefill_graph
from posttrain.engine.generate.joins import Generation
from posttrain.engine.generate.prefill import PromptGroup, prefill, prompt_cache
from posttrain.engine.generate.prefill_graph import PrefillStep
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.types import LoraConfig, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from test_decode_blocks import _Trace as Trace  # noqa: E402  (the dispatch trace of a pass)


@pytest.fixture(scope="module")
def engine() -> LocalEngine:
    return engine_for({BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}, BUILTIN_MODEL_ID)


def counted_steps(monkeypatch) -> tuple[list[PrefillStep], list[list[tuple[int, ...]]]]:
    """The PrefillSteps made, and the prompts of each run of one."""
    made: list[PrefillStep] = []
    runs: list[list[tuple[int, ...]]] = []
    init, run = PrefillStep.__init__, PrefillStep.run

    def counted_init(step, *args, **kwargs) -> None:
        made.append(step)
        init(step, *args, **kwargs)

    def counted_run(step, groups, hits):
        runs.append([g.prompt for g in groups])
        return run(step, groups, hits)

    monkeypatch.setattr(PrefillStep, "__init__", counted_init)
    monkeypatch.setattr(PrefillStep, "run", counted_run)
    return made, runs


def prefix_caching_engine(mib: int) -> LocalEngine:
    """The built-in model with sessions s and t, its prefix cache `mib` MiB (0: off)."""
    config = EngineConfig(device="cpu", logprob_chunk_tokens=5, prefix_cache_mib=mib)
    engine = LocalEngine(config, {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR})
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    for session, seed in (("s", 1), ("t", 2)):
        engine.create_session("r", session, LoraConfig(rank=4, alpha=8, seed=seed))
    return engine


def planned(engine: LocalEngine, prompts: list[tuple[int, ...]]) -> list[PromptGroup]:
    """The prompt groups of one-sample requests of `prompts` on session s."""
    _, gm = generator_of(engine)
    generation = Generation()
    params = SamplingParams(max_tokens=4, seed=1)
    requests = [request(p, 1, params) for p in prompts]
    group_ids, _ = generation.add(gm, requests, engine._resource("r").served)
    return [generation.groups[g] for g in group_ids]


def stepped(gm, step: PrefillStep, prompts: list[tuple[int, ...]], engine) -> tuple:
    groups = planned(engine, prompts)
    with torch.no_grad():
        return step.run(groups, prompt_cache(gm, groups))


@pytest.mark.parametrize("cached", [False, True], ids=["no-prefix-cache", "prefix-cache-hits"])
def test_a_prefill_step_gives_a_prefill_passs_kv_and_first_logits(cached):
    """Three prompts of different lengths in a bucket of 4 rows x 16 positions: each row's
    KV over its prompt, its length and its first-token logits are a prefill pass's; a second
    run of other prompts overwrites them all. With the prefix cache holding the first 8
    positions of two of them, the step runs the rest, as a prefill pass does."""
    engine = prefix_caching_engine(64 if cached else 0)
    _, gm = generator_of(engine)
    prompts = [(5, 6, 7), tuple(range(10, 22)), tuple(range(30, 44))]
    if cached:  # the prefix cache learns the first 8 positions of the longer two
        with torch.no_grad():
            prefill(gm, planned(engine, [p[:8] for p in prompts[1:]]), with_logits=False)
    step = PrefillStep(gm, "s@generator", 4, 16, 32, graph=False)
    stepped(gm, step, [(1, 2, 3, 4, 5, 6, 7, 8, 9)] * 4, engine)  # overwritten next
    cache, logits_GV = stepped(gm, step, prompts, engine)
    groups = planned(engine, prompts)
    with torch.no_grad():
        expected_cache, expected_GV = prefill(gm, groups, with_logits=True)
    assert [g.cache_hit_tokens for g in groups] == ([0, 8, 8] if cached else [0, 0, 0])
    assert expected_GV is not None
    assert cache.lengths_B[:3].tolist() == [len(p) for p in prompts]
    torch.testing.assert_close(logits_GV, expected_GV, atol=1e-5, rtol=0)
    for row, prompt in enumerate(prompts):
        ours = cache.kv[:, :, row, :, : len(prompt)]
        theirs = expected_cache.kv[:, :, row, :, : len(prompt)]
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_every_pass_of_a_prefill_step_runs_the_same_operations_and_reads_nothing_back(
    engine, monkeypatch
):
    """What a CUDA graph needs, checked on the CPU: whatever prompts a bucket's step prefills,
    its pass dispatches the same operations on the same shapes, none a read to the host."""
    _, gm = generator_of(engine)
    traces = []
    run_pass = PrefillStep._pass

    def traced(step):
        with Trace() as trace:
            logits = run_pass(step)
        traces.append(trace.ops)
        return logits

    monkeypatch.setattr(PrefillStep, "_pass", traced)
    step = PrefillStep(gm, "s@generator", 2, 16, 16, graph=False)
    for prompts in ([(5, 6, 7)], [(1,) * 16, (2, 3)], [(9,) * 11, (4,) * 5]):
        stepped(gm, step, prompts, engine)
    assert len(traces) == 3
    assert all(ops == traces[0] for ops in traces)
    assert not any("_local_scalar_dense" in name for name, _ in traces[0])


def test_joins_beside_static_passes_reuse_one_prefill_step_per_bucket(engine, monkeypatch):
    """8 agents x 4 turns of 6-token prompts: every join prefills through a step, one per
    bucket of rows (joins that come at one boundary share a run), and every request gets what
    it gets alone; with the steps off, every join runs a prefill pass of its own."""
    made, runs = counted_steps(monkeypatch)
    results, requests, _ = closed_loop(engine, 8, 4)
    joined = sum(map(len, runs))
    assert joined == 24  # every later turn (3 of each agent's 4) joined through a step
    assert len(made) <= 3 < len(runs)  # rows buckets 1, 2, 4 at most
    monkeypatch.setattr(prefill_graph, "JOIN_PREFILL_STEPS", False)
    apart, apart_requests, _ = closed_loop(engine, 8, 4)
    assert sum(map(len, runs)) == joined  # no step ran
    theirs = dict(zip(apart_requests, apart, strict=True))
    for ours, q in zip(results, requests, strict=True):
        assert_same(ours, theirs[q])
        (alone,) = sampler_alone(engine, q)
        assert_same(ours, alone)


def test_joins_wanting_prompt_logprobs_prefill_apart_and_prefix_cache_hits_take_a_step(
    monkeypatch,
):
    """A join that wants prompt logprobs needs every position's logits: it takes a prefill
    pass, not a step (so does the rest of its admit). One whose prompt the prefix cache holds
    in part takes a step that runs the rest; other joins take one too. Each gets what it gets
    alone."""
    engine = prefix_caching_engine(64)
    _, runs = counted_steps(monkeypatch)
    first_prompt = agent_turn(0, 0).prompt

    def turn(agent: int, number: int):
        q = agent_turn(agent, number)
        if agent == 0 and number:  # agent 0 extends its first prompt: a prefix-cache hit
            return request(first_prompt + (number,), 1, q.params)
        return request(q.prompt, 1, q.params, prompt_logprobs=agent == 1 and number > 0)

    results, requests, _ = closed_loop(engine, 3, 3, turn)
    through_steps = {prompt for run in runs for prompt in run}
    hits = {first_prompt + (1,), first_prompt + (2,)}
    # (An admit with a prompt-logprobs join in it prefills apart as a whole.)
    assert through_steps & hits
    assert through_steps <= hits | {agent_turn(2, n).prompt for n in (1, 2)}
    for result, q in zip(results, requests, strict=True):
        assert (result.prompt_logprobs is not None) == q.prompt_logprobs
        (alone,) = sampler_alone(engine, q)
        assert_same(result, alone)


def test_a_publish_makes_the_joins_after_it_prefill_through_a_new_step(engine, monkeypatch):
    """A step's capture holds the weights it read: after a publish (PIPELINE, between blocks)
    the joins prefill through a step made for the new generation, and every request's tokens
    are those of no publish (the same weights are published)."""
    made, runs = counted_steps(monkeypatch)
    boundaries = []

    def publish_at_the_sixth_boundary() -> None:
        boundaries.append(1)
        if len(boundaries) == 6:
            engine.publish("r", "s", version=40)

    results, requests, _ = closed_loop(engine, 4, 4, between_tokens=publish_at_the_sixth_boundary)
    assert len(boundaries) > 6
    buckets = [(step.cache.kv.shape[2], step.width) for step in made]
    assert len(buckets) > len(set(buckets))  # one bucket's step made again for the new weights
    for result, q in zip(results, requests, strict=True):
        (alone,) = sampler_alone(engine, q)
        assert len(result.sequences) == len(alone.sequences)
        for x, y in zip(result.sequences, alone.sequences, strict=True):
            assert x.tokens == y.tokens
            torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gemma", "olmo2", "gpt_neox", "granite"])
def test_joins_beside_static_passes_get_what_they_get_alone_on_every_family(
    tmp_path, monkeypatch, family
):
    """The families whose decode runs static passes (full attention, sdpa, dense): fused
    projections and partial rotary (GPT-NeoX), multipliers (Granite), norms after attention
    (OLMo 2), Gemma's scaled embeddings: joins into padding rows through prefill steps give
    each family's requests what they get alone."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "model"))
    import families

    engine = engine_for({"m": families.build(family, tmp_path / family)}, "m")
    made, runs = counted_steps(monkeypatch)
    results, requests, layouts = closed_loop(engine, 4, 3)
    assert runs and made  # the joins prefilled through steps
    assert layouts < 8  # and took padding rows (8 joins)
    for result, q in zip(results, requests, strict=True):
        (alone,) = sampler_alone(engine, q)
        assert_same(result, alone)
