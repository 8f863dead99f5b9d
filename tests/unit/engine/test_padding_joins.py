"""Joins beside static passes (CUDA graphs on a GPU; here on the CPU, eagerly) take the padding
rows of the running layout when they fit (engine/generate/padding_joins.py), so the layout's
pass is not made again (on CUDA: not captured again), and every request still gets what it
gets alone: tokens, stop reasons, policy segments, logprobs within 1e-5. Joins that do not fit
(no free prompt group with enough rows, a longer prompt, another adapter, another sampling
kind) append their rows as before. Built-in model, CPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_stream_joins import assert_same, engine_for, generator_of, request

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID
from posttrain.engine.generate import padding_joins, sampler
from posttrain.engine.generate.decode_graph import DecodeStep
from posttrain.engine.generate.sample_stream import SampleStream
from posttrain.engine.generate.sampler import GenerationRequest
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.model.static_decode_cache import PREFIX_COLUMNS_AT_LEAST
from posttrain.types import SampleRequest, SamplingParams


@pytest.fixture(scope="module")
def engine() -> LocalEngine:
    return engine_for({BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}, BUILTIN_MODEL_ID)


@pytest.fixture(autouse=True)
def static_blocks(monkeypatch):
    monkeypatch.setattr(sampler, "CPU_STATIC_DECODE", True)
    monkeypatch.setattr(sampler, "CPU_BLOCK_STEPS", 2)


def agent_turn(agent: int, turn: int, **options) -> GenerationRequest:
    """One agent's turn: a one-sample request of a 6-token prompt, its length by agent and
    turn (stop_at_eos off, so lengths are what the test says)."""
    prompt = tuple(3 + (7 * agent + turn + k) % 90 for k in range(6))
    params = SamplingParams(
        max_tokens=3 + (5 * agent + 3 * turn) % 11,
        temperature=options.pop("temperature", 0.9),
        seed=100 * agent + turn,
        stop_at_eos=False,
    )
    return request(prompt, 1, params, **options)


def closed_loop(engine, agents: int, turns: int | list[int], turn=agent_turn, between_tokens=None):
    """`agents` agents, each sending its next turn as soon as its last one finished (it joins
    at the next block boundary), `turns` turns each (or agent a turns[a]): the results in
    arrival order, their requests, and how many layouts (DecodeSteps) the generation made."""
    resource, gm = generator_of(engine)
    turns_of = turns if isinstance(turns, list) else [turns] * agents
    requests = [turn(a, 0) for a in range(agents)]
    agent_of = list(range(agents))
    due: list[GenerationRequest] = []
    layouts: list[DecodeStep] = []

    def finished(index: int, _result) -> None:
        agent = agent_of[index]
        done = sum(1 for a in agent_of if a == agent)
        if done < turns_of[agent]:
            agent_of.append(agent)
            due.append(turn(agent, done))

    def admit() -> list[GenerationRequest]:
        joining = list(due)
        due.clear()
        requests.extend(joining)
        return joining

    made = DecodeStep.__init__

    def counted(step, *args, **kwargs) -> None:
        layouts.append(step)
        made(step, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodeStep, "__init__", counted)
        results = sampler.generate(
            gm,
            list(requests),
            versions=resource.served,
            admit=admit,
            finished=finished,
            between_tokens=between_tokens,
        )
    assert len(results) == sum(turns_of)
    return results, requests, len(layouts)


def test_turns_of_a_closed_loop_join_into_padding_rows_and_keep_the_layout(engine, monkeypatch):
    """8 agents x 4 turns of one-sample requests: each next turn takes the row its last one
    left, so the layout is made a few times (the first batch, the growth of the own part,
    the tail as agents run out of turns), not at every join; with joins that always append,
    at every one."""
    results, requests, layouts = closed_loop(engine, 8, 4)
    monkeypatch.setattr(padding_joins, "JOIN_INTO_PADDING", False)
    appended, appended_requests, layouts_appending = closed_loop(engine, 8, 4)
    assert layouts_appending >= 15, layouts_appending
    assert layouts <= 6, layouts
    # The requests are the same; the order they finish in within a block is the batch's.
    theirs = dict(zip(appended_requests, appended, strict=True))
    assert theirs.keys() == set(requests)
    for ours, q in zip(results, requests, strict=True):
        assert_same(ours, theirs[q])
        (alone,) = sampler_alone(engine, q)
        assert_same(ours, alone)


def sampler_alone(engine, q: GenerationRequest):
    resource, gm = generator_of(engine)
    return sampler.generate(gm, [q], versions=resource.served)


def traced_fits(monkeypatch) -> list[bool]:
    """Whether each join beside the layout took padding rows (True) or appended (False)."""
    calls: list[bool] = []
    fits = padding_joins.join_into_padding

    def traced(*args):
        placed = fits(*args)
        calls.append(placed is not None)
        return placed

    monkeypatch.setattr(sampler, "join_into_padding", traced)
    return calls


def test_joins_that_do_not_fit_the_layout_append_and_still_get_what_they_get_alone(
    engine, monkeypatch
):
    """Turns that cannot take the padding of the layout: a prompt longer than its prefix
    columns (odd turns; a generate call's prompts are not pooled, so the columns are the
    longest prompt's), the other adapter (agent 1's later turns). They append, making a new
    layout; everything stays exact."""

    def turn(agent: int, number: int) -> GenerationRequest:
        if number and agent == 1:
            return agent_turn(agent, number, session="t")
        q = agent_turn(agent, number)
        if number % 2:
            return request(q.prompt + (90, 91, 92), 1, q.params)
        return q

    calls = traced_fits(monkeypatch)
    results, requests, _ = closed_loop(engine, 4, 4, turn)
    assert True in calls and False in calls  # some joins took padding rows, some appended
    for ours, q in zip(results, requests, strict=True):
        (alone,) = sampler_alone(engine, q)
        assert_same(ours, alone)


@pytest.mark.parametrize("first", [0.0, 0.9], ids=["greedy-layout", "mixed-layout"])
def test_joins_keep_each_rows_random_stream_whatever_the_batchs_sampling_kind(
    engine, monkeypatch, first
):
    """Agent 0's short turns alternate between tempered and greedy, agents 1 and 2 run one
    long greedy turn. In a greedy layout (whose draw is an argmax) a tempered turn appends. In
    a mixed one every turn takes agent 0's row: the batch turns all greedy (no uniforms used)
    and back, and the tempered turn still draws from its own stream, not from what the batch
    drew ahead before it turned greedy."""

    def turn(agent: int, number: int) -> GenerationRequest:
        tempered = agent == 0 and (number % 2 == 0) == (first > 0)
        q = agent_turn(agent, number, temperature=0.9 if tempered else 0.0)
        long = replace(q.params, max_tokens=20 if agent else 3 + number)
        return request(q.prompt, 1, long)

    calls = traced_fits(monkeypatch)
    results, requests, _ = closed_loop(engine, 3, [3, 1, 1], turn)
    # Greedy layout: the tempered turn appends (the padding left first), and the next turn
    # takes its row in the new layout, a mixed one.
    assert calls == ([False, True] if first == 0.0 else [True, True]), calls
    for ours, q in zip(results, requests, strict=True):
        (alone,) = sampler_alone(engine, q)
        assert_same(ours, alone)


def test_a_prompt_with_several_samples_takes_a_group_of_as_many_rows(engine):
    """Requests of 3 samples each: a next turn takes the 3 rows of the prompt its agent's last
    turn left (a group's rows, read through the group layout), and gets what it gets alone."""

    def turn(agent: int, number: int) -> GenerationRequest:
        q = agent_turn(agent, number)
        return request(q.prompt, 3, q.params)

    results, requests, layouts = closed_loop(engine, 4, 3, turn)
    assert layouts <= 5, layouts
    for ours, q in zip(results, requests, strict=True):
        (alone,) = sampler_alone(engine, q)
        assert_same(ours, alone)


def test_a_longer_prompt_joins_a_streams_padding_within_the_layouts_prefix_columns(engine):
    """A sample stream (its prompts pooled): the layout reads each prefix row up to a power of
    two of columns (PREFIX_COLUMNS_AT_LEAST), so a prompt longer than every running one takes
    the row a finished operation left, and the layout (on CUDA its graph) stays."""
    resource = engine._resource("r")
    s = engine._session("r", "s")[1]
    stream = SampleStream(engine.config, resource, resource.loaded.model, block_steps=2)
    stream.reserve_rows(8)
    params = SamplingParams(temperature=0.9, stop_at_eos=False)
    running = SampleRequest(
        ((5, 6, 7, 8), (9, 10), (11, 12, 13)), 1, replace(params, max_tokens=16, seed=1)
    )
    short = SampleRequest(((14, 15),), 1, replace(params, max_tokens=3, seed=2))
    joining = SampleRequest((tuple(range(20, 40)),), 1, replace(params, max_tokens=6, seed=3))
    stream.admit([(s, running), (s, short)])
    finished: dict[int, list] = {}
    while 1 not in finished:
        stream.block()
        finished.update(stream.take_finished())
    decoding = stream.decoding
    step, rows = decoding.step, len(decoding.batch.live)
    assert step is not None and step.cache.prefix_columns == PREFIX_COLUMNS_AT_LEAST
    # The short one's row is padding now, beside 4 placeholders (the layout fills the pool).
    assert len(decoding.running) == 3 and rows == 8
    stream.admit([(s, joining)])
    assert decoding.step is step and len(decoding.batch.live) == rows
    assert len(decoding.running) == 4
    while stream.running:
        stream.block()
        finished.update(stream.take_finished())
    for item, op in enumerate([running, short, joining]):
        (alone,) = engine.sample_batch("r", [("s", op)])
        for ours, theirs in zip(finished[item], alone, strict=True):
            assert_same(ours, theirs)
