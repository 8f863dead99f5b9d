"""Sample operations as a stream (engine/generate/sample_stream.py): an operation that joins a
running one between decode blocks gets, per prompt, what engine.sample_batch gives it alone,
and each is handed over once, when its last sequence ended; with the prefix cache on, a
joining prompt reads what the running one cached."""

from __future__ import annotations

from test_stream_joins import assert_same, engine_for

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.generate.sample_stream import SampleStream
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.types import LoraConfig, SampleRequest, SamplingParams


def test_an_operation_joining_a_running_one_gets_what_it_gets_alone():
    engine = engine_for({BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}, BUILTIN_MODEL_ID)
    resource = engine._resource("r")
    s, t = engine._session("r", "s")[1], engine._session("r", "t")[1]
    long_op = SampleRequest(
        ((5, 6, 7, 8), (9, 10)), 2, SamplingParams(max_tokens=25, temperature=0.9, seed=5)
    )
    short_op = SampleRequest(
        ((11, 12, 13),),
        3,
        SamplingParams(max_tokens=6, temperature=0.7, top_k=20, seed=3),
        prompt_logprobs=True,
    )
    stream = SampleStream(engine.config, resource, resource.loaded.model, block_steps=2)
    assert stream.can_join(s) and stream.can_join(t)
    assert stream.admit([(s, long_op)]) == [0]
    finished: dict[int, list] = {}
    blocks = 0
    while stream.running:
        stream.block()
        blocks += 1
        if blocks == 3:
            assert stream.admit([(t, short_op)]) == [1]
        for item, results in stream.take_finished():
            assert item not in finished
            finished[item] = results
            if item == 1:
                assert stream.running  # the short operation left while the long one runs
    assert sorted(finished) == [0, 1]
    for item, (session, op) in enumerate([("s", long_op), ("t", short_op)]):
        (alone_results,) = engine.sample_batch("r", [(session, op)])
        assert len(finished[item]) == len(op.prompts)
        for ours, theirs in zip(finished[item], alone_results, strict=True):
            assert_same(ours, theirs)


def test_a_joining_prompt_extending_the_running_one_hits_the_prefix_cache_it_filled():
    engine = LocalEngine(EngineConfig(device="cpu"), {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR})
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=4, alpha=8, seed=1))
    resource, s = engine._resource("r"), engine._session("r", "s")[1]
    running = SampleRequest(((5, 6, 7, 8, 9, 10),), 2, SamplingParams(max_tokens=20, seed=5))
    extending = SampleRequest(
        ((5, 6, 7, 8, 9, 10, 11, 12),), 2, SamplingParams(max_tokens=8, temperature=0.8, seed=44)
    )
    stream = SampleStream(engine.config, resource, resource.loaded.model, block_steps=2)
    stream.admit([(s, running)])
    stream.block()
    stream.admit([(s, extending)])
    finished = {}
    while stream.running:
        stream.block()
        finished.update(stream.take_finished())
    ((joined,),) = [finished[1]]
    assert {q.prompt_cache_hit_tokens for q in joined.sequences} == {6}
    ((alone,),) = engine.sample_batch("r", [("s", extending)])
    assert_same(joined, alone)


def test_a_followed_operation_reports_each_token_once_from_its_first_even_when_followed_late():
    engine = engine_for({BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}, BUILTIN_MODEL_ID)
    resource = engine._resource("r")
    s = engine._session("r", "s")[1]
    followed = SampleRequest(
        ((5, 6, 7), (9, 10)), 2, SamplingParams(max_tokens=12, temperature=0.9, seed=5)
    )
    unwatched = SampleRequest(((11, 12),), 1, SamplingParams(max_tokens=12, seed=3))
    stream = SampleStream(engine.config, resource, resource.loaded.model, block_steps=2)
    assert stream.admit([(s, followed), (s, unwatched)]) == [0, 1]
    stream.block()
    stream.block()
    stream.follow([0])  # late: five tokens per sequence were drawn already (admit's first)
    drawn: list[list[int]] = [[] for _ in range(4)]  # prompt-major, then sample
    reports, finished = [], {}
    while stream.running:
        progress = stream.take_progress()
        assert [item for item, _ in progress] in ([], [0])  # only the followed one
        for _, tokens in progress:
            reports.append(tokens)
            for sequence, new in enumerate(tokens):
                drawn[sequence] += new
        stream.block()
        finished.update(stream.take_finished())
    assert len(reports) > 1 and [len(t) for t in reports[0]] == [5, 5, 5, 5]
    sequences = [q.tokens for result in finished[0] for q in result.sequences]
    # Every token once, in order; the last block's come with the result alone.
    assert all(
        s[: len(d)] == d and len(d) >= len(s) - 2 for s, d in zip(sequences, drawn, strict=True)
    )
