"""`posttrain serve --trainer-ranks 2`: each model resource's trainer on a group of two gloo
rank processes (engine/hosts/ranks/trainer_group.py). Through the SDK against a real server, an RL
loop (sample, score with a batch-global loss, step, weights-sync, sample again) gets what a server
with the in-thread engine gets: losses and metrics within 1e-5 relative, the same tokens for
the same seeds; its two ranks are stopped at shutdown. A --trainer-ranks beyond the cores is a
start-up error naming the flag. A full-weight session, sharded with FSDP2, does the same, and
checkpoints, ends and resumes, with its layers freed after each forward (--shard-parameters on,
the default) and kept gathered until the backward (off)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL, open_session
from test_worker_processes import alive, workers_of
from together.post_training import ModelResourcesClient, SessionClient

FAST = 0.05
LORA = {"rank": 4, "seed": 5}
PROMPT = [1, 40, 41, 42, 43]
GRPO = {
    "type": "LOSS_TYPE_GRPO",
    "grpo_params": {"agg_type": "GRPO_LOSS_AGGREGATION_TYPE_SEQUENCE_MEAN"},
}


def rl_sample(tokens: list[int], logprobs: list[float], advantage: float) -> dict:
    full = PROMPT + tokens
    n_prompt = len(PROMPT) - 1
    return {
        "model_input": {"chunks": [{"encoded_text": {"tokens": full[:-1]}}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": full[1:], "dtype": "int64"},
            "logprobs": {"data": [0.0] * n_prompt + logprobs, "dtype": "float32"},
            "advantages": {
                "data": [0.0] * n_prompt + [advantage] * len(tokens),
                "dtype": "float32",
            },
            "mask": {"data": [0] * n_prompt + [1] * len(tokens), "dtype": "int64"},
        },
    }


def rl_loop(session: SessionClient, steps: int) -> list:
    """Sample three completions of uneven length, train on them, sync; what the caller sees."""
    seen: list = []
    for step in range(steps):
        result = session.generator.sample(
            {"chunks": [{"encoded_text": {"tokens": PROMPT}}]},
            num_samples=3,
            sampling_params={"max_tokens": 4 + 2 * step, "temperature": 1.0, "seed": 11 + step},
            interval=FAST,
        )
        sequences = [list(s.tokens) for s in result.sequences]
        samples = [
            # Off-policy by a little (older sampler logprobs): no metric is a sum that cancels
            # to rounding noise around zero, where no relative bound can hold.
            rl_sample(
                s.tokens[: 2 + index],
                [lp - 0.05 * (index + 1) for lp in s.logprobs[: 2 + index]],
                0.5 + index,
            )
            for index, s in enumerate(result.sequences)
        ]
        trained = session.trainer.forward_backward(samples=samples, loss=GRPO, interval=FAST)
        session.trainer.optim_step(adam_params={"learning_rate": 1e-2}, interval=FAST)
        session.trainer.weights_sync(interval=FAST)
        seen.append((sequences, trained.loss, trained.metrics))
    return seen


def test_an_rl_loop_on_two_trainer_ranks_equals_the_in_thread_engine(tmp_path):
    (tmp_path / "ranks").mkdir()
    (tmp_path / "thread").mkdir()
    ranks = ServerProcess.started(
        tmp_path / "ranks", "--poll-hold-seconds", "0", "--trainer-ranks", "2"
    )
    try:
        _, session = open_session(ranks.base_url, lora_config=LORA)
        on_ranks = rl_loop(session, 3)
        processes = workers_of(ranks.process.pid)
        assert len(processes) == 2  # the resource's two ranks
    finally:
        ranks.stop()
    assert not any(alive(pid) for pid in processes)  # shutdown stopped them

    thread = ServerProcess.started(tmp_path / "thread", "--poll-hold-seconds", "0")
    try:
        _, twin = open_session(thread.base_url, lora_config=LORA)
        in_thread = rl_loop(twin, 3)
    finally:
        thread.stop()
    assert_equal_across_ranks(on_ranks, in_thread)


def assert_equal_across_ranks(seen: list, want: list) -> None:
    """What `rl_loop` saw on ranks against one process: the same tokens, losses and metrics
    within 1e-5 relative (the ranks sum in another order)."""
    for (tokens, loss, metrics), (want_tokens, want_loss, want_metrics) in zip(
        seen, want, strict=True
    ):
        assert tokens == want_tokens
        assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
        assert metrics == pytest.approx(want_metrics, rel=1e-5, abs=1e-7)


def test_more_trainer_ranks_than_cores_is_a_start_up_error(tmp_path):
    too_many = str((os.cpu_count() or 1) + 1)
    completed = subprocess.run(
        [sys.executable, "-m", "posttrain", "serve", "--port", "0", "--data-dir", str(tmp_path)]
        + ["--trainer-ranks", too_many],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 2
    assert f"--trainer-ranks {too_many} is more than the" in completed.stderr


def full_weight_session(base_url: str) -> tuple[ModelResourcesClient, SessionClient]:
    resources = ModelResourcesClient.create(
        base_url=base_url, api_key=API_KEY, base_model=BASE_MODEL, lora_enabled=False, interval=0.2
    )
    return resources, resources.create_session(interval=0.2)


def test_a_full_weight_rl_loop_on_two_fsdp2_ranks_equals_the_in_thread_engine(tmp_path):
    """`--shard-parameters on` (the default): the same loop on a full-weight session (FSDP2),
    sampling from rank 0's generator copy that weights-sync fills from every rank's shard;
    then checkpoints (a MERGED export and a training state gathered from the shards), the
    session's end, and a resume on the same ranks."""
    full_weight_loop_on_ranks_equals_the_in_thread_engine(tmp_path, "--shard-parameters", "on")


def test_a_full_weight_rl_loop_on_fsdp2_ranks_keeping_layers_gathered_equals_one(tmp_path):
    """`--shard-parameters off`: each layer stays gathered from its forward to its backward."""
    full_weight_loop_on_ranks_equals_the_in_thread_engine(tmp_path, "--shard-parameters", "off")


def full_weight_loop_on_ranks_equals_the_in_thread_engine(tmp_path, *sharding: str) -> None:
    (tmp_path / "ranks").mkdir()
    (tmp_path / "thread").mkdir()
    flags = ("--poll-hold-seconds", "0", "--trainer-ranks", "2", *sharding)
    ranks = ServerProcess.started(tmp_path / "ranks", *flags)
    try:
        resources, session = full_weight_session(ranks.base_url)
        on_ranks = rl_loop(session, 3)
        session.create_inference_checkpoint()
        training = session.create_training_checkpoint()
        session.stop()
        resumed = resources.create_session(resume_from_checkpoint_id=training.id, interval=0.2)
        assert resumed.retrieve().step == 3
    finally:
        ranks.stop()

    thread = ServerProcess.started(tmp_path / "thread", "--poll-hold-seconds", "0")
    try:
        _, twin = full_weight_session(thread.base_url)
        in_thread = rl_loop(twin, 3)
    finally:
        thread.stop()
    assert_equal_across_ranks(on_ranks, in_thread)
