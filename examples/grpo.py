"""GRPO on two-digit addition: several samples per prompt, group-relative advantages.

    python examples/grpo.py                          # starts `posttrain serve` itself
    python examples/grpo.py --base-url http://127.0.0.1:8000 --steps 20

Each step samples `--group-size` completions for each of `--prompts` prompts, rewards each
completion 1.0 if it is exactly the sum (program-checked; with partial credit for the
untrained model, see _common.addition_reward), subtracts the group's mean reward to
get every sample's advantage (DeepSeekMath's GRPO, arXiv 2402.03300, without the std division
as in Dr. GRPO, arXiv 2503.20783), and trains with LOSS_TYPE_GRPO on the sampler's logprobs.
Groups whose samples all scored the same carry no signal and are not sent. Then optim-step
and weights-sync, so the next step samples from the updated policy.

`posttrain demo` is this loop plus a supervised warm-up, a reference model for the KL, a
progress bar and a plot.
"""

from __future__ import annotations

import random

from _common import (
    API_KEY,
    BASE_MODEL,
    addition_problems,
    addition_reward,
    decode,
    encode,
    model_input,
    parser,
    server,
)


def grpo_sample(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float):
    """Train on the completion only: prompt positions are masked out."""
    full = prompt + tokens
    pad = len(prompt) - 1
    return {
        "model_input": model_input(full[:-1]),
        "loss_fn_inputs": {
            "target_tokens": full[1:],
            "logprobs": [0.0] * pad + logprobs,
            "advantages": [0.0] * pad + [advantage] * len(tokens),
            "mask": [0] * pad + [1] * len(tokens),
        },
    }


def main() -> None:
    args_parser = parser(__doc__)
    args_parser.add_argument("--steps", type=int, default=20, help="GRPO steps")
    args_parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    args_parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    args_parser.add_argument("--learning-rate", type=float, default=1e-3, help="Adam learning rate")
    args = args_parser.parse_args()
    from together.post_training import ModelResourcesClient  # after --help: it loads torch

    train = addition_problems(seed=1, count=2000)
    rng = random.Random(0)
    with (
        server(args.base_url) as base_url,
        ModelResourcesClient.create(
            base_url=base_url, api_key=API_KEY, base_model=BASE_MODEL
        ) as resources,
        resources.create_session(lora_config={"rank": 16, "seed": 0}) as session,
    ):
        for step in range(1, args.steps + 1):
            batch = rng.sample(train, args.prompts)
            prompts = [encode(prompt) for prompt, _ in batch]
            results = session.generator.sample_batch(
                [model_input(p) for p in prompts],
                num_samples=args.group_size,
                sampling_params={"max_tokens": 5, "temperature": 1.0, "seed": step},
            )
            samples, rewards = [], []
            for (_, answer), prompt, result in zip(batch, prompts, results, strict=True):
                group = [
                    addition_reward(
                        decode(s.tokens), answer, stopped=s.stop_reason == "STOP_REASON_STOP"
                    )
                    for s in result.sequences
                ]
                rewards += group
                mean = sum(group) / len(group)
                for sequence, r in zip(result.sequences, group, strict=True):
                    if r != mean:
                        tokens = [int(t) for t in sequence.tokens]
                        samples.append(
                            grpo_sample(prompt, tokens, list(sequence.logprobs), r - mean)
                        )
            loss = 0.0
            if samples:
                result = session.trainer.forward_backward(
                    samples=samples,
                    loss={
                        "type": "grpo",
                        "grpo_params": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28},
                    },
                )
                loss = result.loss
                session.trainer.optim_step(
                    adam_params={"learning_rate": args.learning_rate, "weight_decay": 0.0}
                )
                session.trainer.weights_sync()
            print(
                f"step {step:3d}  mean reward {sum(rewards) / len(rewards):.3f}  "
                f"trained samples {len(samples):3d}  loss {loss:+.5f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
