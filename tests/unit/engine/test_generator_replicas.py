"""ReplicatedEngine (engine/hosts/replicas/engine.py): generator replica processes beside the
trainer.

Each replica samples exactly what the inline generator samples from the same published weights,
a sample applies the staged changes up to its fence and none after it (even on a replica that
was busy while the trainer moved on), a PIPELINE install lands at the running generation's next
token boundary and policy_segments say where, and a killed replica fails its sample without
touching the trainer and is rebuilt from it."""

from __future__ import annotations

import dataclasses
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from engine_calls import forward_backward
from test_process_engine import BATCH, CE, CONFIG, LORA, MODELS, STEP

from posttrain.config import BUILTIN_MODEL_ID
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.hosts.process.remote import ProcessEngine
from posttrain.engine.hosts.replicas import engine as replicas
from posttrain.engine.hosts.replicas.engine import ReplicatedEngine
from posttrain.errors import GeneratorReplicaDied
from posttrain.types import (
    ForwardBackwardRequest,
    PolicySegment,
    SampleRequest,
    SamplingParams,
)

PROMPT = SampleRequest(
    prompts=((1, 40, 41, 42),),
    num_samples=2,
    sampling_params=SamplingParams(max_tokens=8, temperature=1.0, seed=3),
)


def train_and_publish(engine, version: int) -> int:
    """One forward-backward and step, published as `version`; the fence after it."""
    forward_backward(engine, "r", "s", ForwardBackwardRequest(BATCH, CE))
    engine.optim_step("r", "s", STEP)
    engine.publish("r", "s", version=version)
    return engine.generator_fence("r")


def sampled(engine, *, fence: int = 0, lane: int = 0, session: str = "s") -> list:
    """One sample: on a ReplicatedEngine, on generator lane `lane` as of `fence`; an inline
    LocalEngine has no lanes (its generator serves what the trainer published)."""
    at = {"fence": fence, "lane": lane} if isinstance(engine, ReplicatedEngine) else {}
    (results,) = engine.sample_batch("r", [(session, PROMPT)], **at)
    return results


def served(results: list) -> list:
    """What a sample generated, and as of which version (a prefix cache hit may move its
    logprobs by float32 rounding)."""
    return [(s.tokens, r.policy_segments) for r in results for s in r.sequences]


@pytest.fixture(scope="module")
def inline() -> list:
    """What the inline generator samples after versions 1 and 2 are published."""
    engine = LocalEngine(CONFIG, MODELS)
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    engine.create_session("r", "s", LORA)
    seen = []
    for version in (1, 2):
        train_and_publish(engine, version)
        seen.append(sampled(engine))
    return seen


@pytest.fixture(params=["thread"])
def replicated(request):
    """Replicas beside a trainer in this process, or (`process`) in a worker process."""
    trainer = ProcessEngine(CONFIG, MODELS) if request.param == "process" else None
    engine = ReplicatedEngine(trainer or LocalEngine(CONFIG, MODELS), CONFIG, MODELS)
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None, generator_replicas=2)
    engine.create_session("r", "s", LORA)
    yield engine
    engine.close()


@pytest.mark.parametrize("replicated", ["thread", "process"], indirect=True)
def test_replicas_sample_exactly_what_the_inline_generator_does_as_of_their_fence(
    replicated, inline
):
    engine = replicated
    assert engine.generator_lanes("r") == 2
    first = train_and_publish(engine, 1)
    second = train_and_publish(engine, 2)
    assert second > first
    # Both replicas at once; lane 0 as of version 1 although version 2 is staged already.
    with ThreadPoolExecutor(2) as pool:
        old = pool.submit(sampled, engine, fence=first, lane=0)
        new = pool.submit(sampled, engine, fence=second, lane=1)
        assert old.result() == inline[0]
        assert new.result() == inline[1]
    assert sampled(engine, fence=second, lane=0) == inline[1]
    assert {s.version for r in inline[1] for s in r.policy_segments} == {2}
    # Every install's bytes crossed in the weights group's broadcast, none down a pipe.
    delivery = engine.delivery("r")
    assert (delivery.groups, delivery.broadcast, delivery.piped) == (1, 2, 0)  # two publishes


def test_a_pipeline_install_lands_mid_generation_and_a_synchronous_one_does_not(
    replicated, monkeypatch
):
    monkeypatch.setattr(replicas, "BUCKET_BYTES", 1 << 12)  # an adapter in many buckets
    engine = replicated
    first = train_and_publish(engine, 1)
    forward_backward(engine, "r", "s", ForwardBackwardRequest(BATCH, CE))
    engine.optim_step("r", "s", STEP)
    engine.publish("r", "s", version=2)  # SYNCHRONOUS: not for a sample queued before it
    (result,) = sampled(engine, fence=first, lane=0)
    assert result.policy_segments == [PolicySegment(start_token=0, version=1)]

    third = train_and_publish(engine, 3)
    forward_backward(engine, "r", "s", ForwardBackwardRequest(BATCH, CE))
    engine.optim_step("r", "s", STEP)
    engine.publish("r", "s", version=4, mid_generation=True)  # PIPELINE
    engine.wait_received("r")  # all its buckets are on the replica before the generation
    (result,) = sampled(engine, fence=third, lane=1)
    # The install was staged before the generation began: it lands at the first boundary.
    assert [s.version for s in result.policy_segments] == [3, 4]
    assert 0 < result.policy_segments[1].start_token < PROMPT.sampling_params.max_tokens


def test_a_killed_replica_fails_its_sample_and_is_rebuilt_from_the_trainer(replicated, inline):
    engine = replicated
    fence = train_and_publish(engine, 1)
    # Both replicas hold version 1 (its bytes came by broadcast) before one dies; another
    # prompt, so that the prefix cache holds nothing of PROMPT's.
    other = dataclasses.replace(PROMPT, prompts=((2, 50, 51),))
    ((first,), (second,)) = (
        engine.sample_batch("r", [("s", other)], fence=fence, lane=lane) for lane in (0, 1)
    )
    assert served(first) == served(second)
    pid = engine.replica_pids("r")[0]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(GeneratorReplicaDied, match=f"replica 0 of model resource r \\(pid {pid}"):
        sampled(engine, fence=fence, lane=0)
    assert sampled(engine, fence=fence, lane=1) == inline[0]  # the other replica serves on
    # The trainer is untouched; the next sample on lane 0 starts a new replica.
    fence = train_and_publish(engine, 2)
    assert served(sampled(engine, fence=fence, lane=1)) == served(inline[1])
    # Its broadcast met the dead member: the group broke and the bytes went down the pipes.
    assert engine.delivery("r").piped == 1
    assert sampled(engine, fence=fence, lane=0) == inline[1]
    assert engine.replica_pids("r")[0] != pid
    # The next weights-sync forms a group with the new replica, and both serve it alike.
    fence = train_and_publish(engine, 3)
    assert served(sampled(engine, fence=fence, lane=0)) == served(
        sampled(engine, fence=fence, lane=1)
    )
    delivery = engine.delivery("r")
    assert (delivery.groups, delivery.piped) == (2, 1)


def test_close_leaves_no_replica_process():
    engine = ReplicatedEngine(LocalEngine(CONFIG, MODELS), CONFIG, MODELS)
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None, generator_replicas=2)
    processes = [r.worker.process for r in engine._resources["r"].replicas]
    assert all(p.is_alive() for p in processes)
    engine.close()
    assert not any(p.is_alive() for p in processes)


@pytest.mark.parametrize("bucket_bytes", [replicas.BUCKET_BYTES, 1 << 16])
def test_a_full_weight_session_samples_on_its_replica_what_the_inline_generator_does(
    bucket_bytes, monkeypatch
):
    """In one message, and in 64 KiB buckets (the built-in model's 3 MB in about 50)."""
    monkeypatch.setattr(replicas, "BUCKET_BYTES", bucket_bytes)

    def trained(engine) -> list:
        engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None, generator_replicas=1)
        engine.create_session("r", "s", None)  # full weight
        seen = [sampled(engine, fence=engine.generator_fence("r"))]  # the base model
        fence = train_and_publish(engine, 1)
        seen.append(sampled(engine, fence=fence))
        engine.drop_session("r", "s")  # the base weights come back, on the replica too
        engine.create_session("r", "t", LORA)
        return [*seen, sampled(engine, fence=engine.generator_fence("r"), session="t")]

    inline = trained(LocalEngine(CONFIG, MODELS))
    engine = ReplicatedEngine(LocalEngine(CONFIG, MODELS), CONFIG, MODELS)
    try:
        assert trained(engine) == inline
        assert inline[0] != inline[1]  # the step changed what is sampled
    finally:
        engine.close()
