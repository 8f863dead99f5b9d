"""posttrain through the official SDK against transformers + peft in process, on the same work
(a benchmark, not a timed test; issue 16).

One run, per model (`tiny`: the built-in posttrain/tiny-qwen3; `qwen3-40m`: the random 38M
Qwen3 config of bench/sampling.py, vocab 32k, seed 0, saved to a temporary directory). Both
sides load the same model directory in float32; posttrain is a real `posttrain serve`
subprocess driven by the unmodified SDK at its default polling, peft runs in this process.
Both sides run at their defaults: the server with its own thread count and OpenMP wait policy
(every usable core, idle threads sleeping: engine/hosts/threads.py), transformers + peft with
torch's (one thread per core, libgomp's spinning); both are printed.
LoRA rank 32, alpha 32, every rows' step is forward-backward + AdamW optim-step:

- fixed, head frozen: 8 x 256 tokens of cross-entropy; posttrain `train_unembed: false`,
  peft `target_modules="all-linear"` (which leaves lm_head out): the same adapted layers.
- fixed, head trained: the same batch; posttrain's default adapter (head trained) against
  peft with `lm_head` among its target modules.
- variable RL: 16 samples of a 64-token prompt plus 32..448 completion tokens (seed 0),
  importance_sampling with the prompt positions weighted 0 (mask 0, logprobs and advantages 0
  there); head frozen on both sides. peft runs the straightforward padded loop: one forward of
  the batch padded to its longest sample, full float32 log-softmax, the IS loss masked to the
  completion tokens.
- sampling (`sampling_rows`): 16 prompts x 128 tokens x 8 samples x 32 new tokens,
  temperature 1; posttrain: the 16 prompts' sample operations in flight at once
  (Generator.sample_async, gathered), peft: one `model.generate` of the 128 rows (the peft
  model with the head-frozen adapter). Tokens/s count generated tokens (EOS ends a row early on
  either side; each side counts what it generated).

Tokens/s count real (unpadded) tokens. Each row gets one untimed warm-up step of each side,
then --reps repetitions alternating the sides (posttrain first on even repetitions); printed
are medians, every run, and the ratio posttrain / peft as the ratio of medians and, in
brackets, the median of the per-repetition ratios (adjacent runs: robust to a shared
machine's load).

    python bench/side_by_side.py                    # both models, every row (~10 min, 2 CPUs)
    python bench/side_by_side.py --models qwen3-40m --rows fixed-frozen fixed-head --reps 5
    python bench/side_by_side.py --quick            # smoke run: tiny model, tiny shapes

Targets (issue 16, this 2-core CPU): fixed head frozen >= 1.2x, head trained >= 1.0x, variable
RL >= 1.5x the padded loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import peft
import torch
import transformers
from sdk_loops import API_KEY, FIRST_TOKEN, model_input, served_model
from together.post_training import ModelResourcesClient, SessionClient
from transformers import AutoModelForCausalLM

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID
from posttrain.demo.server import local_server
from posttrain.engine.hosts.threads import (
    intra_op_threads,
    openmp_wait_policy,
    server_wait_policy,
)

RANK = 32
ALPHA = 32
ADAM = {"learning_rate": 1e-4, "weight_decay": 0.0, "grad_clip_norm": 0.0}
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Sizes:
    rows: int  # fixed-length batch
    tokens: int
    rl_samples: int
    rl_prompt: int
    rl_min: int  # completion tokens
    rl_max: int
    prompts: int  # sampling
    prompt_tokens: int
    samples: int
    new_tokens: int


FULL = Sizes(8, 256, 16, 64, 32, 448, 16, 128, 8, 32)
QUICK = Sizes(2, 16, 3, 4, 2, 8, 2, 8, 2, 4)


@dataclass
class Side:
    """One side of a row: a step returning the tokens it processed."""

    step: Callable[[], int]
    runs: list[float] = field(default_factory=list)  # tokens/s


# ------------------------------------------------------------------ workloads


def ce_batch(rng: random.Random, vocab: int, sizes: Sizes) -> list[list[int]]:
    return [
        [rng.randrange(FIRST_TOKEN, vocab) for _ in range(sizes.tokens + 1)]
        for _ in range(sizes.rows)
    ]


@dataclass(frozen=True)
class RlSample:
    tokens: list[int]  # prompt + completion, the model input is tokens[:-1]
    prompt: int  # prompt tokens: positions < prompt - 1 are weighted 0
    sampler_logprobs: list[float]  # of the completion tokens
    advantage: float


def rl_batch(rng: random.Random, vocab: int, sizes: Sizes) -> list[RlSample]:
    batch = []
    for _ in range(sizes.rl_samples):
        length = sizes.rl_prompt + rng.randint(sizes.rl_min, sizes.rl_max)
        tokens = [rng.randrange(FIRST_TOKEN, vocab) for _ in range(length)]
        completion = length - sizes.rl_prompt
        logprobs = [-rng.uniform(5.0, 12.0) for _ in range(completion)]
        batch.append(RlSample(tokens, sizes.rl_prompt, logprobs, rng.uniform(-1.0, 1.0)))
    return batch


def sdk_ce_samples(batch: list[list[int]]) -> list[dict]:
    return [
        {
            "model_input": model_input(ids[:-1]),
            "loss_fn_inputs": {"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
        }
        for ids in batch
    ]


def sdk_rl_samples(batch: list[RlSample]) -> list[dict]:
    samples = []
    for s in batch:
        pad = s.prompt - 1
        completion = len(s.tokens) - s.prompt
        samples.append(
            {
                "model_input": model_input(s.tokens[:-1]),
                "loss_fn_inputs": {
                    "target_tokens": s.tokens[1:],
                    "logprobs": [0.0] * pad + s.sampler_logprobs,
                    "advantages": [0.0] * pad + [s.advantage] * completion,
                    "mask": [0.0] * pad + [1.0] * completion,
                },
            }
        )
    return samples


# ------------------------------------------------------------------ posttrain through the SDK


def posttrain_train_step(session: SessionClient, samples: list[dict], loss: dict) -> int:
    session.trainer.forward_backward(samples=samples, loss=loss)
    session.trainer.optim_step(adam_params=ADAM)
    return sum(len(s["loss_fn_inputs"]["target_tokens"]) for s in samples)


def posttrain_sample_step(session: SessionClient, prompts: list[list[int]], sizes: Sizes) -> int:
    params = {"max_tokens": sizes.new_tokens, "temperature": 1.0}

    async def gather() -> list:
        return await asyncio.gather(
            *(
                session.generator.sample_async(model_input(p), sizes.samples, params)
                for p in prompts
            )
        )

    results = asyncio.run(gather())
    return sum(len(s.tokens) for r in results for s in r.sequences)


# ------------------------------------------------------------------ transformers + peft


@dataclass
class PeftModel:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def peft_model(model_dir: str, targets: list[str]) -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets)
    model = peft.get_peft_model(base, config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    adam = torch.optim.AdamW(trainable, lr=ADAM["learning_rate"], betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=0.0)  # fmt: skip
    return PeftModel(model, adam)


def peft_ce_step(side: PeftModel, batch: list[list[int]]) -> int:
    ids = torch.tensor(batch)
    logits = side.model(input_ids=ids[:, :-1]).logits
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    loss = -logprobs.gather(-1, ids[:, 1:].unsqueeze(-1)).sum()
    loss.backward()
    side.optimizer.step()
    side.optimizer.zero_grad()
    return ids[:, 1:].numel()


def peft_rl_step(side: PeftModel, batch: list[RlSample]) -> int:
    """The padded loop: one forward of the batch padded to its longest sample."""
    width = max(len(s.tokens) for s in batch) - 1
    ids = torch.zeros(len(batch), width + 1, dtype=torch.int64)
    attention = torch.zeros(len(batch), width, dtype=torch.int64)
    sampler = torch.zeros(len(batch), width)
    advantages = torch.zeros(len(batch), width)
    mask = torch.zeros(len(batch), width)
    for row, s in enumerate(batch):
        n = len(s.tokens) - 1
        ids[row, : n + 1] = torch.tensor(s.tokens)
        attention[row, :n] = 1
        pad = s.prompt - 1
        sampler[row, pad:n] = torch.tensor(s.sampler_logprobs)
        advantages[row, pad:n] = s.advantage
        mask[row, pad:n] = 1.0
    logits = side.model(input_ids=ids[:, :-1], attention_mask=attention).logits
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    x = logprobs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    loss = -(torch.exp(torch.where(mask > 0, x - sampler, 0.0)) * advantages * mask).sum()
    loss.backward()
    side.optimizer.step()
    side.optimizer.zero_grad()
    return sum(len(s.tokens) - 1 for s in batch)


def peft_sample_step(side: PeftModel, prompts: list[list[int]], sizes: Sizes, eos: int) -> int:
    ids = torch.tensor(prompts).repeat_interleave(sizes.samples, dim=0)
    with torch.no_grad():
        out = side.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=sizes.new_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=eos,
            eos_token_id=eos,
        )
    new = out[:, ids.shape[1] :].tolist()
    return sum(row.index(eos) + 1 if eos in row else len(row) for row in new)


# ------------------------------------------------------------------ measuring


def measure(posttrain: Side, other: Side, reps: int) -> None:
    posttrain.step()  # warm-up, untimed
    other.step()
    for rep in range(reps):
        for side in (posttrain, other) if rep % 2 == 0 else (other, posttrain):
            start = time.perf_counter()
            tokens = side.step()
            side.runs.append(tokens / (time.perf_counter() - start))


def row_line(model: str, label: str, posttrain: Side, other: Side) -> str:
    ratio = statistics.median(posttrain.runs) / statistics.median(other.runs)
    paired = statistics.median(a / b for a, b in zip(posttrain.runs, other.runs, strict=True))
    return (
        f"{model:<10} {label:<14} posttrain {statistics.median(posttrain.runs):8.0f} tokens/s"
        f"  peft {statistics.median(other.runs):8.0f} tokens/s"
        f"  ratio {ratio:.2f}x ({paired:.2f}x)"
        f"  runs {[round(v) for v in posttrain.runs]} | {[round(v) for v in other.runs]}"
    )


def open_session(resources: ModelResourcesClient, train_unembed: bool) -> SessionClient:
    lora = {"rank": RANK, "alpha": ALPHA, "seed": 0, "train_unembed": train_unembed}
    return resources.create_session(lora_config=lora, interval=0.05)


def model_dir(base_model: str, extra_args: tuple[str, ...]) -> str:
    return str(BUILTIN_MODEL_DIR) if base_model == BUILTIN_MODEL_ID else extra_args[1]


def training_rows(
    name: str, rows: list[str], resources: ModelResourcesClient, directory: str, vocab: int,
    args: argparse.Namespace,
) -> list[str]:  # fmt: skip
    rng = random.Random(0)
    fixed = ce_batch(rng, vocab, args.sizes)
    rl = rl_batch(rng, vocab, args.sizes)
    plans = {
        "fixed-frozen": (False, "all-linear", sdk_ce_samples(fixed), {"type": "cross_entropy"},
                         lambda p: peft_ce_step(p, fixed)),
        "fixed-head": (True, [*LINEAR, "lm_head"], sdk_ce_samples(fixed),
                       {"type": "cross_entropy"}, lambda p: peft_ce_step(p, fixed)),
        "variable-rl": (False, "all-linear", sdk_rl_samples(rl),
                        {"type": "importance_sampling"}, lambda p: peft_rl_step(p, rl)),
    }  # fmt: skip
    lines = []
    for label in (r for r in plans if r in rows):
        train_unembed, targets, samples, loss, peft_step = plans[label]
        with contextlib.redirect_stdout(io.StringIO()):
            session = open_session(resources, train_unembed)
        other = peft_model(directory, targets)
        posttrain = Side(lambda s=session, x=samples, lo=loss: posttrain_train_step(s, x, lo))
        peft_side = Side(lambda o=other, f=peft_step: f(o))
        measure(posttrain, peft_side, args.reps)
        lines.append(row_line(name, label, posttrain, peft_side))
        print(lines[-1], flush=True)
    return lines


def sampling_rows(
    name: str, resources: ModelResourcesClient, directory: str, vocab: int, eos: int,
    args: argparse.Namespace,
) -> list[str]:  # fmt: skip
    """The sampling row: posttrain's sample operations against `generate` (issue 16 item 2's
    workload; the sampler itself is optimised elsewhere)."""
    rng = random.Random(1)
    sizes = args.sizes
    prompts = [
        [rng.randrange(FIRST_TOKEN, vocab) for _ in range(sizes.prompt_tokens)]
        for _ in range(sizes.prompts)
    ]
    with contextlib.redirect_stdout(io.StringIO()):
        session = open_session(resources, False)
    other = peft_model(directory, "all-linear")
    posttrain = Side(lambda: posttrain_sample_step(session, prompts, sizes))
    peft_side = Side(lambda: peft_sample_step(other, prompts, sizes, eos))
    measure(posttrain, peft_side, args.reps)
    line = row_line(name, "sampling", posttrain, peft_side)
    print(line, flush=True)
    return [line]


ROWS = ("fixed-frozen", "fixed-head", "variable-rl", "sampling")


def bench_model(name: str, args: argparse.Namespace) -> list[str]:
    with (
        served_model(name) as (base_model, extra_args, vocab),
        local_server(extra_args=extra_args) as base_url,
    ):
        with contextlib.redirect_stdout(io.StringIO()):
            resources = ModelResourcesClient.create(
                base_url=base_url, api_key=API_KEY, base_model=base_model, interval=0.05
            )
        try:
            directory = model_dir(base_model, extra_args)
            lines = training_rows(name, args.rows, resources, directory, vocab, args)
            if "sampling" in args.rows:
                config = AutoModelForCausalLM.from_pretrained(directory).config
                eos = config.eos_token_id
                eos = eos[0] if isinstance(eos, list) else eos
                lines += sampling_rows(name, resources, directory, vocab, eos, args)
        finally:
            with contextlib.redirect_stdout(io.StringIO()):
                resources.stop(force=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=["tiny", "qwen3-40m"])
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--reps", type=int, help="repetitions (default 5; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model and shapes")
    args = parser.parse_args()
    args.models = args.models or (["tiny"] if args.quick else ["tiny", "qwen3-40m"])
    args.reps = args.reps or (1 if args.quick else 5)
    args.sizes = QUICK if args.quick else FULL
    transformers.utils.logging.disable_progress_bar()  # from_pretrained's weight-loading bar
    omp = os.environ.get("OMP_NUM_THREADS", "unset")
    print(
        f"torch {torch.__version__}, peft {peft.__version__}; OMP_NUM_THREADS={omp}, torch"
        f" threads {torch.get_num_threads()} here ({openmp_wait_policy()} waits), server at its"
        f" defaults ({intra_op_threads(None)} threads, {server_wait_policy()} waits); float32,"
        f" LoRA rank {RANK}; load average {os.getloadavg()[0]:.2f}; sizes {args.sizes}"
    )
    lines = []
    for name in args.models:
        lines += bench_model(name, args)
    print(f"\nmedians (ratio: posttrain / peft); load average {os.getloadavg()[0]:.2f}")
    for line in lines:
        print(line.split("  runs")[0])


if __name__ == "__main__":
    main()
