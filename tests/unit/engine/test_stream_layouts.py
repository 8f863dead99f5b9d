"""A sample stream's static layouts (CUDA graphs on a GPU; here on the CPU, eagerly) hold
placeholder rows for joins to take (engine/generate/padding_joins.py): while a stream ramps up
no row has ended, so without them every join appends and makes a new layout (on CUDA a new
capture). With them a layout is made about once per doubling of the running rows, inside the
stream's pool, and every operation still gets what it gets alone. Placeholders never make the
decode cache grow, and a join counts them as free rows (SampleStream.room). Built-in model,
CPU."""

from __future__ import annotations

import pytest
import torch
from test_padding_joins import static_blocks  # noqa: F401  (autouse: static passes)
from test_prefill_graph import counted_steps
from test_stream_joins import assert_same, engine_for

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID
from posttrain.engine.generate import joins, padding_joins
from posttrain.engine.generate.decode_graph import DecodeStep
from posttrain.engine.generate.padding_joins import keeps_layout
from posttrain.engine.generate.sample_stream import SampleStream
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.types import LoraConfig, SampleRequest, SamplingParams

POOL = 64


@pytest.fixture(scope="module")
def engine() -> LocalEngine:
    return engine_for({BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}, BUILTIN_MODEL_ID)


def one_sample(index: int, max_tokens: int) -> SampleRequest:
    """Operation `index`: one sample of a 5-token prompt of its own."""
    prompt = tuple(3 + (11 * index + k) % 90 for k in range(5))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=index, stop_at_eos=False)
    return SampleRequest((prompt,), 1, params)


def stream_of(engine, ops, sessions, *, per_block: int = 1, watch=None):
    """The operations admitted `per_block` at a block boundary into one stream (a pool of
    POOL rows, blocks of 2 passes) on sessions `sessions[i]`, until all finish: their results
    by index, the layouts (DecodeSteps) made, and per admit whether it kept the running
    layout (joined into its padding). `watch(stream)` runs after every block."""
    resource = engine._resource("r")
    stream = SampleStream(engine.config, resource, resource.loaded.model, block_steps=2)
    stream.reserve_rows(POOL)
    layouts: list[DecodeStep] = []
    made = DecodeStep.__init__

    def counted(step, *args, **kwargs) -> None:
        layouts.append(step)
        made(step, *args, **kwargs)

    finished: dict[int, list] = {}
    kept: list[bool] = []
    queue = list(zip(sessions, ops, strict=True))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodeStep, "__init__", counted)
        while queue or stream.running:
            if queue:
                joining, queue = queue[:per_block], queue[per_block:]
                step = stream.decoding.step
                stream.admit([(engine._session("r", s)[1], op) for s, op in joining])
                kept.append(step is not None and stream.decoding.step is step)
            stream.block()
            finished.update(stream.take_finished())
            if watch is not None:
                watch(stream)
    assert sorted(finished) == list(range(len(ops)))
    return finished, len(layouts), kept


def assert_alone(engine, finished, ops, sessions, atol: float = 1e-5) -> None:
    """Each operation's results are what it gets alone: the same tokens, stop reasons and
    policy segments, logprobs within `atol`."""
    for item, (session, op) in enumerate(zip(sessions, ops, strict=True)):
        (alone,) = engine.sample_batch("r", [(session, op)])
        for ours, theirs in zip(finished[item], alone, strict=True):
            assert ours.policy_segments == theirs.policy_segments
            for x, y in zip(ours.sequences, theirs.sequences, strict=True):
                assert (x.tokens, x.stop_reason) == (y.tokens, y.stop_reason)
                torch.testing.assert_close(x.logprobs, y.logprobs, atol=atol, rtol=0)


def test_a_ramping_stream_joins_into_placeholder_rows_a_layout_per_doubling(engine, monkeypatch):
    """16 one-sample operations joining two per block, each longer than the ramp: no row ends
    before the stream holds all 16, so every join would append. With placeholders the layouts
    are of 8 and 16 rows (and one as the stream drains), all inside the pool; appending makes
    one per join. Every operation gets the same as appending, and what it gets alone."""
    ops = [one_sample(i, 24 - i % 5) for i in range(16)]
    sessions = ["s"] * len(ops)
    rows_seen: set[int] = set()

    def watch(stream) -> None:
        decoding = stream.decoding
        if decoding.batch is not None and stream.running:
            rows_seen.add(len(decoding.batch.live))
            assert decoding.cache.own.kv.shape[2] == POOL  # placeholders allocate nothing

    finished, layouts, _ = stream_of(engine, ops, sessions, per_block=2, watch=watch)
    assert layouts <= 4, layouts
    assert {8, 16} <= rows_seen, rows_seen
    monkeypatch.setattr(padding_joins, "JOIN_INTO_PADDING", False)
    appended, layouts_appending, _ = stream_of(engine, ops, sessions, per_block=2)
    assert layouts_appending >= len(ops) // 2, layouts_appending
    for item in range(len(ops)):
        for ours, theirs in zip(finished[item], appended[item], strict=True):
            assert_same(ours, theirs)
    # A batch's matrix products differ from one row's in the last bits (the sampler's
    # docstring): here up to 1.0e-5 at one token of operation 10 in 16 rows, appending or not
    # (5.0e-6 beside one other row, measured), so against alone the bound is 2e-5.
    assert_alone(engine, finished, ops, sessions, atol=2e-5)


def test_placeholders_riding_past_the_capacity_restart_instead_of_growing_the_cache(engine):
    """Short operations (6 tokens) joining two per block for 30 blocks: the placeholders made
    at the start ride along far past the own part's capacity (the first operations' 6
    positions). They restart empty in place (padding_joins.rewind_padding), so the cache keeps
    its capacity and the layout stays; each operation gets what it gets alone."""
    ops = [one_sample(i, 6) for i in range(60)]
    sessions = ["s"] * len(ops)
    capacities: set[int] = set()

    def watch(stream) -> None:
        if stream.running:
            capacities.add(stream.decoding.cache.capacity)

    finished, layouts, _ = stream_of(engine, ops, sessions, per_block=2, watch=watch)
    assert capacities == {6}, capacities
    assert layouts <= 3, layouts
    assert_alone(engine, finished, ops, sessions)


def test_placeholders_follow_the_running_rows_adapters(engine):
    """Placeholders route to the running rows' adapters in proportion: the first operation of
    session t (beside placeholders all of s) appends its rows (a new layout), whose placeholders
    then include one of t's, so the next t operation joins without a new layout. Every
    operation gets what it gets alone."""
    ops = [one_sample(i, 19 - 3 * (i % 4)) for i in range(12)]
    sessions = ["t" if i % 4 == 3 else "s" for i in range(len(ops))]
    finished, _, kept = stream_of(engine, ops, sessions)
    assert kept[3] is False  # the first t operation: no placeholder of t yet
    assert kept[7] is True, kept  # the next one takes one
    assert_alone(engine, finished, ops, sessions)


def test_a_join_counts_padding_rows_as_free(engine):
    """SampleStream.room: a stream's placeholders and finished rows are rows a join takes or,
    appending, frees first, so the free rows it reports are the pool's less the running ones,
    as without padding."""
    checked: list[int] = []

    def watch(stream) -> None:
        decoding = stream.decoding
        if stream.running:
            room = stream.room()
            assert room.own_free_rows == POOL - len(decoding.running)
            running_prompts = {
                decoding.batch.rows[decoding.batch.live[b]].group for b in decoding.running
            }
            assert room.prefix_free_rows == POOL - len(running_prompts)
            checked.append(len(decoding.batch.live) - len(decoding.running))

    ops = [one_sample(i, 8 + i % 7) for i in range(10)]
    stream_of(engine, ops, ["s"] * len(ops), watch=watch)
    assert max(checked) > 0  # there was padding to count


@pytest.mark.parametrize(
    ("running", "rows", "stream", "keeps"),
    [
        (2, 8, True, True),  # the layout made for 2 rows would be these 8: kept
        (9, 32, True, True),  # one of 16 rows: more than a quarter
        (8, 32, True, False),  # one of 8 rows: at most a quarter
        (16, 64, True, False),
        (17, 64, True, True),
        (4, 8, False, False),  # whole batches: kept while more than half run
        (5, 8, False, True),
    ],
)
def test_a_streams_layout_shrinks_only_to_a_quarter(running, rows, stream, keeps):
    assert keeps_layout(running, rows, stream) is keeps


def test_many_sessions_joining_one_stream_prefill_through_steps_made_once(engine, monkeypatch):
    """Operations of 6 LoRA sessions joining in turn, 1 and then 2 a block, sessions u0..u5
    served for the first time as their first operation joins: each session's joins prefill
    through one step of its own, made once (a session served for the first time is no weights
    change, and the steps kept are bounded by positions, not by 4 of them), and an admit of
    two sessions' operations runs a step for each, with no eager prefill pass. Every operation
    gets what it gets alone."""
    for index in range(6):
        if f"u{index}" not in engine._resource("r").sessions:
            engine.create_session("r", f"u{index}", LoraConfig(rank=4, alpha=8, seed=10 + index))
    made, runs = counted_steps(monkeypatch)
    eager: list[int] = []
    prefill = joins.prefill

    def counted_prefill(*args, **kwargs):
        eager.append(1)
        return prefill(*args, **kwargs)

    monkeypatch.setattr(joins, "prefill", counted_prefill)
    ops = [one_sample(i, 14 - i % 3) for i in range(24)]
    sessions = [f"u{i % 6}" for i in range(len(ops))]
    finished, _, _ = stream_of(engine, ops[:12], sessions[:12])
    assert len(made) == 6 and len(runs) == 11 and len(eager) == 1, (len(made), len(runs), eager)
    made.clear(), runs.clear(), eager.clear()
    finished_pairs, _, _ = stream_of(engine, ops[12:], sessions[12:], per_block=2)
    assert len(eager) == 1  # the first operations', which start the stream
    assert len(made) == 6 and len(runs) == 10, (len(made), len(runs))
    assert_alone(engine, finished, ops[:12], sessions[:12])
    assert_alone(engine, finished_pairs, ops[12:], sessions[12:])
