"""Supervised fine-tuning (cross-entropy) of the built-in model on two-digit addition.

    python examples/sft.py                          # starts `posttrain serve` itself
    python examples/sft.py --base-url http://127.0.0.1:8000 --steps 100

Each step: one forward-backward with LOSS_TYPE_CROSS_ENTROPY on a batch of "<|im_start|>a+b="
prompts with their answers (weight 1 on the answer tokens, 0 on the prompt), then one
optim-step. Prints the loss per answer token and, before and after, the greedy accuracy on
held-out problems.
"""

from __future__ import annotations

import random

from _common import (
    API_KEY,
    BASE_MODEL,
    addition_problems,
    encode,
    eos,
    greedy_accuracy,
    model_input,
    parser,
    server,
)


def sft_sample(prompt: str, answer: str) -> dict:
    """Predict (prompt + answer)[1:] from (prompt + answer)[:-1]; only the answer counts."""
    prompt_ids, answer_ids = encode(prompt), encode(answer) + [eos()]
    tokens = prompt_ids + answer_ids
    return {
        "model_input": model_input(tokens[:-1]),
        "loss_fn_inputs": {
            "target_tokens": tokens[1:],
            "weights": [0.0] * (len(prompt_ids) - 1) + [1.0] * len(answer_ids),
        },
    }


def main() -> None:
    args_parser = parser(__doc__)
    args_parser.add_argument("--steps", type=int, default=60, help="training steps")
    args_parser.add_argument("--batch-size", type=int, default=64, help="problems per step")
    args_parser.add_argument("--learning-rate", type=float, default=3e-3, help="Adam learning rate")
    args_parser.add_argument(
        "--num-problems", type=int, default=5000, help="size of the training set"
    )
    args = args_parser.parse_args()
    from together.post_training import ModelResourcesClient  # after --help: it loads torch

    train = addition_problems(seed=1, count=args.num_problems)
    heldout = addition_problems(seed=2, count=100)
    rng = random.Random(0)
    with (
        server(args.base_url) as base_url,
        ModelResourcesClient.create(
            base_url=base_url, api_key=API_KEY, base_model=BASE_MODEL
        ) as resources,
        resources.create_session(lora_config={"rank": 32, "alpha": 32, "seed": 0}) as session,
    ):
        before = greedy_accuracy(session, heldout)
        for step in range(1, args.steps + 1):
            batch = [rng.choice(train) for _ in range(args.batch_size)]
            result = session.trainer.forward_backward(
                samples=[sft_sample(p, a) for p, a in batch], loss={"type": "cross_entropy"}
            )
            session.trainer.optim_step(
                adam_params={"learning_rate": args.learning_rate, "weight_decay": 0.0}
            )
            num_targets = sum(len(a) + 1 for _, a in batch)
            print(f"step {step:3d}  loss/token {result.loss / num_targets:.4f}", flush=True)
        session.trainer.weights_sync()
        after = greedy_accuracy(session, heldout)
        print(f"held-out greedy accuracy: {before:.1%} -> {after:.1%}")


if __name__ == "__main__":
    main()
