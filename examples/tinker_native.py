"""The GRPO loop of grpo.py written for the tinker 0.38 SDK itself, on posttrain's Tinker surface.

    pip install tinker==0.38.0              # its own venv: the Together SDK pins tinker 0.23.1
    python examples/tinker_native.py        # starts `posttrain serve` itself
    python examples/tinker_native.py --base-url http://127.0.0.1:8000

A tinker loop runs on posttrain by pointing ServiceClient at the server (`base_url`, or
TINKER_BASE_URL) with any key that starts with `tml-` (the SDK refuses other keys before it
sends anything; a server with a keys file needs one of its keys). Nothing else changes: the
SDK speaks its own wire protocol, which `posttrain serve` answers at /api/v1 beside the
Together API. Tinker has no GRPO loss name, so the policy loss is "importance_sampling" (the
same surrogate, summed over tokens) with group-relative advantages; the stop is the tokenizer's
EOS token id, as tinker-cookbook's renderers send it.
"""

from __future__ import annotations

import os
import random

from _common import addition_problems, addition_reward, decode, encode, parser, server

BASE_MODEL = "posttrain/tiny-qwen3"
EOS = 0  # the built-in tokenizer's end-of-sequence id


def main() -> None:
    args_parser = parser(__doc__)
    args_parser.add_argument("--steps", type=int, default=10, help="training steps")
    args_parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    args_parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    args_parser.add_argument("--learning-rate", type=float, default=1e-3, help="Adam learning rate")
    args = args_parser.parse_args()
    import tinker  # the real SDK, 0.38

    api_key = os.environ.get("TINKER_API_KEY", "tml-local")
    train = addition_problems(seed=1, count=2000)
    rng = random.Random(0)
    with (
        server(args.base_url) as base_url,
        tinker.ServiceClient(base_url=base_url, api_key=api_key) as service,
    ):
        training = service.create_lora_training_client(base_model=BASE_MODEL, rank=16, seed=0)
        sampler = training.save_weights_and_get_sampling_client()
        for step in range(1, args.steps + 1):
            batch = rng.sample(train, args.prompts)
            params = tinker.SamplingParams(max_tokens=5, temperature=1.0, seed=step, stop=[EOS])
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
                sampler = training.save_weights_and_get_sampling_client()
            print(
                f"step {step:3d}  mean reward {sum(rewards) / len(rewards):.3f}  "
                f"trained samples {len(data):3d}  loss {loss:+.4f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
