"""One RL step against a posttrain server, written with the official together SDK.

    python examples/rl_step.py                       # starts `posttrain serve` itself
    python examples/rl_step.py --base-url http://127.0.0.1:8000

sample -> score the samples (forward_only) -> importance-sampling forward-backward with the
sampler's logprobs and reward-derived advantages -> optim-step -> weights-sync -> sample again.
The reward here is a toy: the completion should start with the right digit of 12+34=46.
"""

from __future__ import annotations

from _common import API_KEY, BASE_MODEL, parser, server, tokenizer


def reward(text: str) -> float:
    return 1.0 if text.startswith("46") else (0.5 if text.startswith("4") else 0.0)


def run(base_url: str) -> None:
    from together.post_training import ModelResourcesClient  # after --help: it loads torch

    decode = tokenizer().decode
    prompt = tokenizer().encode("<|im_start|>12+34=", add_special_tokens=False)
    model_input = {"chunks": [{"encoded_text": {"tokens": prompt}}]}
    with (
        ModelResourcesClient.create(
            base_url=base_url, api_key=API_KEY, base_model=BASE_MODEL, interval=0.5
        ) as resources,
        resources.create_session(lora_config={"rank": 8}, interval=0.5) as session,
    ):
        trainer, generator = session.trainer, session.generator
        result = generator.sample(
            model_input, num_samples=8, sampling_params={"max_tokens": 6, "temperature": 1.0}
        )
        texts = [decode(s.tokens) for s in result.sequences]
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
            f"{[decode(s.tokens) for s in again.sequences]}"
        )


def main() -> None:
    args = parser(__doc__).parse_args()
    with server(args.base_url) as base_url:
        run(base_url)


if __name__ == "__main__":
    main()
