"""Scenarios with images run by the real tinker 0.38 SDK against a posttrain server serving a
vision-language model; each prints one JSON object on its last stdout line for
tests/integration/test_tinker_vision.py to check.

Run with the tinker 0.38 interpreter (tests/tinker_env.py):
`python vision_client.py SCENARIO URL MODEL PNG_DIR`. PNG_DIR holds the images (`a.png`,
`b.png`) and `tokens.json` (each image's placeholder count). Nothing here imports posttrain:
this is what a user's loop does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import tinker
import torch
from tinker import types

API_KEY = "tml-posttrain-test"
VISION_START, VISION_END = 99, 100


def image_datum(
    data: bytes, count: int, before: list[int], after: list[int]
) -> tuple[types.Datum, list[int]]:
    """A cross-entropy datum over before + <vision_start> image <vision_end> + after (weights 0
    at the image), and its target tokens."""
    chunks: list[types.ModelInputChunk] = [
        types.EncodedTextChunk(tokens=[*before, VISION_START]),
        types.ImageChunk(data=data, format="png", expected_tokens=count),
        types.EncodedTextChunk(tokens=[VISION_END, *after[:-1]]),
    ]
    model_input = types.ModelInput(chunks=chunks)
    image_start = len(before) + 1
    # Targets: the next token; inside the image any token (weight 0), here 0.
    sequence = [*before, VISION_START, *[0] * count, VISION_END, *after]
    targets = sequence[1:]
    weights = [
        0.0 if image_start - 1 <= i < image_start + count else 1.0 for i in range(len(targets))
    ]
    assert model_input.length == len(targets)
    datum = types.Datum(
        model_input=model_input,
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=targets, dtype="int64"),
            "weights": types.TensorData(data=weights, dtype="float32"),
        },
    )
    return datum, targets


def train(url: str, model: str, png_dir: str) -> dict:
    root = Path(png_dir)
    counts = json.loads((root / "tokens.json").read_text())
    a, b = (root / "a.png").read_bytes(), (root / "b.png").read_bytes()
    first, _ = image_datum(a, counts["a"], [1, 5, 6], [7, 8, 9, 10])
    second, _ = image_datum(b, counts["b"], [1, 11], [12, 13, 14, 15, 16])
    out: dict[str, object] = {}
    with tinker.ServiceClient(base_url=url, api_key=API_KEY) as client:
        training = client.create_lora_training_client(base_model=model, rank=4, seed=1)
        forward = training.forward([first, second], "cross_entropy").result()
        out["forward"] = [[float(x) for x in o["logprobs"].data] for o in forward.loss_fn_outputs]
        losses = []
        for _ in range(4):
            result = training.forward_backward([first, second], "cross_entropy").result()
            losses.append(result.metrics["loss:sum"])
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        out["losses"] = losses
        # A custom loss, -sum(weights * logprobs), is cross-entropy: the same loss and logprobs.
        custom_run = client.create_lora_training_client(base_model=model, rank=4, seed=1)

        def negated(data: list[types.Datum], logprobs: list[torch.Tensor]):
            weights = [d.loss_fn_inputs["weights"].to_torch() for d in data]
            loss = -sum((w * x).sum() for w, x in zip(weights, logprobs, strict=True))
            return loss, {"custom": float(loss)}

        custom = custom_run.forward_backward_custom([first, second], negated).result()
        out["custom_loss"] = custom.metrics["custom"]
        # The base model's sampler scores what the first forward scored.
        sampler = client.create_sampling_client(base_model=model)
        out["scored"] = sampler.compute_logprobs(first.model_input).result()
        # The placeholder id stops a sequence: the random model samples it often.
        params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=5, stop=[101])
        sampled = sampler.sample(first.model_input, 2, params).result()
        out["samples"] = []
        for sequence in sampled.sequences:
            extended = types.ModelInput(
                chunks=[*first.model_input.chunks, types.EncodedTextChunk(tokens=sequence.tokens)]
            )
            rescored = sampler.compute_logprobs(extended).result()
            out["samples"].append(
                {"logprobs": sequence.logprobs, "rescored": rescored[-len(sequence.tokens) :]}
            )
        wrong, _ = image_datum(a, counts["a"] + 1, [1, 5, 6], [7, 8, 9, 10])
        corrupt, _ = image_datum(a[:50], counts["a"], [1, 5, 6], [7, 8, 9, 10])
        for name, datum in (("wrong_count", wrong), ("corrupt", corrupt)):
            run = client.create_lora_training_client(base_model=model, rank=4, seed=2)
            try:
                run.forward_backward([first, datum], "cross_entropy").result()
                out[name] = "no error"
            except Exception as exc:  # noqa: BLE001 - the message is what is checked
                out[name] = f"{type(exc).__name__}: {exc}"
    return out


SCENARIOS = {"train": train}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](*sys.argv[2:])))
