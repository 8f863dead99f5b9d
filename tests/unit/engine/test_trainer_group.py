"""TrainerGroupEngine (engine/hosts/ranks/trainer_group.py): a trainer group of two gloo ranks
computes what one LocalEngine does. Losses, metrics, per-token outputs and gradients agree within
1e-5 relative, weights after steps within float32 rounding, sampled tokens exactly; for several
losses with batch-global normalisers, for batches that do not split evenly over the ranks and
for two sessions sharing a pass; for LoRA and full-weight sessions. The ranks hold identical
weights, a checkpoint the group writes resumes on one process, and a killed rank fails the
call and the group, which loads again."""

from __future__ import annotations

import itertools
import os
import signal
from pathlib import Path

import pytest
import torch
from engine_calls import forward_backward, sample

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.checkpoint import durable
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.hosts.messages import GeneratorState
from posttrain.engine.hosts.ranks.trainer_group import TrainerGroupEngine, check_trainer_ranks
from posttrain.engine.hosts.replicas.engine import ReplicatedEngine
from posttrain.errors import ConfigError, WorkerDied
from posttrain.types import (
    AdamParams,
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    GrpoAggregation,
    GrpoParams,
    LoraConfig,
    LossConfig,
    LossType,
    OptimStepRequest,
    PpoParams,
    SampleRequest,
    SamplingParams,
    TrainingSample,
)

CONFIG = EngineConfig(device="cpu")
GROUP = EngineConfig(device="cpu", trainer_ranks=2)
MODELS = {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}
LORA = LoraConfig(rank=4, alpha=8, seed=1)
# Adam divides each gradient entry by its own size plus eps, so an entry at rounding-noise
# level (measured: 5e-10 on two ranks, 4e-10 on one, in a tensor whose gradient norm is 1e-3)
# takes a step of lr * g / (|g| + eps), a large part of a full one, differently for any two
# summation orders. An eps above that noise keeps its step in proportion to it; every other
# entry's step is as with the default eps. What is left is the rounding REL allows for.
LEARNING_RATE = 1e-2
STEP = OptimStepRequest(adam=AdamParams(learning_rate=LEARNING_RATE, eps=1e-6))
# A hundredth of a step: Adam's first steps move an entry by about lr whatever its gradient's
# size, so the rounding REL allows for shows in the weights (measured on the CI host: up to
# 7.5e-3 of a step).
WEIGHTS = 1e-2 * LEARNING_RATE
CE = LossConfig(LossType.CROSS_ENTROPY)
GRPO = LossConfig(LossType.GRPO, GrpoParams(agg_type=GrpoAggregation.SEQUENCE_MEAN))
GRPO_TOKENS = LossConfig(LossType.GRPO, GrpoParams(agg_type=GrpoAggregation.TOKEN_MEAN))
PPO = LossConfig(LossType.PPO, PpoParams())
PROMPT = SampleRequest(
    prompts=((1, 40, 41, 42),),
    num_samples=2,
    sampling_params=SamplingParams(max_tokens=6, temperature=1.0, seed=3),
)
# Ranks each forward a share of the rows, and a float32 matmul may round a row differently
# by how many rows share the call (MKL on an AVX-512 host: 2e-6 relative on one product,
# up to 5.4e-5 on a gradient whose rows cancel: measured on the project's CI host).
REL = 1e-4


def rl_sample(tokens: list[int], advantage: float, seed: int) -> TrainingSample:
    """A sample with every input any loss here reads; uneven lengths and advantages."""
    n = len(tokens) - 1
    noise = torch.Generator().manual_seed(seed)
    old = (-2.0 - torch.rand(n, generator=noise)).tolist()
    return TrainingSample(
        tokens=tuple(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": tuple(float(i % 3 != 0) for i in range(n)),
            "logprobs": tuple(old),
            "advantages": (advantage,) * n,
        },
    )


# 3 samples on 2 ranks, lengths 7, 3, 5: the token-balanced split is {7} and {3, 5}.
THREE = (
    rl_sample([5, 6, 7, 8, 9, 10, 11, 12], 1.0, 0),
    rl_sample([13, 14, 15, 16], -0.5, 1),
    rl_sample([20, 21, 22, 23, 24, 25], 0.25, 2),
)
TWO = (rl_sample([30, 31, 32, 33, 34], 0.7, 3), rl_sample([40, 41, 42], -1.0, 4))


@pytest.fixture(scope="module")
def group():
    engine = TrainerGroupEngine(GROUP, MODELS)
    yield engine
    engine.close()


def close(actual, expected, rel=REL):
    """Numbers, lists and dicts of them within `rel` relative (1e-7 absolute near zero)."""
    return actual == pytest.approx(expected, rel=rel, abs=1e-7)


def assert_results_equal(actual, expected):
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert close(got.loss, want.loss)
        assert got.metrics.keys() == want.metrics.keys()
        assert close(got.metrics, want.metrics)
        if want.loss_fn_outputs is not None:
            for got_row, want_row in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
                assert close(got_row, want_row)


def assert_tensors_close(actual: dict, expected: dict, *, rel=REL, atol=0.0):
    """Each tensor within `rel` of the expected one in norm (a sum in another order moves
    single entries near zero by more, relatively), or every entry within `atol`."""
    assert actual.keys() == expected.keys() and expected
    for name, want in expected.items():
        got = actual[name]
        if atol:
            assert float((got - want).abs().max()) <= atol, name
        else:
            norm = float(torch.linalg.vector_norm(want))
            error = float(torch.linalg.vector_norm(got - want)) / max(norm, 1e-30)
            assert error <= rel, (name, error)


_dirs = itertools.count()


def state(engine, resource: str, session: str, root: Path, parts=("trainer", "gradients")):
    """The session's named parts as the engine persists them (a group: rank 0's)."""
    directory = root / f"state-{next(_dirs)}"
    engine.persist_session(resource, session, directory, parts, {})
    return durable.read(directory)[0]


def lora_script(engine, resource: str, root: Path) -> list:
    """Two LoRA sessions through every training call, sharing passes; what a caller reads."""
    seen: list = []
    engine.load_resource(resource, BUILTIN_MODEL_ID, muon_scaling=None)
    engine.create_session(resource, "a", LORA)
    engine.create_session(resource, "b", LoraConfig(rank=2, alpha=4, seed=7))
    wants = dict(return_loss_fn_outputs=True)
    seen.append(forward_backward(engine, resource, "a", ForwardBackwardRequest(THREE, CE, **wants)))
    seen.append(state(engine, resource, "a", root))
    engine.optim_step(resource, "a", STEP)
    shared = [
        ("a", ForwardBackwardRequest(THREE, GRPO, **wants)),
        ("b", ForwardBackwardRequest(TWO, GRPO_TOKENS, **wants)),
    ]
    seen.append(engine.forward_backward_batch(resource, shared))
    seen.append(state(engine, resource, "a", root))
    seen.append(state(engine, resource, "b", root))
    engine.optim_step(resource, "a", STEP)
    engine.optim_step(resource, "b", STEP)
    seen.append(state(engine, resource, "a", root, ("trainer",)))
    gradients = tuple(tuple(0.5 - 0.1 * i for i in range(len(s.tokens))) for s in THREE)
    engine.custom_forward_backward(resource, "b", CustomForwardBackwardRequest(THREE, gradients))
    seen.append(state(engine, resource, "b", root))
    # A one-sample batch: one rank forwards nothing and still meets the other in the sums.
    one = ForwardBackwardRequest(THREE[1:2], PPO, **wants)
    seen.append(forward_backward(engine, resource, "b", one))
    engine.optim_step(resource, "b", STEP)
    seen.append(state(engine, resource, "b", root))
    engine.publish(resource, "a", version=1)
    seen.append(sample(engine, resource, "a", PROMPT))
    forward_backward(engine, resource, "a", ForwardBackwardRequest(THREE, CE))
    engine.optim_step(resource, "a", STEP)
    published = []

    def between_tokens() -> None:  # a PIPELINE weights-sync lands after the second token
        published.append(None)
        if len(published) == 2:
            engine.publish(resource, "a", version=2)

    seen.append(sample(engine, resource, "a", PROMPT, between_tokens=between_tokens))
    return seen


def compare_scripts(actual: list, expected: list) -> None:
    (fb1, grads1, batch2, grads2a, grads2b, weights2, custom, one, after, sampled, switched) = (
        actual
    )
    assert_results_equal([fb1], [expected[0]])
    assert_tensors_close(grads1["gradients"], expected[1]["gradients"])
    assert_results_equal(batch2, expected[2])
    for got, want in ((grads2a, expected[3]), (grads2b, expected[4])):
        assert_tensors_close(got["gradients"], want["gradients"])
        assert_tensors_close(got["trainer"], want["trainer"], rel=0, atol=WEIGHTS)
    assert_tensors_close(weights2["trainer"], expected[5]["trainer"], rel=0, atol=WEIGHTS)
    assert_tensors_close(custom["gradients"], expected[6]["gradients"])
    assert_results_equal([one], [expected[7]])
    assert_tensors_close(after["trainer"], expected[8]["trainer"], rel=0, atol=WEIGHTS)
    # The same tokens for the same seed; their logprobs as close as the weights.
    got = [s for r in sampled for s in r.sequences]
    want = [s for r in expected[9] for s in r.sequences]
    assert [s.tokens for s in got] == [s.tokens for s in want]
    for got_sequence, want_sequence in zip(got, want, strict=True):
        assert close(got_sequence.logprobs, want_sequence.logprobs, rel=1e-4)
    # Republished mid-sample from rank 0's callback: every rank took the new weights.
    assert [s.policy_segments for s in switched] == [s.policy_segments for s in expected[10]]
    assert [s.policy_segments[-1].version for s in switched] == [2]
    got = [s.tokens for r in switched for s in r.sequences]
    assert got == [s.tokens for r in expected[10] for s in r.sequences]


def test_two_ranks_train_and_sample_what_one_process_does(group, tmp_path):
    expected = lora_script(LocalEngine(CONFIG, MODELS), "r", tmp_path / "local")
    actual = lora_script(group, "lora", tmp_path / "group")
    compare_scripts(actual, expected)
    # Every rank holds the same weights, bit for bit: the generators serve copies of them.
    (tensors0, version0), (tensors1, version1) = group.on_every_rank(GeneratorState("lora", "a"))
    assert version0 == version1 == 2
    assert all(torch.equal(tensors0[n], tensors1[n]) for n in tensors0)


def test_a_checkpoint_from_two_ranks_resumes_on_one_process(group, tmp_path):
    group.load_resource("lora", BUILTIN_MODEL_ID, muon_scaling=None)
    group.create_session("lora", "c", LORA)
    request = ForwardBackwardRequest(THREE, CE)
    forward_backward(group, "lora", "c", request)
    group.optim_step("lora", "c", STEP)
    (tmp_path / "ckpt").mkdir()
    group.save_training_state("lora", "c", tmp_path / "ckpt")
    next_on_group = forward_backward(group, "lora", "c", request)
    group.drop_session("lora", "c")

    local = LocalEngine(CONFIG, MODELS)
    local.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    local.create_session("r", "c", LORA)
    local.load_training_state("r", "c", tmp_path / "ckpt", load_optimizer=True)
    assert close(forward_backward(local, "r", "c", request).loss, next_on_group.loss)


def full_weight_script(engine, resource: str, root: Path) -> list:
    seen: list = []
    engine.load_resource(resource, BUILTIN_MODEL_ID, muon_scaling=None)
    engine.create_session(resource, "f", None)
    wants = dict(return_loss_fn_outputs=True)
    seen.append(forward_backward(engine, resource, "f", ForwardBackwardRequest(THREE, CE, **wants)))
    seen.append(state(engine, resource, "f", root, ("gradients",)))
    engine.optim_step(resource, "f", STEP)
    seen.append(forward_backward(engine, resource, "f", ForwardBackwardRequest(THREE, GRPO)))
    engine.optim_step(resource, "f", STEP)
    seen.append(state(engine, resource, "f", root, ("trainer",)))
    (root / "ckpt").mkdir()
    engine.save_training_state(resource, "f", root / "ckpt")
    return seen


def test_full_weight_on_two_ranks_equals_one_and_resumes_on_one(group, tmp_path):
    expected = full_weight_script(LocalEngine(CONFIG, MODELS), "r", tmp_path / "local")
    actual = full_weight_script(group, "full", tmp_path / "group")
    assert_results_equal([actual[0], actual[2]], [expected[0], expected[2]])
    assert_tensors_close(actual[1]["gradients"], expected[1]["gradients"])
    assert_tensors_close(actual[3]["trainer"], expected[3]["trainer"], rel=0, atol=WEIGHTS)

    next_request = ForwardBackwardRequest(TWO, CE)
    next_on_group = forward_backward(group, "full", "f", next_request)
    local = LocalEngine(CONFIG, MODELS)
    local.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    local.create_session("r", "f", None)
    local.load_training_state("r", "f", tmp_path / "group" / "ckpt", load_optimizer=True)
    assert close(forward_backward(local, "r", "f", next_request).loss, next_on_group.loss)
    group.unload_resource("full")


def test_a_killed_rank_fails_the_call_and_the_group_loads_again(group):
    group.load_resource("lora", BUILTIN_MODEL_ID, muon_scaling=None)  # the earlier tests' group
    group.create_session("lora", "k", LORA)
    first = group.rank_pids("lora")
    os.kill(first[1], signal.SIGKILL)
    with pytest.raises(WorkerDied, match="rank 1 of the trainer group of model resource lora"):
        forward_backward(group, "lora", "k", ForwardBackwardRequest(THREE, CE))
    assert not group.is_loaded("lora")
    group.load_resource("lora", BUILTIN_MODEL_ID, muon_scaling=None)
    assert group.is_loaded("lora") and not set(group.rank_pids("lora")) & set(first)
    group.create_session("lora", "k", LORA)
    assert forward_backward(group, "lora", "k", ForwardBackwardRequest(THREE, CE)).loss > 0
    pids = group.rank_pids("lora")
    group.unload_resource("lora")
    for pid in (*first, *pids):  # every rank is stopped and reaped: none is left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_generator_replicas_serve_what_the_group_trained(group):
    """--generators process over --trainer-ranks 2: ReplicatedEngine wraps the group."""
    replicated = ReplicatedEngine(group, CONFIG, MODELS)
    replicated.load_resource("rep", BUILTIN_MODEL_ID, muon_scaling=None, generator_replicas=1)
    try:
        replicated.create_session("rep", "s", LORA)
        forward_backward(replicated, "rep", "s", ForwardBackwardRequest(THREE, CE))
        replicated.optim_step("rep", "s", STEP)
        replicated.publish("rep", "s", version=1)
        fence = replicated.generator_fence("rep")
        (on_replica,) = replicated.sample_batch("rep", [("s", PROMPT)], fence=fence, lane=0)
        on_rank_zero = sample(group, "rep", "s", PROMPT)
        assert [s.sequences for s in on_replica] == [s.sequences for s in on_rank_zero]
        assert on_replica[0].policy_segments[0].version == 1
    finally:
        replicated.unload_resource("rep")


def test_more_ranks_than_cores_is_a_start_up_error_naming_the_flag():
    too_many = EngineConfig(device="cpu", trainer_ranks=(os.cpu_count() or 1) + 1)
    with pytest.raises(ConfigError, match="--trainer-ranks") as raised:
        check_trainer_ranks(too_many)
    assert raised.value.param == "trainer_ranks"
    check_trainer_ranks(GROUP if (os.cpu_count() or 1) >= 2 else CONFIG)


def test_a_stream_on_rank_zero_lets_training_reach_every_rank_between_blocks(group):
    """TrainerGroupEngine.sample_stream: the stream lives on rank 0 (hosts/remote_streams.py);
    another session's forward-backward and optim-step between its blocks run on every rank.
    The sample is what one process samples, the training what one process trains; a rank that
    dies fails the group, and the stream's next call with it."""
    local = LocalEngine(CONFIG, MODELS)
    local.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    for session in ("a", "b"):
        local.create_session("r", session, LORA)
    expected = sample(local, "r", "a", PROMPT)
    group.load_resource("s", BUILTIN_MODEL_ID, muon_scaling=None)
    for session in ("a", "b"):
        group.create_session("s", session, LORA)
    stream = group.sample_stream("s", "a")
    assert stream is not None
    (stream_id,) = stream.admit([("a", PROMPT)])
    finished, losses = stream.take_finished(), []
    while stream.running_rows():
        losses.append(forward_backward(group, "s", "b", ForwardBackwardRequest(TWO, CE)).loss)
        group.optim_step("s", "b", STEP)
        stream.block()
        finished += stream.take_finished()
    stream.close()
    assert finished == [(stream_id, expected)]
    wants = []
    for _ in losses:  # each loss is gathered from both ranks' rows: both trained alike
        wants.append(forward_backward(local, "r", "b", ForwardBackwardRequest(TWO, CE)).loss)
        local.optim_step("r", "b", STEP)
    assert len(losses) >= 5 and close(losses, wants)

    stream = group.sample_stream("s", "a")
    assert stream is not None
    stream.admit([("a", PROMPT)])
    os.kill(group.rank_pids("s")[1], signal.SIGKILL)
    with pytest.raises(WorkerDied, match="rank 1 of the trainer group of model resource s"):
        forward_backward(group, "s", "b", ForwardBackwardRequest(TWO, CE))
    with pytest.raises(WorkerDied, match="rank 1 of the trainer group of model resource s"):
        stream.block()
    stream.close()  # nothing left to free
    group.unload_resource("s")
