"""A loss the server does not have, computed on the client: DPO through custom-forward-backward.

    python examples/custom_loss.py                   # starts `posttrain serve` itself
    python examples/custom_loss.py --base-url http://127.0.0.1:8000 --steps 20

custom-forward-backward takes, for every target token, the gradient of *your* loss with respect
to that token's logprob, dL/dlogp, and back-propagates sum_t g_t * logp_t through the model.
So any loss that is a function of per-token logprobs works:

  1. trainer.forward(...) returns the current per-token logprobs of each sample;
  2. torch on the client computes the loss from them and autograd gives dL/dlogp;
  3. trainer.custom_forward_backward(samples, gradients) applies it; optim-step as usual.

The loss here is DPO (Rafailov et al. 2023, arXiv 2305.18290) on addition: for each prompt the
correct sum is "chosen" and a wrong one "rejected"; the reference policy is the model before
training, scored once at the start.
    L = -log sigmoid(beta * ((lp_w - ref_w) - (lp_l - ref_l))),  lp = summed answer logprobs.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from _common import API_KEY, BASE_MODEL, encode, eos, model_input, parser, server

if TYPE_CHECKING:
    import torch

BETA = 0.5


def scored_sample(prompt: str, answer: str) -> dict:
    """A sample whose weights select the answer tokens: forward() returns their logprobs."""
    prompt_ids, answer_ids = encode(prompt), encode(answer) + [eos()]
    tokens = prompt_ids + answer_ids
    return {
        "model_input": model_input(tokens[:-1]),
        "loss_fn_inputs": {
            "target_tokens": tokens[1:],
            "weights": [0.0] * (len(prompt_ids) - 1) + [1.0] * len(answer_ids),
        },
    }


def preference_pairs(seed: int, count: int) -> list[tuple[dict, dict]]:
    """(chosen, rejected) samples: the right sum versus the sum off by 10 or 1."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        wrong = a + b + rng.choice([-10, 10, -1, 1])
        prompt = f"<|im_start|>{a}+{b}="
        pairs.append((scored_sample(prompt, f"{a + b}\n"), scored_sample(prompt, f"{wrong}\n")))
    return pairs


def answer_logprobs(trainer, samples: list[dict]) -> list[torch.Tensor]:
    """Per-token logprobs of every sample; forward() returns 0.0 where the weight is 0."""
    import torch

    result = trainer.forward(samples=samples, loss={"type": "cross_entropy"})
    return [torch.tensor(out.tensors["logprobs"].data) for out in result.loss_fn_outputs]


def answer_mask(sample: dict) -> torch.Tensor:
    import torch

    return torch.tensor(sample["loss_fn_inputs"]["weights"])


def main() -> None:
    args_parser = parser(__doc__)
    args_parser.add_argument("--steps", type=int, default=15, help="DPO steps")
    args_parser.add_argument("--pairs", type=int, default=32, help="preference pairs per step")
    args_parser.add_argument("--learning-rate", type=float, default=2e-3, help="Adam learning rate")
    args = args_parser.parse_args()
    # After --help: torch and the SDK take seconds to load.
    import torch
    import torch.nn.functional as F
    from together.post_training import ModelResourcesClient

    pairs = preference_pairs(seed=0, count=args.pairs)
    samples = [s for pair in pairs for s in pair]  # chosen, rejected, chosen, rejected, ...
    with (
        server(args.base_url) as base_url,
        ModelResourcesClient.create(
            base_url=base_url, api_key=API_KEY, base_model=BASE_MODEL
        ) as resources,
        resources.create_session(lora_config={"rank": 16, "seed": 0}) as session,
    ):
        trainer = session.trainer
        masks = [answer_mask(s) for s in samples]
        reference = torch.stack(
            [(lp * m).sum() for lp, m in zip(answer_logprobs(trainer, samples), masks, strict=True)]
        )
        for step in range(1, args.steps + 1):
            leaves = [lp.requires_grad_() for lp in answer_logprobs(trainer, samples)]
            # Masked sums: the prompt positions (placeholders) get exactly zero gradient.
            policy = torch.stack([(lp * m).sum() for lp, m in zip(leaves, masks, strict=True)])
            shifted = policy - reference
            margin_P = BETA * (shifted[0::2] - shifted[1::2])
            loss = -F.logsigmoid(margin_P).mean()
            loss.backward()
            gradients = [{"data": leaf.grad.tolist(), "dtype": "D_TYPE_FLOAT32"} for leaf in leaves]
            trainer.custom_forward_backward(samples=samples, gradients=gradients)
            trainer.optim_step(
                adam_params={"learning_rate": args.learning_rate, "weight_decay": 0.0}
            )
            accuracy = float((margin_P > 0).float().mean())
            print(
                f"step {step:3d}  dpo loss {loss.item():.4f}  "
                f"mean margin {margin_P.mean().item():+.3f}  preference accuracy {accuracy:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
