"""Requests joining a running generation at decode block boundaries (sampler.generate's
`admit`, engine/generate/joins.py) get what they get alone: the same tokens, stop reasons and
policy segments, logprobs within 1e-5 (a matrix product's rows depend in their last bits on
how many rows it has); and the running rows are not disturbed by them. On the built-in model,
CPU, for per-token and block decoding, dynamic and static passes, several adapters, greedy,
plain and shaped sampling, several samples of a prompt, stop strings and max_tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.generate import generator, sampler
from posttrain.engine.generate.decode_graph import DecodeStep
from posttrain.engine.generate.sampler import GenerationRequest
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.model.kv_cache import KVCache
from posttrain.types import LoraConfig, SamplingParams

sys.path.insert(0, str(Path(__file__).parent.parent / "model"))
import families  # noqa: E402
from test_decode_blocks import _Trace as Trace  # noqa: E402  (the dispatch trace of a pass)


def engine_for(models: dict[str, Path], model_id: str) -> LocalEngine:
    # No prefix cache: a cached prompt runs a shorter prefill, whose logits may differ in the
    # last bits, and a request alone after the joined run would hit what that run cached.
    engine = LocalEngine(
        EngineConfig(device="cpu", logprob_chunk_tokens=5, prefix_cache_mib=0), models
    )
    engine.load_resource("r", model_id, muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=4, alpha=8, seed=1))
    engine.create_session("r", "t", LoraConfig(rank=4, alpha=8, seed=2))
    return engine


@pytest.fixture(scope="module")
def engine() -> LocalEngine:
    return engine_for({BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}, BUILTIN_MODEL_ID)


def generator_of(engine: LocalEngine):
    """The resource and its GeneratorModel, sessions s and t served."""
    resource = engine._resource("r")
    for session in ("s", "t"):
        generator.served(resource, engine._session("r", session)[1])
    return resource, generator.generator_model(engine.config, resource, resource.loaded.model)


def run(engine: LocalEngine, requests, *, joins=None, between_tokens=None, finished=None):
    """sampler.generate on the resource's model; `joins` maps a block boundary (counted from
    1) to the requests admitted there."""
    resource, gm = generator_of(engine)
    calls = []

    def admit() -> list[GenerationRequest]:
        calls.append(1)
        return list((joins or {}).get(len(calls), []))

    return sampler.generate(
        gm,
        requests,
        versions=resource.served,
        admit=admit,
        between_tokens=between_tokens,
        finished=finished,
    )


def request(tokens, samples, params, session="s", **options) -> GenerationRequest:
    return GenerationRequest(tuple(tokens), samples, params, f"{session}@generator", **options)


def running_request() -> GenerationRequest:
    return request((5, 6, 7, 8, 9, 10), 2, SamplingParams(max_tokens=30, temperature=0.9, seed=5))


def joining_requests() -> dict[int, list[GenerationRequest]]:
    """Per boundary, the requests that join there: rows of both adapters, several kinds of
    sampling, prompts of other lengths than the running one's, ending at many steps."""
    return {
        3: [
            request(
                (11, 12, 13),
                3,
                SamplingParams(max_tokens=12, temperature=0.7, top_k=20, top_p=0.9, seed=3),
            )
        ],
        6: [
            request(
                (21, 22, 23, 24, 25, 26, 27, 28, 29),
                1,
                SamplingParams(max_tokens=9, temperature=0.0),
            ),
            request(
                (31, 32),
                2,
                SamplingParams(max_tokens=15, temperature=1.3, top_p=0.5, seed=9),
                session="t",
            ),
        ],
        7: [
            request((41, 42, 43, 44), 2, SamplingParams(max_tokens=40, seed=11)),
            request(
                (51, 52, 53, 54, 55),
                1,
                SamplingParams(max_tokens=6, temperature=0.5, seed=12),
                prompt_logprobs=True,
                topk_prompt_logprobs=3,
            ),
        ],
    }


def assert_same(ours, alone) -> None:
    assert ours.policy_segments == alone.policy_segments
    if alone.prompt_logprobs is None:
        assert ours.prompt_logprobs is None
    else:
        torch.testing.assert_close(ours.prompt_logprobs, alone.prompt_logprobs, atol=1e-5, rtol=0)
    assert (ours.topk_prompt_logprobs is None) == (alone.topk_prompt_logprobs is None)
    for a, b in zip(ours.topk_prompt_logprobs or [], alone.topk_prompt_logprobs or [], strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert len(ours.sequences) == len(alone.sequences)
    for x, y in zip(ours.sequences, alone.sequences, strict=True):
        assert x.tokens == y.tokens
        assert x.stop_reason == y.stop_reason
        assert x.routed_experts == y.routed_experts
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("steps", "static"), [(1, False), (4, False), (1, True), (3, True)])
def test_a_request_joining_a_running_generation_gets_what_it_gets_alone(
    engine, monkeypatch, steps, static
):
    monkeypatch.setattr(sampler, "CPU_BLOCK_STEPS", steps)
    monkeypatch.setattr(sampler, "CPU_STATIC_DECODE", static)
    first = running_request()
    joins = joining_requests()
    results = run(engine, [first], joins=joins)
    admitted = [q for boundary in sorted(joins) for q in joins[boundary]]
    assert len(results) == 1 + len(admitted)
    # The running request is not disturbed by the rows that joined it.
    (alone_first,) = run(engine, [first])
    assert_same(results[0], alone_first)
    # Every row of it was still running when the first requests joined, and every join found
    # rows running (else the generation would have ended before admitting it: len above).
    assert min(len(s.tokens) for s in results[0].sequences) > 1 + (min(joins) - 1) * steps
    for ours, joined in zip(results[1:], admitted, strict=True):
        (alone,) = run(engine, [joined])
        assert_same(ours, alone)
    lengths = {len(s.tokens) for r in results for s in r.sequences}
    assert len(lengths) >= 4, lengths  # rows really ended at different steps


def test_a_request_joining_once_every_running_row_left_the_first_ones_behind(engine):
    """Rows of different own lengths side by side run non-uniform passes; once the shorter
    running rows leave, the rest continue exactly."""
    short = request((5, 6), 3, SamplingParams(max_tokens=4, temperature=0.8, seed=1))
    late = request((7, 8, 9), 2, SamplingParams(max_tokens=10, temperature=0.8, seed=2))
    results = run(engine, [short], joins={2: [late]})
    for ours, q in zip(results, [short, late], strict=True):
        (alone,) = run(engine, [q])
        assert_same(ours, alone)


@pytest.mark.parametrize("family", ["mistral", "olmoe", "qwen3_next", "qwen3_5_text"])
def test_joins_on_sliding_windows_and_moe_routes_get_what_they_get_alone(
    tmp_path, monkeypatch, family
):
    """Sliding-window masks over rows of different own lengths (Mistral), expert routes of
    joined rows (OLMoE: the prompt's from the joined prefill, then one per token), recurrent
    states of joined rows beside running ones (the Gated DeltaNet hybrids, Qwen3-Next with
    routes)."""
    monkeypatch.setattr(sampler, "CPU_BLOCK_STEPS", 2)
    engine = engine_for({"m": families.build(family, tmp_path / family)}, "m")
    first = request((1, 40, 41, 42, 50, 60), 2, SamplingParams(max_tokens=14, seed=1))
    joined = request(
        (1, 33, 34, 35),
        3,
        SamplingParams(max_tokens=9, temperature=0.6, top_k=7, seed=2),
        session="t",
        return_routed_experts=True,
    )
    results = run(engine, [first], joins={3: [joined]})
    for ours, q in zip(results, [first, joined], strict=True):
        (alone,) = run(engine, [q])
        assert_same(ours, alone)
    if family in ("olmoe", "qwen3_next"):
        assert all(s.routed_experts is not None for s in results[1].sequences)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_publish_while_joined_rows_run_recomputes_each_row_at_its_own_length(
    engine, monkeypatch, static
):
    """A PIPELINE publish of the same weights at a boundary after a join: every running row's
    KV is recomputed (rows of different own lengths), a policy segment opens at each one's
    next token, and the tokens are those of no publish."""
    monkeypatch.setattr(sampler, "CPU_BLOCK_STEPS", 2)
    monkeypatch.setattr(sampler, "CPU_STATIC_DECODE", static)
    first = running_request()
    joined = request((11, 12, 13), 2, SamplingParams(max_tokens=12, temperature=0.7, seed=3))
    calls = []
    version = 20 + static  # the engine is the module's: each case publishes a new version

    def publish_on_the_fifth_boundary() -> None:
        calls.append(1)
        if len(calls) == 5:
            engine.publish("r", "s", version=version)

    results = run(
        engine, [first], joins={3: [joined]}, between_tokens=publish_on_the_fifth_boundary
    )
    # Boundary b comes after 1 + 2 (b - 1) tokens of the first request. The joined one
    # joined at boundary 3: beside dynamic passes its prompt ran in the block's first pass
    # (joining_pass.py), which gave its first token, so at boundary 5 it has 2 * 2 tokens;
    # beside static passes a prefill pass of its own gave it one more, 1 + 2 * 2.
    assert results[0].policy_segments[-1].start_token == 9
    assert results[1].policy_segments[-1].start_token == (5 if static else 4)
    for ours, q in zip(results, [first, joined], strict=True):
        assert ours.policy_segments[-1].version == version
        (alone,) = run(engine, [q])
        assert len(ours.sequences) == len(alone.sequences)
        for x, y in zip(ours.sequences, alone.sequences, strict=True):
            assert x.tokens == y.tokens
            torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


def test_each_request_is_reported_finished_once_at_the_block_where_its_last_row_ended(engine):
    """`finished` hands over a request's result as soon as its rows have all ended, while the
    generation runs on: the operation can complete then (a request whose every row ended on
    its first token included)."""
    joins = joining_requests()
    joins[4] = [request((61, 62), 2, SamplingParams(max_tokens=1, seed=4))]
    order: list[int] = []
    reported = {}

    def finished(index, result) -> None:
        order.append(index)
        reported[index] = result

    results = run(engine, [running_request()], joins=joins, finished=finished)
    assert sorted(order) == list(range(len(results)))  # each request once
    for index, result in reported.items():
        assert result == results[index]
    # The max_tokens=1 request (admitted 2nd: index 2) is reported when it joins, before the
    # running request that was there first, and before the requests that join after it.
    assert len(results[2].sequences[0].tokens) == 1
    assert order.index(2) < min(order.index(0), order.index(3), order.index(4))


def test_a_decoding_driven_block_by_block_takes_requests_while_idle_and_running(engine):
    """The step API a scheduler drives (sampler.Decoding): started empty, a request admitted,
    blocks run one at a time with another request admitted in between, and a third admitted
    after every row ended (a new batch in the same Decoding): each result is what it is
    alone, reported once by take_finished."""
    resource, gm = generator_of(engine)
    a = running_request()
    b = request((11, 12, 13), 3, SamplingParams(max_tokens=12, temperature=0.7, seed=3))
    c = request((31, 32), 2, SamplingParams(max_tokens=7, temperature=1.3, seed=9), session="t")
    decoding = sampler.Decoding(gm, [], resource.served, block_steps=2)
    assert not decoding.running and decoding.take_finished() == []
    decoding.admit([a])
    reported = {}
    blocks = 0
    while decoding.running:
        decoding.block()
        blocks += 1
        if blocks == 2:
            decoding.admit([b])
        reported.update(decoding.take_finished())
    decoding.admit([c])
    while decoding.running:
        decoding.block()
        reported.update(decoding.take_finished())
    results = decoding.results()
    assert sorted(reported) == [0, 1, 2]
    for index, q in enumerate([a, b, c]):
        assert reported[index] == results[index]
        (alone,) = run(engine, [q])
        assert_same(results[index], alone)


class _Reads(TorchDispatchMode):
    """Whether the operations dispatched read a tensor's value back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.read = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.read |= "_local_scalar_dense" in str(func)
        return func(*args, **(kwargs or {}))


def test_passes_over_rows_of_different_lengths_read_nothing_back(engine, monkeypatch):
    """Rows that joined hold shorter own parts than the running ones: the host knows every
    row's length, so a pass over them reads nothing back from the device (on a GPU, no sync
    per pass); only the first pass of a new layout reads the layout's prefix lengths once."""
    monkeypatch.setattr(sampler, "CPU_BLOCK_STEPS", 4)
    passes: list[tuple[int, bool, bool]] = []  # (block, ragged, read back)
    blocks = []
    forward, block = sampler.forward_rows, sampler.Decoding.block

    def traced_forward(*args, **kwargs):
        with _Reads() as reads:
            hidden = forward(*args, **kwargs)
        passes.append((len(blocks), kwargs.get("ragged", False), reads.read))
        return hidden

    def counted_block(decoding) -> None:
        blocks.append(1)
        block(decoding)

    monkeypatch.setattr(sampler, "forward_rows", traced_forward)
    monkeypatch.setattr(sampler.Decoding, "block", counted_block)
    results = run(engine, [running_request()], joins=joining_requests())
    ragged = [(b, read) for b, is_ragged, read in passes if is_ragged]
    assert len(ragged) >= 8
    first_of_block = {b: min(i for i, (c, _) in enumerate(ragged) if c == b) for b, _ in ragged}
    later = [read for i, (b, read) in enumerate(ragged) if i != first_of_block[b]]
    assert later and not any(later)
    (alone,) = run(engine, [running_request()])
    assert_same(results[0], alone)


def test_static_passes_over_rows_of_different_lengths_keep_one_graph_per_layout(
    engine, monkeypatch
):
    """What a CUDA graph needs of a batch rows joined, checked on the CPU: a layout whose rows
    hold different own lengths runs the same operations on the same shapes every pass, and
    reads nothing back."""
    monkeypatch.setattr(sampler, "CPU_BLOCK_STEPS", 4)
    monkeypatch.setattr(sampler, "CPU_STATIC_DECODE", True)
    traces: dict[int, list[list[tuple]]] = {}
    ragged_layouts = set()
    steps: list[DecodeStep] = []  # kept alive, so no two layouts share an id
    run_pass = DecodeStep._pass

    def traced(step) -> None:
        if id(step) not in traces:
            steps.append(step)
            if len(set(step.cache.own_length_B.tolist())) > 1:
                ragged_layouts.add(id(step))
        with Trace() as trace:
            run_pass(step)
        traces.setdefault(id(step), []).append(trace.ops)

    monkeypatch.setattr(DecodeStep, "_pass", traced)
    run(engine, [running_request()], joins=joining_requests())
    assert ragged_layouts
    assert max(len(traces[i]) for i in ragged_layouts) >= 4  # a whole block of passes
    for passes in traces.values():
        assert all(ops == passes[0] for ops in passes)
        assert not any("_local_scalar_dense" in name for name, _ in passes[0])


@pytest.mark.parametrize(("steps", "static"), [(1, False), (3, True)])
def test_many_requests_joining_at_random_boundaries_each_get_what_they_get_alone(
    engine, monkeypatch, steps, static
):
    """A seeded random stream: 12 requests of random prompts, sample counts, settings and
    lengths (some ending on their first token) joining at random boundaries, several at once,
    while others leave."""
    monkeypatch.setattr(sampler, "CPU_BLOCK_STEPS", steps)
    monkeypatch.setattr(sampler, "CPU_STATIC_DECODE", static)
    rng = torch.Generator().manual_seed(7)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (), generator=rng))

    def random_request(i: int) -> GenerationRequest:
        prompt = tuple(draw(3, 99) for _ in range(draw(1, 12)))
        kind = draw(0, 3)
        params = SamplingParams(
            max_tokens=draw(1, 20),
            temperature=0.0 if kind == 0 else 0.5 + draw(0, 10) / 10,
            top_k=draw(0, 30) if kind == 2 else 0,
            top_p=0.8 if kind == 2 else 1.0,
            seed=100 + i,
        )
        return request(prompt, draw(1, 4), params, session="st"[draw(0, 2)])

    first = request((5, 6, 7), 2, SamplingParams(max_tokens=24, temperature=1.0, seed=1))
    joins: dict[int, list[GenerationRequest]] = {}
    for i in range(12):
        joins.setdefault(draw(1, 10), []).append(random_request(i))
    results = run(engine, [first], joins=joins)
    admitted = [q for boundary in sorted(joins) for q in joins[boundary]]
    assert len(results) == 1 + len(admitted)  # every boundary came: rows were still running
    for ours, q in zip(results, [first, *admitted], strict=True):
        (alone,) = run(engine, [q])
        assert_same(ours, alone)


def test_kv_cache_rows_added_after_live_rows_keep_every_row_intact():
    cache = KVCache(
        num_layers=2,
        num_rows=3,
        capacity=4,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    cache.kv.normal_()
    cache.lengths_B[:] = torch.tensor([4, 2, 3])
    before = [cache.span(b, 0, int(cache.lengths_B[b])).clone() for b in range(3)]
    cache.keep(torch.tensor([0, 2]))  # row 1 freed: its slot is reused first
    source = KVCache(
        num_layers=2,
        num_rows=2,
        capacity=6,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    source.kv.normal_()
    source.lengths_B[:] = torch.tensor([6, 1])
    cache.add_rows(2, source, torch.tensor([1, 0]))  # past the freed slot, longer than capacity
    assert cache.num_rows == 4 and cache.capacity == 6 and cache.kv.shape[2] >= 4
    assert cache.lengths_B[:4].tolist() == [4, 3, 1, 6]
    torch.testing.assert_close(cache.span(0, 0, 4), before[0], atol=0, rtol=0)
    torch.testing.assert_close(cache.span(1, 0, 3), before[2], atol=0, rtol=0)
    torch.testing.assert_close(cache.span(2, 0, 1), source.span(1, 0, 1), atol=0, rtol=0)
    torch.testing.assert_close(cache.span(3, 0, 6), source.span(0, 0, 6), atol=0, rtol=0)
    cache.add_rows(1)
    assert cache.num_rows == 5 and int(cache.lengths_B[4]) == 0
    torch.testing.assert_close(cache.span(3, 0, 6), source.span(0, 0, 6), atol=0, rtol=0)
