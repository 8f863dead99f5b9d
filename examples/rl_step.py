"""One RL step against a posttrain server, written with the official together SDK.

    python examples/rl_step.py                       # starts `posttrain serve` itself
    python examples/rl_step.py --base-url http://127.0.0.1:8000

sample -> score the samples (forward_only) -> importance-sampling forward-backward with the
sampler's logprobs and reward-derived advantages -> optim-step -> weights-sync -> sample again.
The reward here is a toy: the completion should start with the right digit of 12+34=46.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from together.post_training import ModelResourcesClient
from transformers import AutoTokenizer

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID

API_KEY = os.environ.get("TOGETHER_API_KEY", "local-key")


@contextmanager
def local_server() -> Iterator[str]:
    """`posttrain serve` on a free port, stopped on exit."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "posttrain",
            "serve",
            "--port",
            str(port),
            "--data-dir",
            "posttrain-data",
            "--log-level",
            "warning",
        ],
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                httpx.get(f"{base_url}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield base_url
    finally:
        process.terminate()
        process.wait(timeout=30)


def reward(text: str) -> float:
    return 1.0 if text.startswith("46") else (0.5 if text.startswith("4") else 0.0)


def run(base_url: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
    prompt = tokenizer.encode("<|im_start|>12+34=", add_special_tokens=False)
    model_input = {"chunks": [{"encoded_text": {"tokens": prompt}}]}
    with (
        ModelResourcesClient.create(
            base_url=base_url, api_key=API_KEY, base_model=BUILTIN_MODEL_ID, interval=0.5
        ) as resources,
        resources.create_session(lora_config={"rank": 8}, interval=0.5) as session,
    ):
        trainer, generator = session.trainer, session.generator
        result = generator.sample(
            model_input, num_samples=8, sampling_params={"max_tokens": 6, "temperature": 1.0}
        )
        texts = [tokenizer.decode(s.tokens) for s in result.sequences]
        rewards = [reward(t) for t in texts]
        mean = sum(rewards) / len(rewards)
        print(f"policy v{result.policy_segments[0].version} samples: {texts}")
        print(f"rewards {rewards} (mean {mean:.3f})")
        samples = []
        for sequence, r in zip(result.sequences, rewards, strict=True):
            full = prompt + sequence.tokens
            pad = [0.0] * (len(prompt) - 1)
            samples.append(
                {
                    "model_input": {"chunks": [{"encoded_text": {"tokens": full[:-1]}}]},
                    "loss_fn_inputs": {
                        "target_tokens": full[1:],
                        "logprobs": pad + sequence.logprobs,
                        "advantages": pad + [r - mean] * len(sequence.tokens),
                        "mask": [0] * len(pad) + [1] * len(sequence.tokens),
                    },
                }
            )
        scored = trainer.forward(samples=samples, loss={"type": "importance_sampling"})
        drift = max(
            abs(a - b)
            for s, out in zip(result.sequences, scored.loss_fn_outputs, strict=True)
            for a, b in zip(
                out.tensors["logprobs"].data[len(prompt) - 1 :], s.logprobs, strict=True
            )
        )
        print(f"trainer vs sampler logprob max |diff| = {drift:.2e}")
        step = trainer.forward_backward(samples=samples, loss={"type": "importance_sampling"})
        print(f"importance-sampling loss {step.loss:.4f} metrics {step.metrics}")
        print(f"optim-step -> step {trainer.optim_step(adam_params={'learning_rate': 1e-3}).step}")
        print(f"weights-sync -> version {trainer.weights_sync().weights_version}")
        again = generator.sample(model_input, num_samples=4, sampling_params={"max_tokens": 6})
        print(
            f"policy v{again.policy_segments[0].version} samples: "
            f"{[tokenizer.decode(s.tokens) for s in again.sequences]}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", help="a running server; omitted: start one")
    args = parser.parse_args()
    if args.base_url:
        run(args.base_url)
        return
    with local_server() as base_url:
        run(base_url)


if __name__ == "__main__":
    main()
