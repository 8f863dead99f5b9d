"""A generator lane's stream runs several decode blocks in one call to its replica
(DecodeStream.block's `most`; hosts/replicas/worker.py FencedStream): a call stops after the
block where a sequence ended, or once a wake arrived (ReplicatedEngine.wake_lanes: a sample was
handed to the lanes), and what it samples is what one block a call samples. A real replica
process, the tiny model on the CPU."""

from __future__ import annotations

import pytest
from test_process_engine import CONFIG, LORA, MODELS

from posttrain.config import BUILTIN_MODEL_ID
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.hosts.replicas.engine import ReplicatedEngine
from posttrain.types import SampleRequest, SamplingParams

LONG = SampleRequest(
    ((5, 6, 7, 8),), 3, SamplingParams(max_tokens=30, temperature=1.0, seed=7, stop_at_eos=False)
)
SHORT = SampleRequest(
    ((11, 12, 13),), 2, SamplingParams(max_tokens=6, temperature=0.8, seed=3, stop_at_eos=False)
)


@pytest.fixture(scope="module")
def engine():
    replicated = ReplicatedEngine(LocalEngine(CONFIG, MODELS), CONFIG, MODELS)
    replicated.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None, generator_replicas=1)
    replicated.create_session("r", "s", LORA)
    yield replicated
    replicated.close()


def decoded(engine: ReplicatedEngine, most: int, *, woken: bool = False) -> tuple[list, dict]:
    """LONG and SHORT in one lane stream, `most` blocks a call: the rows running after each
    call, and each operation's results. `woken`: a wake reaches the replica first."""
    fence = engine.generator_fence("r")
    stream = engine.lane_stream("r", "s", fence=fence, lane=0)
    stream.admit([("s", LONG), ("s", SHORT)], fence)
    if woken:
        engine.wake_lanes("r")
        # A change staged after the wake, received: the replica's inbox took the wake first.
        engine.create_session("r", f"after-wake-{engine.generator_fence('r')}", LORA)
        engine.wait_received("r")
    rows, finished = [], {}
    while stream.running_rows():
        stream.block(most)
        rows.append(stream.running_rows())
        finished.update(stream.take_finished())
    stream.close()
    return rows, finished


def test_a_call_runs_blocks_until_a_sequence_ends_and_samples_what_single_blocks_do(engine):
    single_rows, single = decoded(engine, 1)
    rows, finished = decoded(engine, 1000)
    # One block a call: LONG's 29 blocks after its first token (drawn when it was admitted).
    assert len(single_rows) == LONG.sampling_params.max_tokens - 1
    # Many a call: the first stops where SHORT's rows ended, the second at LONG's end.
    assert rows == [3, 0]
    assert_same(finished, single)


def test_a_wake_stops_a_call_at_the_next_block(engine):
    _, alone = decoded(engine, 1000)
    rows, finished = decoded(engine, 1000, woken=True)
    assert rows == [5, 3, 0]  # one block, then as without the wake
    assert_same(finished, alone)


def assert_same(got: dict, expected: dict) -> None:
    """Tokens and policy segments exact; logprobs within 1e-5 (a prefix cache hit of a later
    run may move them by float32 rounding)."""
    assert got.keys() == expected.keys()
    for key, results in got.items():
        for ours, theirs in zip(results, expected[key], strict=True):
            assert ours.policy_segments == theirs.policy_segments
            for a, b in zip(ours.sequences, theirs.sequences, strict=True):
                assert a.tokens == b.tokens
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
