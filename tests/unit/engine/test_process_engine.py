"""ProcessEngine (engine/hosts/process/worker.py): the same calls give the same results, bit for
bit, as the in-process LocalEngine, errors keep their class and field, a mid-sample callback
publishes across the pipe, and a worker that is killed fails its calls without taking this process
with it, and can be loaded again."""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_calls import forward_backward, sample

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.checkpoint import durable
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.hosts.messages import (
    Message,
    StreamAdmit,
    StreamBlock,
    StreamCanJoin,
    StreamFits,
    StreamRunningRows,
)
from posttrain.engine.hosts.process.remote import ProcessEngine
from posttrain.errors import EngineFailure, InvalidRequest, NotFound, WorkerDied
from posttrain.types import (
    AdamParams,
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    OptimStepRequest,
    SampleRequest,
    SamplingParams,
    TrainingSample,
)

CONFIG = EngineConfig(device="cpu")
MODELS = {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}
CE = LossConfig(LossType.CROSS_ENTROPY)
LORA = LoraConfig(rank=4, alpha=8, seed=1)


def ce_sample(tokens: list[int]) -> TrainingSample:
    return TrainingSample(
        tokens=tuple(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": (1.0,) * (len(tokens) - 1),
        },
    )


BATCH = (ce_sample([5, 6, 7, 8, 9, 10]), ce_sample([11, 12, 13, 14]))
STEP = OptimStepRequest(adam=AdamParams(learning_rate=5e-2))
PROMPT = SampleRequest(
    prompts=((1, 40, 41, 42),),
    num_samples=2,
    sampling_params=SamplingParams(max_tokens=6, temperature=1.0, seed=3),
)


def script(engine, directory: Path) -> list:
    """A session's life: train, publish, sample (publishing again mid-sample), custom
    forward-backward, persist; everything a caller reads back."""
    seen: list = []
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    engine.create_session("r", "s", LORA)
    request = ForwardBackwardRequest(BATCH, CE, return_loss_fn_outputs=True)
    seen.append(forward_backward(engine, "r", "s", request))
    engine.optim_step("r", "s", STEP)
    engine.publish("r", "s", version=1)
    seen.append(sample(engine, "r", "s", PROMPT))
    forward_backward(engine, "r", "s", ForwardBackwardRequest(BATCH, CE))
    engine.optim_step("r", "s", STEP)
    published = []

    def between_tokens() -> None:  # a PIPELINE weights-sync lands after the second token
        published.append(None)
        if len(published) == 2:
            engine.publish("r", "s", version=2)

    seen.append(sample(engine, "r", "s", PROMPT, between_tokens=between_tokens))
    seen.append(len(published))
    gradients = tuple(tuple(0.5 for _ in s.tokens) for s in BATCH)
    engine.custom_forward_backward("r", "s", CustomForwardBackwardRequest(BATCH, gradients))
    engine.persist_session("r", "s", directory, ("trainer", "optimizer", "gradients"), {"n": 1})
    engine.optim_step("r", "s", STEP)
    scored = ForwardBackwardRequest(BATCH, CE, forward_only=True, return_loss_fn_outputs=True)
    seen.append(forward_backward(engine, "r", "s", scored))
    return seen


def test_a_worker_process_computes_exactly_what_the_local_engine_does(tmp_path):
    torch.manual_seed(0)
    expected = script(LocalEngine(CONFIG, MODELS), tmp_path / "local")
    engine = ProcessEngine(CONFIG, MODELS)
    try:
        assert script(engine, tmp_path / "process") == expected
        assert engine.model_info(BUILTIN_MODEL_ID) == LocalEngine(CONFIG, MODELS).model_info(
            BUILTIN_MODEL_ID
        )
        # What the worker persisted is what the local engine persisted.
        local_parts, local_record = durable.read(tmp_path / "local")
        parts, record = durable.read(tmp_path / "process")
        assert record == local_record and parts.keys() == local_parts.keys()
        for name in ("trainer", "gradients"):
            assert parts[name].keys() == local_parts[name].keys()
            for key, tensor in local_parts[name].items():
                assert torch.equal(parts[name][key], tensor), (name, key)
        # The optimizer's moments; not the process's global RNG state, which dropout (0 here)
        # would draw from and which the two processes were never meant to share.
        assert str(parts["optimizer"]["optimizer"]) == str(local_parts["optimizer"]["optimizer"])
    finally:
        engine.close()


def test_errors_cross_the_pipe_with_their_class_and_field(tmp_path):
    engine = ProcessEngine(CONFIG, MODELS)
    try:
        engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
        with pytest.raises(NotFound, match="session nope"):
            engine.optim_step("r", "nope", STEP)
        with pytest.raises(InvalidRequest) as info:
            engine.check_tokens(BUILTIN_MODEL_ID, (1, 10**6), "samples[0].tokens")
        assert info.value.param == "samples[0].tokens"
        with pytest.raises(NotFound):  # a resource no worker holds
            engine.optim_step("other", "s", STEP)
        engine.create_session("r", "s", LORA)
        (outcome,) = engine.forward_backward_batch(
            "r", [("ghost", ForwardBackwardRequest(BATCH, CE))]
        )
        assert isinstance(outcome, NotFound)  # a failed item is returned, not raised
    finally:
        engine.close()


def test_a_killed_worker_fails_its_calls_and_the_resource_loads_again(tmp_path):
    engine = ProcessEngine(CONFIG, MODELS)
    try:
        engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
        engine.create_session("r", "s", LORA)
        first = engine.worker_pid("r")
        os.kill(first, signal.SIGKILL)
        with pytest.raises(
            WorkerDied, match=f"model resource r \\(pid {first}\\) was killed by signal 9"
        ):
            forward_backward(engine, "r", "s", ForwardBackwardRequest(BATCH, CE))
        assert not engine.is_loaded("r")
        with pytest.raises(WorkerDied):  # and every later call, until it is loaded again
            engine.optim_step("r", "s", STEP)

        engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
        assert engine.is_loaded("r") and engine.worker_pid("r") != first
        engine.create_session("r", "s", LORA)
        request = ForwardBackwardRequest(BATCH, CE, forward_only=True)
        assert forward_backward(engine, "r", "s", request).loss > 0
    finally:
        engine.close()


def test_close_leaves_no_worker_process():
    engine = ProcessEngine(CONFIG, MODELS)
    engine.load_resource("a", BUILTIN_MODEL_ID, muon_scaling=None)
    engine.load_resource("b", BUILTIN_MODEL_ID, muon_scaling=None)
    processes = [engine._hosts[r].process for r in ("a", "b")]
    engine.unload_resource("a")
    assert not processes[0].is_alive() and processes[1].is_alive()
    engine.close()
    assert not any(p.is_alive() for p in processes)
    assert not engine.is_loaded("b")


def test_weighing_a_join_asks_the_worker_nothing_after_a_step():
    """At a block boundary every queued sample is weighed (can_join, fits): that is no round
    trip. fits answers from the room the last step brought, as the worker itself does: nothing
    within the pool's rows, a copy of the cache past them, the pool's growth for a longer
    max_tokens; can_join is asked once per session."""
    engine = ProcessEngine(CONFIG, MODELS)
    try:
        engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
        engine.create_session("r", "s", LORA)
        stream = engine.sample_stream("r", "s")
        assert stream is not None
        stream.admit([("s", PROMPT)], row_limit=4, spare_bytes=1 << 40)  # 2 of the pool's 4 rows
        params = PROMPT.sampling_params
        candidates = [
            [("s", PROMPT)],
            [("s", replace(PROMPT, num_samples=3))],
            [("s", replace(PROMPT, sampling_params=replace(params, max_tokens=60)))],
        ]
        sent: list[type[Message]] = []
        host_call = stream._host_call

        def counted(message: Message):
            sent.append(type(message))
            return host_call(message)

        def asked(items, spare=0):  # the worker's own answer
            return stream._send(StreamFits("r", stream.stream_id, items, spare))

        stream._host_call = counted
        local = [stream.fits(items, 0) for items in candidates]
        assert stream.can_join("s") and stream.can_join("s")
        assert sent == [StreamCanJoin]  # the first can_join
        stream._host_call = host_call
        worker = [asked(items) for items in candidates]
        assert local == worker
        assert local == [True, False, False]  # within the pool; a copy; the pool's growth
        stream.block()
        assert stream.fits(candidates[1], 0) == asked(candidates[1]) is False
        assert stream.fits(candidates[1], 1 << 40) == asked(candidates[1], 1 << 40) is True
        stream.close()
    finally:
        engine.close()


def test_a_stream_in_a_worker_decodes_what_a_batch_does_and_its_death_fails_it():
    """ProcessEngine.sample_stream: a stream open in the worker, driven call by call
    (hosts/remote_streams.py), with a forward-backward of the same session between blocks;
    a block and what the caller asks after it (finished operations, the followed ones' tokens,
    running rows) is one round trip; closed, the worker holds it no more; a killed worker fails
    its calls, not its close."""
    torch.manual_seed(0)
    local = LocalEngine(CONFIG, MODELS)
    local.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    local.create_session("r", "s", LORA)
    expected = sample(local, "r", "s", PROMPT)
    engine = ProcessEngine(CONFIG, MODELS)
    try:
        engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
        engine.create_session("r", "s", LORA)
        stream = engine.sample_stream("r", "s")
        assert stream is not None and stream.can_join("s")
        sent: list[type[Message]] = []
        host_call = stream._host_call

        def counted(message: Message):
            sent.append(type(message))
            return host_call(message)

        stream._host_call = counted  # the stream's own round trips (training goes apart)
        (stream_id,) = stream.admit([("s", PROMPT)], row_limit=4, spare_bytes=1 << 40)
        stream.follow([stream_id])  # its progress comes back with the next steps
        finished = stream.take_finished()
        blocks = 0
        drawn: list[list[int]] = []
        while stream.running_rows():
            forward_backward(engine, "r", "s", ForwardBackwardRequest(BATCH, CE))
            stream.block()
            blocks += 1
            for progress_id, tokens in stream.take_progress():
                assert progress_id == stream_id
                drawn = [a + b for a, b in zip(drawn, tokens, strict=True)] if drawn else tokens
            finished += stream.take_finished()
        assert blocks >= 5 and finished == [(stream_id, expected)]
        sequences = [q.tokens for result in expected for q in result.sequences]
        assert len(drawn) == len(sequences) and len(drawn[0]) >= 4
        assert all(q[: len(d)] == d for q, d in zip(sequences, drawn, strict=True))
        assert sent == [StreamAdmit] + [StreamBlock] * blocks  # admit, then one per block
        stream.close()
        stream.close()  # idempotent
        host = engine._host("r")
        assert host is not None
        with pytest.raises(EngineFailure, match="no decode stream 1 is open on r"):
            host.call(StreamRunningRows("r", 1))

        stream = engine.sample_stream("r", "s")
        assert stream is not None
        stream.admit([("s", PROMPT)])
        worker = engine.worker_pid("r")
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(WorkerDied, match=f"\\(pid {worker}\\) was killed by signal 9"):
            stream.block()
        engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)  # a new worker
        with pytest.raises(WorkerDied, match=f"\\(pid {worker}\\)"):  # bound to the dead one
            stream.running_rows()
        stream.close()  # nothing left to free
    finally:
        engine.close()
