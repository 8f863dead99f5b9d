"""The GRPO loop of grpo.py written against the tinker API: tinker_shim.py runs it through
together's tinker shim, tinker_native.py through the tinker 0.38 SDK itself. The loop is the
same code for both; only the `tinker` module handed in differs.

Tinker has no GRPO loss name, so the policy loss is tinker's "importance_sampling" (the same
surrogate, summed over tokens); the advantages are still group-relative.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from types import ModuleType
from typing import Any

from _common import addition_problems, addition_reward, decode, encode


def add_arguments(args_parser: argparse.ArgumentParser) -> None:
    args_parser.add_argument("--steps", type=int, default=10, help="training steps")
    args_parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    args_parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    args_parser.add_argument("--learning-rate", type=float, default=1e-3, help="Adam learning rate")


def train(
    tinker: ModuleType,
    training: Any,
    args: argparse.Namespace,
    stop: list[int] | None = None,
    new_sampler: Callable[[], Any] | None = None,
) -> None:
    """`training`: a tinker TrainingClient; `stop`: the sampling stop (None: the SDK's
    default, EOS); `new_sampler`: a SamplingClient of the current weights (default:
    `training.save_weights_and_get_sampling_client`, which returns the client in the shim and
    a future of it in tinker 0.38)."""
    new_sampler = new_sampler or training.save_weights_and_get_sampling_client
    problems = addition_problems(seed=1, count=2000)
    rng = random.Random(0)
    sampler = new_sampler()
    for step in range(1, args.steps + 1):
        batch = rng.sample(problems, args.prompts)
        params = tinker.SamplingParams(max_tokens=5, temperature=1.0, seed=step, stop=stop)
        # Submit every prompt before waiting on any: the futures resolve in any order.
        futures = [
            sampler.sample(
                prompt=tinker.ModelInput.from_ints(encode(prompt)),
                num_samples=args.group_size,
                sampling_params=params,
            )
            for prompt, _ in batch
        ]
        data, rewards = [], []
        for (prompt, answer), future in zip(batch, futures, strict=True):
            sequences = future.result().sequences
            group = [
                addition_reward(decode(s.tokens), answer, stopped=s.stop_reason == "stop")
                for s in sequences
            ]
            rewards += group
            mean = sum(group) / len(group)
            prompt_ids = encode(prompt)
            pad = len(prompt_ids) - 1
            for sequence, r in zip(sequences, group, strict=True):
                if r == mean:
                    continue
                tokens = prompt_ids + list(sequence.tokens)
                completion = len(sequence.tokens)
                data.append(
                    tinker.Datum(
                        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": tokens[1:],
                            "logprobs": [0.0] * pad + list(sequence.logprobs),
                            "advantages": [0.0] * pad + [r - mean] * completion,
                        },
                    )
                )
        loss = 0.0
        if data:
            output = training.forward_backward(data, "importance_sampling").result()
            loss = output.metrics["loss:sum"]
            training.optim_step(tinker.AdamParams(learning_rate=args.learning_rate)).result()
            sampler = new_sampler()
        print(
            f"step {step:3d}  mean reward {sum(rewards) / len(rewards):.3f}  "
            f"trained samples {len(data):3d}  loss {loss:+.4f}",
            flush=True,
        )
