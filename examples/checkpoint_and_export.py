"""Save, resume, export: a training checkpoint, a resumed session, a merged model in transformers.

    python examples/checkpoint_and_export.py         # starts `posttrain serve` itself
    python examples/checkpoint_and_export.py --base-url http://127.0.0.1:8000 --out ./export

1. A few cross-entropy steps on addition, then `create_training_checkpoint()`: adapter weights
   and optimizer state, stored on the server.
2. A new session resumed from it (`resume_from_checkpoint_id`, `load_optimizer=True`) scores a
   probe exactly as the original does, and trains on from the same step.
3. `create_inference_checkpoint()`, then `download_checkpoint(..., variant="MERGED")`: the base
   model with the LoRA adapter merged in, as a Hugging Face directory that plain
   `AutoModelForCausalLM.from_pretrained` loads, and that answers as the server does.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

from _common import (
    API_KEY,
    BASE_MODEL,
    addition_problems,
    decode,
    encode,
    eos,
    model_input,
    parser,
    server,
)

if TYPE_CHECKING:
    import torch

ADAM = {"learning_rate": 3e-3, "weight_decay": 0.0}


def sft_sample(prompt: str, answer: str) -> dict:
    prompt_ids, answer_ids = encode(prompt), encode(answer) + [eos()]
    tokens = prompt_ids + answer_ids
    return {
        "model_input": model_input(tokens[:-1]),
        "loss_fn_inputs": {
            "target_tokens": tokens[1:],
            "weights": [0.0] * (len(prompt_ids) - 1) + [1.0] * len(answer_ids),
        },
    }


def train(session, batch: list[dict], steps: int) -> list[float]:
    """Cross-entropy steps; the losses, rounded for printing (the runs compare exactly)."""
    losses = []
    for _ in range(steps):
        result = session.trainer.forward_backward(samples=batch, loss={"type": "cross_entropy"})
        session.trainer.optim_step(adam_params=ADAM)
        losses.append(round(result.loss, 4))
    return losses


def probe_logprobs(session, probe: dict) -> torch.Tensor:
    import torch

    result = session.trainer.forward(samples=[probe], loss={"type": "cross_entropy"})
    return torch.tensor(result.loss_fn_outputs[0].tensors["logprobs"].data)


def main() -> None:
    args_parser = parser(__doc__)
    args_parser.add_argument("--steps", type=int, default=10, help="training steps")
    args_parser.add_argument(
        "--out", type=Path, default=Path("posttrain-export"), help="where the merged model goes"
    )
    args = args_parser.parse_args()
    # After --help: torch, transformers and the SDK take seconds to load.
    import torch
    from together import Together
    from together.post_training import ModelResourcesClient, download_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rng = random.Random(0)
    problems = addition_problems(seed=1, count=200)
    batch = [sft_sample(p, a) for p, a in rng.sample(problems, 32)]
    probe = sft_sample(*problems[0])
    with (
        server(args.base_url) as base_url,
        ModelResourcesClient.create(
            base_url=base_url, api_key=API_KEY, base_model=BASE_MODEL
        ) as resources,
    ):
        with resources.create_session(lora_config={"rank": 16, "seed": 0}) as session:
            losses = train(session, batch, args.steps)
            print(f"trained {args.steps} steps: loss {losses[0]:.2f} -> {losses[-1]:.2f}")
            checkpoint = session.create_training_checkpoint()
            print(f"training checkpoint {checkpoint.id} at step {checkpoint.step}")
            original = probe_logprobs(session, probe)
            next_losses = train(session, batch, 2)

        with resources.create_session(
            resume_from_checkpoint_id=checkpoint.id, load_optimizer=True
        ) as resumed:
            drift = (probe_logprobs(resumed, probe) - original).abs().max().item()
            print(
                f"resumed session {resumed.session_id}: step {resumed.retrieve().step}, "
                f"probe logprob max |diff| {drift:.1e}"
            )
            resumed_losses = train(resumed, batch, 2)
            same = resumed_losses == next_losses
            print(f"next 2 losses: original {next_losses} resumed {resumed_losses} same {same}")
            resumed.trainer.weights_sync()
            inference = resumed.create_inference_checkpoint()
            prompt, answer = problems[1]
            served = resumed.generator.sample(
                model_input(encode(prompt)),
                num_samples=1,
                sampling_params={"max_tokens": 5, "temperature": 0.0},
            ).sequences[0]

        client = Together(base_url=base_url, api_key=API_KEY)
        files = download_checkpoint(
            client, inference.id, variant="CHECKPOINT_VARIANT_MERGED", output_dir=args.out
        )
        print(f"merged model in {args.out}: {', '.join(sorted(p.name for p in files))}")
        model = AutoModelForCausalLM.from_pretrained(args.out).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.out)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            generated = model.generate(
                prompt_ids,
                max_new_tokens=5,
                do_sample=False,
                eos_token_id=eos(),
                pad_token_id=eos(),
            )[0, prompt_ids.shape[1] :].tolist()
        local, remote = decode(generated), decode(served.tokens)
        print(
            f"{prompt[12:]} transformers {local!r} server {remote!r} "
            f"(answer {answer!r}) match {local == remote}"
        )


if __name__ == "__main__":
    main()
