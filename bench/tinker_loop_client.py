"""The tinker 0.38 side of bench/tinker_loops.py: the SL and RL loops through the unmodified
tinker SDK against a posttrain server's /api/v1, timed per step, driven over stdin/stdout.

Run with the tinker 0.38 interpreter (tests/tinker_env.py), not the bench's own: the Together
SDK there pins tinker 0.23.1. Nothing here imports posttrain or torch; the SDK runs at its
defaults (its own polling, retries, chunking and telemetry).

Protocol, one JSON object a line:
- stdin, first line: the setup (url, api_key, base_model, rank, seed, learning_rate,
  sl_tokens: the SL datums' token lists, rl_prompts, num_samples, max_tokens). One training
  run per loop is created, then {"ready": ...} is written.
- stdin, then: {"loop": "sl" | "rl", "steps": N} runs N steps and answers {"loop",
  "seconds": [per step], "sampled_tokens": [per step], "try_again": N}, where try_again counts
  the SDK's "try_again" retries of retrieve_future during those steps (its logged warnings).
- stdin EOF or {"quit": true}: the client session finishes (the runs are left to expire)
  and the process exits.

The SDK's own stdout output goes to stderr, so stdout carries only the protocol.

The RL toy reward and policy datums are those of bench/sdk_loops.py (toy_reward,
policy_inputs), restated here because this interpreter cannot import that module.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import IO, Any

import tinker
from tinker import types

# ------------------------------------------------------------------ the work


def toy_reward(tokens: list[int]) -> float:
    """Share of even token ids: cheap, and it varies within a group."""
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)


def tensor(values: list[float] | list[int], dtype: str) -> types.TensorData:
    return types.TensorData(data=values, dtype=dtype)


def sl_datum(tokens: list[int]) -> types.Datum:
    """Cross-entropy on every position: predict tokens[1:] from tokens[:-1]."""
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tensor(tokens[1:], "int64"),
            "weights": tensor([1.0] * n, "float32"),
        },
    )


def policy_datum(
    prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float
) -> types.Datum:
    """An importance_sampling datum on prompt + completion, the prompt positions zero."""
    full = prompt + tokens
    pad = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": tensor(full[1:], "int64"),
            "logprobs": tensor([0.0] * pad + logprobs, "float32"),
            "advantages": tensor([0.0] * pad + [advantage] * len(tokens), "float32"),
        },
    )


class TryAgainCounter(logging.Handler):
    """Counts the SDK's 'Retrying request ... because of try_again' warnings."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "try_again" in record.getMessage():
            self.count += 1


class Loops:
    """One training run per loop on one ServiceClient."""

    def __init__(self, service: tinker.ServiceClient, setup: dict[str, Any]) -> None:
        self.setup = setup
        self.runs = {
            name: service.create_lora_training_client(
                base_model=setup["base_model"], rank=setup["rank"], seed=setup["seed"] + i
            ).result()
            for i, name in enumerate(("sl", "rl"))
        }
        self.sl_data = [sl_datum(tokens) for tokens in setup["sl_tokens"]]
        self.adam = types.AdamParams(learning_rate=setup["learning_rate"])
        self.params = types.SamplingParams(max_tokens=setup["max_tokens"], temperature=1.0)

    def sl_step(self) -> int:
        training = self.runs["sl"]
        forward_backward = training.forward_backward(self.sl_data, "cross_entropy")
        optim_step = training.optim_step(self.adam)
        forward_backward.result()
        optim_step.result()
        return 0

    def rl_step(self) -> int:
        """Sample every prompt's group from a sampler of the current weights, then an
        importance_sampling step on group-relative toy advantages; the sampled token count."""
        training = self.runs["rl"]
        sampler = training.save_weights_and_get_sampling_client().result()
        prompts = self.setup["rl_prompts"]
        futures = [
            sampler.sample(
                types.ModelInput.from_ints(prompt),
                num_samples=self.setup["num_samples"],
                sampling_params=self.params,
            )
            for prompt in prompts
        ]
        data, sampled = [], 0
        for prompt, future in zip(prompts, futures, strict=True):
            sequences = future.result().sequences
            completions = [[int(t) for t in s.tokens] for s in sequences]
            rewards = [toy_reward(tokens) for tokens in completions]
            mean = sum(rewards) / len(rewards)
            for sequence, tokens, reward in zip(sequences, completions, rewards, strict=True):
                logprobs = [float(lp) for lp in sequence.logprobs]
                data.append(policy_datum(prompt, tokens, logprobs, reward - mean))
                sampled += len(tokens)
        forward_backward = training.forward_backward(data, "importance_sampling")
        optim_step = training.optim_step(self.adam)
        forward_backward.result()
        optim_step.result()
        return sampled


def serve(commands: IO[str], replies: IO[str]) -> None:
    counter = TryAgainCounter()
    logging.getLogger("tinker").addHandler(counter)

    def reply(body: dict[str, Any]) -> None:
        replies.write(json.dumps(body) + "\n")
        replies.flush()

    setup = json.loads(commands.readline())
    with tinker.ServiceClient(base_url=setup["url"], api_key=setup["api_key"]) as service:
        loops = Loops(service, setup)
        runs = {name: run.model_id for name, run in loops.runs.items()}
        reply({"ready": True, "tinker": tinker.__version__, "runs": runs})
        run_commands(loops, commands, reply, counter)


def run_commands(
    loops: Loops,
    commands: IO[str],
    reply: Callable[[dict[str, Any]], None],
    counter: TryAgainCounter,
) -> None:
    steps = {"sl": loops.sl_step, "rl": loops.rl_step}
    for line in commands:
        command = json.loads(line)
        if command.get("quit"):
            break
        before = counter.count
        seconds, sampled = [], []
        for _ in range(command["steps"]):
            start = time.perf_counter()
            sampled.append(steps[command["loop"]]())
            seconds.append(time.perf_counter() - start)
        reply(
            {
                "loop": command["loop"],
                "seconds": seconds,
                "sampled_tokens": sampled,
                "try_again": counter.count - before,
            }
        )


def main() -> None:
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to stderr
    serve(sys.stdin, replies)


if __name__ == "__main__":
    main()
