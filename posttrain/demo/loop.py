"""The demo's training loop, a client of the API written with the official `together` SDK.

Supervised warm-up (cross-entropy on correct answers), then GRPO with an exact-match reward
(task.py): each step samples `group_size` completions for each of `prompts_per_step` training
prompts, scores them, turns rewards into group-relative advantages and takes one
`LOSS_TYPE_GRPO` forward-backward + optim-step + weights-sync.

Between the phases the warm-up session saves a training checkpoint, and RL runs in two new
sessions resumed from it: the policy, with a fresh optimizer, and the reference, never trained.
The reference's logprobs of the sampled tokens feed `reference_logprobs`, so every step reports
the KL of the policy from the warm-up policy (k3 estimator, as the GRPO loss computes it) at
the cost of one forward pass.

Greedy (temperature 0) accuracy on held-out problems is measured before the warm-up, after
it, and after RL. Nothing here runs on the server's side of the API: this module may import
`together`, the server packages never do.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, cast

from posttrain.config import BUILTIN_MODEL_ID, BUILTIN_MODELS
from posttrain.demo.task import (
    HeldoutExample,
    Problem,
    group_advantages,
    judged,
    reward,
    split_problems,
)

if TYPE_CHECKING:
    from together.post_training import LossConfig, Sample, SessionClient
    from together.types.post_training.lora_config_param import LoraConfigParam
    from together.types.post_training.model_input_param import ModelInput
    from transformers import PreTrainedTokenizerBase

# Seconds between operation polls: steps take a fraction of a second on the tiny model, and the
# SDK's 0.5 s default would spend most of the demo waiting.
POLL_INTERVAL_S = 0.02


@dataclass(frozen=True)
class DemoConfig:
    """Every knob of the demo. The defaults are the tuned full run (docs/demo.md)."""

    base_model: str = BUILTIN_MODEL_ID  # a built-in model (its tokenizer is read locally)
    seed: int = 0
    lora_rank: int = 64
    lora_alpha: int = 64
    num_heldout: int = 200
    warmup_steps: int = 210
    warmup_batch_size: int = 64
    warmup_learning_rate: float = 3e-3
    rl_steps: int = 90
    prompts_per_step: int = 64
    group_size: int = 4
    rl_learning_rate: float = 1e-4
    max_tokens: int = 5
    temperature: float = 1.0
    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.28
    beta: float = 0.0
    rl_loss: str = "grpo"
    updates_per_batch: int = 1
    warmup_token_mean: bool = False
    normalize_advantages: bool = False
    use_reference: bool = True


# `--quick`: the full warm-up and a third of the GRPO steps. GRPO needs a policy that already
# gets some answers right (a group whose samples all fail carries no signal); a shorter
# warm-up left one it lifted by +4 to +17.5 points depending on seed and machine (docs/demo.md).
QUICK = DemoConfig(rl_steps=30)


@dataclass
class StepRecord:
    """One optimizer step of either phase, as written to steps.jsonl."""

    phase: str
    step: int
    loss: float
    seconds: float
    num_tokens: int
    tokens_per_s: float
    reward: float | None = None
    kl: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class DemoResult:
    config: DemoConfig
    accuracy_base: float
    accuracy_warmup: float
    accuracy_rl: float
    steps: list[StepRecord]
    seconds: float
    examples: list[HeldoutExample] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "heldout_accuracy": {
                "base": self.accuracy_base,
                "after_warmup": self.accuracy_warmup,
                "after_rl": self.accuracy_rl,
            },
            "rl_gain_points": round(100 * (self.accuracy_rl - self.accuracy_warmup), 2),
            "seconds": round(self.seconds, 2),
            "examples": self.examples,
        }


def require_sdk() -> None:
    """Fail with the install line when the client SDK (the `examples` extra) is missing."""
    try:
        import together.post_training  # noqa: F401
    except ImportError:
        sys.exit(
            "posttrain demo needs the together SDK: pip install -e '.[examples]' "
            "(or pip install together==3.1.1)"
        )


class Tokens:
    """A built-in model's character-level tokenizer, loaded once on the client."""

    def __init__(self, base_model: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            BUILTIN_MODELS[base_model]
        )
        self.eos = int(self.tokenizer.eos_token_id)

    def encode(self, text: str) -> list[int]:
        tokens: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return tokens

    def decode(self, tokens: list[int]) -> str:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        assert isinstance(text, str), "one sequence of token ids decodes to one text"
        return text


@contextlib.contextmanager
def sdk_quiet() -> Iterator[None]:
    """Swallow what the SDK prints while it waits for a resource or session to be ready
    ("[session:...] ready in 0.0s"): the demo's progress bar says the same. Exceptions still
    propagate. The SDK prints from its own event-loop thread, hence a process-wide redirect."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


class DemoSample(TypedDict):
    """A training sample as the demo builds it: the SDK's Sample with its loss inputs as plain
    lists, which the SDK coerces to tensors before it sends them (sdk_samples)."""

    model_input: ModelInput
    loss_fn_inputs: dict[str, list[int] | list[float]]


def sdk_samples(samples: list[DemoSample]) -> list[Sample]:
    """`samples` as the SDK's type: its Sample types each loss input as a TensorData while its
    clients take plain lists too (the Sample docstring: a type-checked caller passing an array
    needs a cast)."""
    return cast("list[Sample]", samples)


def model_input(tokens: list[int]) -> ModelInput:
    return {"chunks": [{"encoded_text": {"tokens": tokens}}]}


def sft_sample(prompt: list[int], completion: list[int], weight: float = 1.0) -> DemoSample:
    """Cross-entropy sample: predict (prompt + completion)[1:], `weight` on the completion."""
    full = prompt + completion
    weights = [0.0] * (len(prompt) - 1) + [weight] * len(completion)
    return {
        "model_input": model_input(full[:-1]),
        "loss_fn_inputs": {"target_tokens": full[1:], "weights": weights},
    }


def policy_sample(
    prompt: list[int], completion: list[int], logprobs: list[float], advantage: float
) -> DemoSample:
    """GRPO sample: the sampler's logprobs and one advantage on every completion token; the
    prompt positions are masked out (their logprobs and advantages are placeholders)."""
    full = prompt + completion
    pad = len(prompt) - 1
    return {
        "model_input": model_input(full[:-1]),
        "loss_fn_inputs": {
            "target_tokens": full[1:],
            "logprobs": [0.0] * pad + logprobs,
            "advantages": [0.0] * pad + [advantage] * len(completion),
            "mask": [0] * pad + [1] * len(completion),
        },
    }


def heldout_accuracy(
    session: SessionClient, tokens: Tokens, problems: list[Problem], config: DemoConfig
) -> tuple[float, list[HeldoutExample]]:
    """Greedy accuracy of the session's published policy, plus a few judged answers."""
    results = session.generator.sample_batch(
        [model_input(tokens.encode(p.prompt)) for p in problems],
        num_samples=1,
        sampling_params={"max_tokens": config.max_tokens, "temperature": 0.0},
        interval=POLL_INTERVAL_S,
    )
    correct, examples = 0, list[HeldoutExample]()
    for problem, result in zip(problems, results, strict=True):
        sequence = result.sequences[0]
        text = tokens.decode([int(t) for t in sequence.tokens])
        example = judged(problem, text, stopped=sequence.stop_reason == "STOP_REASON_STOP")
        correct += example["correct"]
        if len(examples) < 8:
            examples.append(example)
    return correct / len(problems), examples


class StepLog:
    """Appends every step to steps.jsonl as it happens and keeps the records."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[StepRecord] = []
        path.write_text("")

    def add(self, record: StepRecord) -> None:
        self.records.append(record)
        with self.path.open("a") as handle:
            handle.write(json.dumps(asdict(record)) + "\n")


def warmup_step(
    policy: SessionClient, tokens: Tokens, batch: list[Problem], config: DemoConfig
) -> StepRecord:
    """One cross-entropy step on correct answers; the reported loss is per answer token."""
    started = time.monotonic()
    num_targets = sum(len(p.answer) + 1 for p in batch)
    weight = 1.0 / num_targets if config.warmup_token_mean else 1.0
    samples = [
        sft_sample(tokens.encode(p.prompt), tokens.encode(p.answer) + [tokens.eos], weight)
        for p in batch
    ]
    result = policy.trainer.forward_backward(
        samples=sdk_samples(samples),
        loss={"type": "LOSS_TYPE_CROSS_ENTROPY"},
        interval=POLL_INTERVAL_S,
    )
    policy.trainer.optim_step(
        adam_params={"learning_rate": config.warmup_learning_rate, "weight_decay": 0.0},
        interval=POLL_INTERVAL_S,
    )
    seconds = time.monotonic() - started
    num_tokens = sum(len(s["loss_fn_inputs"]["target_tokens"]) for s in samples)
    return StepRecord(
        phase="warmup",
        step=0,
        loss=result.loss if config.warmup_token_mean else result.loss / num_targets,
        seconds=seconds,
        num_tokens=num_tokens,
        tokens_per_s=num_tokens / seconds,
        metrics=dict(result.metrics or {}),
    )


def k3_kl(reference_logprob: float, logprob: float) -> float:
    """Schulman's k3 estimate of KL(policy || reference) from one sampled token: exp(u) - u - 1
    with u = reference - policy logprob, clamped like the server's GRPO loss (losses.md 9.2)."""
    u = max(-10.0, min(10.0, reference_logprob - logprob))
    return math.exp(u) - u - 1.0


def rl_loss_config(config: DemoConfig) -> LossConfig:
    if config.rl_loss == "grpo":
        return {
            "type": "LOSS_TYPE_GRPO",
            "grpo_params": {
                "clip_low_threshold": config.clip_low_threshold,
                "clip_high_threshold": config.clip_high_threshold,
                "beta": config.beta,
            },
        }
    if config.rl_loss == "ppo":
        return {
            "type": "LOSS_TYPE_PPO",
            "ppo_params": {
                "clip_low_threshold": config.clip_low_threshold,
                "clip_high_threshold": config.clip_high_threshold,
            },
        }
    # Any other loss by its short name, which the SDK's trainer expands to the LOSS_TYPE_
    # spelling (and refuses when it names no loss); its LossConfig type names the long one only.
    return cast("LossConfig", {"type": config.rl_loss})


def rl_step(
    policy: SessionClient,
    reference: SessionClient | None,
    tokens: Tokens,
    batch: list[Problem],
    config: DemoConfig,
    sample_seed: int,
) -> StepRecord:
    """Sample groups, reward, group-relative advantages, one GRPO update, weights-sync."""
    started = time.monotonic()
    prompts = [tokens.encode(p.prompt) for p in batch]
    results = policy.generator.sample_batch(
        [model_input(p) for p in prompts],
        num_samples=config.group_size,
        sampling_params={
            "max_tokens": config.max_tokens,
            "temperature": config.temperature,
            "seed": sample_seed,
        },
        interval=POLL_INTERVAL_S,
    )
    num_tokens, rewards, samples = 0, list[float](), list[DemoSample]()
    for problem, prompt, result in zip(batch, prompts, results, strict=True):
        completions = [[int(t) for t in s.tokens] for s in result.sequences]
        rewards_G = [
            reward(problem, tokens.decode(c), stopped=s.stop_reason == "STOP_REASON_STOP")
            for c, s in zip(completions, result.sequences, strict=True)
        ]
        rewards += rewards_G
        num_tokens += sum(len(prompt) + len(c) for c in completions)
        advantages_G = group_advantages(rewards_G, normalize=config.normalize_advantages)
        for completion, sequence, advantage in zip(
            completions, result.sequences, advantages_G, strict=True
        ):
            # A zero advantage contributes exactly zero gradient: skip the compute.
            if advantage != 0.0:
                samples.append(
                    policy_sample(prompt, completion, list(sequence.logprobs or []), advantage)
                )
    loss, metrics, kl = 0.0, dict[str, float](), None
    if samples:
        if reference is not None:
            scored = reference.trainer.forward(
                samples=sdk_samples(samples),
                loss={"type": "LOSS_TYPE_IMPORTANCE_SAMPLING"},
                interval=POLL_INTERVAL_S,
            )
            kl_sum, kl_count = 0.0, 0
            for sample, output in zip(samples, scored.loss_fn_outputs or [], strict=True):
                inputs = sample["loss_fn_inputs"]
                inputs["reference_logprobs"] = list(output.tensors["logprobs"].data)
                for ref, own, is_in in zip(
                    inputs["reference_logprobs"], inputs["logprobs"], inputs["mask"], strict=True
                ):
                    if is_in:
                        kl_sum += k3_kl(ref, own)
                        kl_count += 1
            kl = kl_sum / max(kl_count, 1)
        # Several updates on one batch (PPO-style epochs): the ratio to the sampler's logprobs
        # moves away from 1 after the first, and the GRPO clip bounds how far.
        for _ in range(config.updates_per_batch):
            update = policy.trainer.forward_backward(
                samples=sdk_samples(samples), loss=rl_loss_config(config), interval=POLL_INTERVAL_S
            )
            policy.trainer.optim_step(
                adam_params={"learning_rate": config.rl_learning_rate, "weight_decay": 0.0},
                interval=POLL_INTERVAL_S,
            )
        policy.trainer.weights_sync(interval=POLL_INTERVAL_S)
        trained = sum(len(s["loss_fn_inputs"]["target_tokens"]) for s in samples)
        num_tokens += trained * (config.updates_per_batch + (reference is not None))
        loss, metrics = update.loss, dict(update.metrics or {})
    seconds = time.monotonic() - started
    return StepRecord(
        phase="rl",
        step=0,
        loss=loss,
        seconds=seconds,
        num_tokens=num_tokens,
        tokens_per_s=num_tokens / seconds,
        reward=sum(rewards) / len(rewards),
        kl=kl,
        metrics=metrics,
    )


def run_demo(
    base_url: str,
    api_key: str,
    config: DemoConfig,
    out_dir: Path,
    *,
    on_step: Callable[[StepRecord, int], None] | None = None,
) -> DemoResult:
    """Warm-up then GRPO against the server at base_url; steps stream to out_dir/steps.jsonl.

    `on_step(record, total_steps)` is called after every step (the progress bar)."""
    from together.post_training import ModelResourcesClient

    started = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    log = StepLog(out_dir / "steps.jsonl")
    tokens = Tokens(config.base_model)
    train, heldout = split_problems(config.seed, config.num_heldout)
    rng = random.Random(config.seed + 1)
    total = config.warmup_steps + config.rl_steps

    def report(record: StepRecord) -> None:
        log.add(record)
        if on_step:
            on_step(record, total)

    lora: LoraConfigParam = {
        "rank": config.lora_rank,
        "alpha": config.lora_alpha,
        "seed": config.seed,
    }
    with sdk_quiet():
        resources = ModelResourcesClient.create(
            base_url=base_url, api_key=api_key, base_model=config.base_model, interval=0.2
        )
    with resources:
        with sdk_quiet():
            warm = resources.create_session(lora_config=lora, interval=0.2)
        with warm:
            accuracy_base, _ = heldout_accuracy(warm, tokens, heldout, config)
            for index in range(config.warmup_steps):
                batch = rng.sample(train, config.warmup_batch_size)
                report(replace(warmup_step(warm, tokens, batch, config), step=index + 1))
            warm.trainer.weights_sync(interval=POLL_INTERVAL_S)
            accuracy_warmup, _ = heldout_accuracy(warm, tokens, heldout, config)
            checkpoint = warm.create_training_checkpoint(interval=POLL_INTERVAL_S)
        # Two sessions from the warm-up's checkpoint. The policy starts a fresh optimizer:
        # the cross-entropy phase's Adam moments are scaled for its gradients, not for the
        # policy gradient's. The reference is never trained: the KL is measured from it.
        with sdk_quiet():
            policy = resources.create_session(
                resume_from_checkpoint_id=checkpoint.id, load_optimizer=False, interval=0.2
            )
            reference = (
                resources.create_session(
                    resume_from_checkpoint_id=checkpoint.id, load_optimizer=False, interval=0.2
                )
                if config.use_reference
                else None
            )
        with policy:
            policy.trainer.weights_sync(interval=POLL_INTERVAL_S)
            for index in range(config.rl_steps):
                batch = rng.sample(train, config.prompts_per_step)
                seed = config.seed * 1_000_003 + index * 10_007
                record = rl_step(policy, reference, tokens, batch, config, seed)
                report(replace(record, step=config.warmup_steps + index + 1))
            accuracy_rl, examples = heldout_accuracy(policy, tokens, heldout, config)
            if reference is not None:
                reference.stop()
    return DemoResult(
        config=config,
        accuracy_base=accuracy_base,
        accuracy_warmup=accuracy_warmup,
        accuracy_rl=accuracy_rl,
        steps=log.records,
        seconds=time.monotonic() - started,
        examples=examples,
    )
