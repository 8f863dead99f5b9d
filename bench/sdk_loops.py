"""Training loops through the unmodified together SDK: steps/s at the SDK's default polling vs
10 ms polling, and how much of the wall time the engine is busy (a benchmark, not a timed test).

Starts a real `posttrain serve` per model and drives one model resource with the official SDK
(together 3.1.1), one LoRA session (rank 8) per loop:

1. sft: the high-level Trainer; forward-backward (cross-entropy, 8 samples of 128 random
   tokens) then optim-step.
2. grpo: the high-level Generator, one sample operation per prompt group, called one after the
   other (8 groups of 4 samples, 16-token prompts, up to 16 new tokens); then a GRPO
   forward-backward on group-relative advantages of a toy reward, optim-step, weights-sync.
3. shim-rl: tinker-cookbook's RL loop through the tinker shim: one `num_samples=1` sample per
   rollout, all 64 rollouts (16 prompts x 4; 8-token prompts, up to 8 new tokens) in flight at
   once as futures (asyncio.gather of `sample_async`, as the cookbook's completer does); then
   forward-backward (importance_sampling) and optim-step submitted back to back and awaited,
   then `save_weights_and_get_sampling_client`.
4. dpo: a DPO loss (Rafailov et al. 2023, arXiv 2305.18290) written on the client, as in
   examples/custom_loss.py: Trainer.forward for the current logprobs of 8 chosen/rejected pairs
   (16 prompt + 16 answer tokens), torch autograd for dL/dlogp, custom_forward_backward,
   optim-step. The reference logprobs are scored once, untimed.

Each loop runs one untimed warm-up step, then --reps repetitions of --steps steps in each
polling mode (the order of the modes alternates between repetitions):

- default: the SDK as shipped. Every wait GETs once right after the POST, then sleeps 0.5 s
  between GETs (reference/api.md section 2.5).
- 10ms: Trainer and Generator calls get `interval=0.01`, the SDK's own keyword. The shim has no
  such knob: its futures read the module constant
  `together.post_training._operations.DEFAULT_OPERATION_INTERVAL` when they are collected, and
  `save_weights_and_get_sampling_client` waits with the `interval` default of
  `Trainer.weights_sync_async`, bound when the SDK is imported. In this mode only, both are
  patched to 0.01 s for the duration of the shim loop's steps and restored after (the output
  says so).

Printed per loop: steps/s in each mode (medians; every run), the ratio of wall time per step
default / 10ms (ratio of medians, and the median of per-repetition ratios, whose runs are
adjacent in time), and the engine's busy time as a share of each phase's wall time. Busy time
is the delta, over the phase, of `posttrain_worker_busy_seconds_total` on GET /metrics (seconds
the resource worker threads spent running jobs, summed over its labels); where the server does
not export it, the fallback is the delta of `posttrain_operation_duration_seconds_sum` summed
over kinds, and the output says so (that sum charges every operation of a shared pass the
whole pass, so with concurrent operations it can exceed the wall time).

Also measured, on one session in each polling mode (one warm-up of each, then --reps
repetitions, order alternating): 64 concurrent one-sample operations (asyncio.gather of
Generator.sample_async) against one 64-sample operation, the same 16-token prompt and
max_tokens 16: the median wall time of each and their ratio.

Targets:
- default polling within 1.15x of 10 ms polling (wall time per step) on every loop;
- engine busy >= 80% of the wall time on the qwen3-40m model;
- 64 one-sample operations within 1.5x of one 64-sample operation.

Models: `tiny` is the built-in posttrain/tiny-qwen3; `qwen3-40m` is the random 38M-parameter
Qwen3 config of bench/sampling.py (seed 0), saved with save_pretrained to a temporary directory
and served with `posttrain serve --model DIR`.

    OMP_NUM_THREADS=1 python bench/sdk_loops.py            # both models, ~8 min on 2 CPUs
    python bench/sdk_loops.py --models qwen3-40m --reps 5
    python bench/sdk_loops.py --quick                      # smoke run, ~15 s

--quick: the tiny model only, 1 step x 1 repetition, a few tokens per loop and 8 operations
instead of 64 in the fanout comparison (its numbers say nothing; it checks the script runs).

The server inherits this process's environment, OMP_NUM_THREADS included.
Shape suffixes: S = training samples, P = preference pairs (S = 2P).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import io
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import together.post_training.tinker as tinker
import torch
import torch.nn.functional as F
import transformers
from forward_backward import write_model
from multilora import metrics
from sampling import RANDOM_CONFIGS
from together.post_training import ModelResourcesClient, SessionClient, _operations
from together.post_training.clients.trainer import Trainer

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID
from posttrain.demo.server import local_server

API_KEY = "bench-key"
RANK = 8
FIRST_TOKEN = 3  # below: end-of-text, begin-of-text, padding in the built-in vocabulary
CE = {"type": "cross_entropy"}
GRPO = {"type": "grpo", "grpo_params": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}}
ADAM = {"learning_rate": 1e-4, "weight_decay": 0.0}
DPO_BETA = 0.5
BUSY_COUNTER = "posttrain_worker_busy_seconds_total"
BUSY_FALLBACK = "posttrain_operation_duration_seconds_sum"
FAST_INTERVAL_S = 0.01


@dataclass(frozen=True)
class Sizes:
    """The workload of each loop (see the module docstring)."""

    sft_batch: int
    sft_tokens: int
    grpo_groups: int
    grpo_group_size: int
    grpo_prompt_tokens: int
    grpo_new_tokens: int
    shim_prompts: int
    shim_group_size: int
    shim_prompt_tokens: int
    shim_new_tokens: int
    dpo_pairs: int
    dpo_prompt_tokens: int
    dpo_answer_tokens: int
    fanout: int
    fanout_prompt_tokens: int
    fanout_new_tokens: int


FULL = Sizes(
    sft_batch=8, sft_tokens=128,
    grpo_groups=8, grpo_group_size=4, grpo_prompt_tokens=16, grpo_new_tokens=16,
    shim_prompts=16, shim_group_size=4, shim_prompt_tokens=8, shim_new_tokens=8,
    dpo_pairs=8, dpo_prompt_tokens=16, dpo_answer_tokens=16,
    fanout=64, fanout_prompt_tokens=16, fanout_new_tokens=16,
)  # fmt: skip
QUICK = Sizes(
    sft_batch=2, sft_tokens=16,
    grpo_groups=2, grpo_group_size=2, grpo_prompt_tokens=8, grpo_new_tokens=4,
    shim_prompts=2, shim_group_size=2, shim_prompt_tokens=4, shim_new_tokens=4,
    dpo_pairs=2, dpo_prompt_tokens=8, dpo_answer_tokens=8,
    fanout=8, fanout_prompt_tokens=8, fanout_new_tokens=4,
)  # fmt: skip


@dataclass(frozen=True)
class Polling:
    """How the client waits on operations: the SDK's defaults, or a fixed interval."""

    name: str
    interval_s: float | None  # None: whatever the SDK does by default

    def kwargs(self) -> dict[str, float]:
        """Keyword arguments for Trainer and Generator calls."""
        return {} if self.interval_s is None else {"interval": self.interval_s}


DEFAULT = Polling("default", None)
FAST = Polling("10ms", FAST_INTERVAL_S)
MODES = (DEFAULT, FAST)


@contextlib.contextmanager
def shim_polling(polling: Polling) -> Iterator[None]:
    """The shim's waits at `polling`: a patch of two SDK defaults, only in the 10 ms mode.

    OperationFuture reads _operations.DEFAULT_OPERATION_INTERVAL each time it is collected;
    save_weights_and_get_sampling_client passes no interval to Trainer.weights_sync_async, so
    that method's keyword default (bound at import) is the publish's interval."""
    if polling.interval_s is None:
        yield
        return
    weights_sync = inspect.unwrap(Trainer.weights_sync_async)  # under the loop-hop decorator
    defaults = weights_sync.__kwdefaults__
    saved = _operations.DEFAULT_OPERATION_INTERVAL, defaults["interval"]
    _operations.DEFAULT_OPERATION_INTERVAL = polling.interval_s
    defaults["interval"] = polling.interval_s
    try:
        yield
    finally:
        _operations.DEFAULT_OPERATION_INTERVAL, defaults["interval"] = saved


# ------------------------------------------------------------------ the loops


def model_input(tokens: list[int]) -> dict:
    return {"chunks": [{"encoded_text": {"tokens": tokens}}]}


def random_tokens(rng: random.Random, vocab: int, count: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(count)]


def toy_reward(tokens: list[int]) -> float:
    """Share of even token ids: cheap, and it varies within a group."""
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)


def policy_inputs(
    prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float
) -> tuple[list[int], dict[str, list]]:
    """A policy-loss sample on prompt + completion: its input tokens and loss_fn_inputs, the
    prompt positions zero (reference/api.md section 3.8)."""
    full = prompt + tokens
    pad = len(prompt) - 1
    return full[:-1], {
        "target_tokens": full[1:],
        "logprobs": [0.0] * pad + logprobs,
        "advantages": [0.0] * pad + [advantage] * len(tokens),
    }


class Loop(Protocol):
    name: str

    def step(self, polling: Polling) -> None: ...


@dataclass
class SftLoop:
    trainer: Trainer
    samples: list[dict]
    name: str = "sft"

    def step(self, polling: Polling) -> None:
        self.trainer.forward_backward(samples=self.samples, loss=CE, **polling.kwargs())
        self.trainer.optim_step(adam_params=ADAM, **polling.kwargs())


def sft_loop(session: SessionClient, rng: random.Random, vocab: int, sizes: Sizes) -> SftLoop:
    samples = []
    for _ in range(sizes.sft_batch):
        tokens = random_tokens(rng, vocab, sizes.sft_tokens + 1)
        samples.append(
            {
                "model_input": model_input(tokens[:-1]),
                "loss_fn_inputs": {
                    "target_tokens": tokens[1:],
                    "weights": [1.0] * sizes.sft_tokens,
                },
            }
        )
    return SftLoop(session.trainer, samples)


@dataclass
class GrpoLoop:
    session: SessionClient
    prompts: list[list[int]]
    group_size: int
    new_tokens: int
    name: str = "grpo"

    def step(self, polling: Polling) -> None:
        params = {"max_tokens": self.new_tokens, "temperature": 1.0}
        samples = []
        for prompt in self.prompts:
            result = self.session.generator.sample(
                model_input(prompt),
                num_samples=self.group_size,
                sampling_params=params,
                **polling.kwargs(),
            )
            # int64 tokens may arrive as JSON strings; the SDK passes them through.
            completions = [[int(t) for t in s.tokens] for s in result.sequences]
            rewards = [toy_reward(tokens) for tokens in completions]
            mean = sum(rewards) / len(rewards)
            for sequence, tokens, reward in zip(
                result.sequences, completions, rewards, strict=True
            ):
                inputs, loss_fn_inputs = policy_inputs(
                    prompt, tokens, list(sequence.logprobs), reward - mean
                )
                mask = [0.0] * (len(prompt) - 1) + [1.0] * len(tokens)
                samples.append(
                    {
                        "model_input": model_input(inputs),
                        "loss_fn_inputs": {**loss_fn_inputs, "mask": mask},
                    }
                )
        trainer = self.session.trainer
        trainer.forward_backward(samples=samples, loss=GRPO, **polling.kwargs())
        trainer.optim_step(adam_params=ADAM, **polling.kwargs())
        trainer.weights_sync(**polling.kwargs())


@dataclass
class ShimRlLoop:
    training: tinker.TrainingClient
    prompts: list[list[int]]
    group_size: int
    new_tokens: int
    sampler: tinker.SamplingClient = field(init=False)
    name: str = "shim-rl"

    def __post_init__(self) -> None:
        self.sampler = self.training.save_weights_and_get_sampling_client()

    def step(self, polling: Polling) -> None:
        with shim_polling(polling):
            asyncio.run(self._step())

    async def _step(self) -> None:
        params = tinker.SamplingParams(max_tokens=self.new_tokens, temperature=1.0)
        rollouts = [prompt for prompt in self.prompts for _ in range(self.group_size)]
        responses = await asyncio.gather(
            *(
                self.sampler.sample_async(
                    prompt=tinker.ModelInput.from_ints(prompt),
                    num_samples=1,
                    sampling_params=params,
                )
                for prompt in rollouts
            )
        )
        sequences = [response.sequences[0] for response in responses]
        rewards = [toy_reward(list(s.tokens)) for s in sequences]
        data = []
        for start in range(0, len(rollouts), self.group_size):
            group = range(start, start + self.group_size)
            mean = sum(rewards[i] for i in group) / self.group_size
            for i in group:
                inputs, loss_fn_inputs = policy_inputs(
                    rollouts[i],
                    [int(t) for t in sequences[i].tokens],
                    [float(lp) for lp in sequences[i].logprobs],
                    rewards[i] - mean,
                )
                data.append(
                    tinker.Datum(
                        model_input=tinker.ModelInput.from_ints(inputs),
                        loss_fn_inputs=loss_fn_inputs,
                    )
                )
        # Submitted back to back, awaited after: the cookbook's train step.
        forward_backward = await self.training.forward_backward_async(data, "importance_sampling")
        optim_step = await self.training.optim_step_async(
            tinker.AdamParams(learning_rate=ADAM["learning_rate"])
        )
        await forward_backward
        await optim_step
        self.sampler = await self.training.save_weights_and_get_sampling_client_async()


@dataclass
class DpoLoop:
    trainer: Trainer
    samples: list[dict]  # chosen, rejected, chosen, rejected, ...
    masks: list[torch.Tensor]
    reference_S: torch.Tensor = field(init=False)
    name: str = "dpo"

    def __post_init__(self) -> None:
        self.reference_S = self.sequence_logprobs(self.answer_logprobs(DEFAULT)).detach()

    def answer_logprobs(self, polling: Polling) -> list[torch.Tensor]:
        """Per-token logprobs of every sample; forward() returns 0.0 where the weight is 0."""
        result = self.trainer.forward(samples=self.samples, loss=CE, **polling.kwargs())
        return [torch.tensor(out.tensors["logprobs"].data) for out in result.loss_fn_outputs]

    def sequence_logprobs(self, logprobs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([(lp * m).sum() for lp, m in zip(logprobs, self.masks, strict=True)])

    def step(self, polling: Polling) -> None:
        leaves = [lp.requires_grad_() for lp in self.answer_logprobs(polling)]
        shifted = self.sequence_logprobs(leaves) - self.reference_S
        margin_P = DPO_BETA * (shifted[0::2] - shifted[1::2])
        loss = -F.logsigmoid(margin_P).mean()
        loss.backward()
        gradients = [{"data": leaf.grad.tolist(), "dtype": "D_TYPE_FLOAT32"} for leaf in leaves]
        self.trainer.custom_forward_backward(
            samples=self.samples, gradients=gradients, **polling.kwargs()
        )
        self.trainer.optim_step(adam_params=ADAM, **polling.kwargs())


def dpo_loop(session: SessionClient, rng: random.Random, vocab: int, sizes: Sizes) -> DpoLoop:
    samples, masks = [], []
    for _ in range(sizes.dpo_pairs):
        prompt = random_tokens(rng, vocab, sizes.dpo_prompt_tokens)
        for _ in ("chosen", "rejected"):
            tokens = prompt + random_tokens(rng, vocab, sizes.dpo_answer_tokens)
            weights = [0.0] * (len(prompt) - 1) + [1.0] * sizes.dpo_answer_tokens
            samples.append(
                {
                    "model_input": model_input(tokens[:-1]),
                    "loss_fn_inputs": {"target_tokens": tokens[1:], "weights": weights},
                }
            )
            masks.append(torch.tensor(weights))
    return DpoLoop(session.trainer, samples, masks)


# ------------------------------------------------------------------ measuring


@dataclass(frozen=True)
class BusyProbe:
    """Engine busy seconds so far, from the server's /metrics."""

    base_url: str
    family: str

    @classmethod
    def detect(cls, base_url: str) -> BusyProbe:
        names = {key.split("{", 1)[0] for key in metrics(base_url)}
        return cls(base_url, BUSY_COUNTER if BUSY_COUNTER in names else BUSY_FALLBACK)

    @property
    def is_fallback(self) -> bool:
        return self.family != BUSY_COUNTER

    @property
    def label(self) -> str:
        return "busy (FALLBACK: operation run times)" if self.is_fallback else "engine busy"

    def read(self) -> float:
        return sum(
            value
            for key, value in metrics(self.base_url).items()
            if key.split("{", 1)[0] == self.family
        )


@dataclass(frozen=True)
class Phase:
    """One timed run: how much work, in how many wall seconds, the engine busy for how long."""

    count: int
    seconds: float
    busy_seconds: float

    @property
    def rate(self) -> float:
        return self.count / self.seconds

    @property
    def busy_share(self) -> float:
        return self.busy_seconds / self.seconds


def run_phase(loop: Loop, polling: Polling, steps: int, probe: BusyProbe) -> Phase:
    busy_before = probe.read()
    start = time.perf_counter()
    for _ in range(steps):
        loop.step(polling)
    seconds = time.perf_counter() - start
    return Phase(steps, seconds, probe.read() - busy_before)


def mode_order(rep: int) -> tuple[Polling, ...]:
    """Alternate which mode goes first, so a drift in machine load hits both."""
    return MODES if rep % 2 == 0 else MODES[::-1]


def paired_ratio(slow: list[Phase], fast: list[Phase]) -> float:
    """Median over repetitions of seconds per unit of `slow` / seconds per unit of `fast`."""
    return statistics.median(f.rate / s.rate for s, f in zip(slow, fast, strict=True))


def bench_loop(loop: Loop, args: argparse.Namespace, probe: BusyProbe, label: str) -> str:
    loop.step(DEFAULT)  # warm-up
    phases: dict[str, list[Phase]] = {mode.name: [] for mode in MODES}
    for rep in range(args.reps):
        for mode in mode_order(rep):
            phase = run_phase(loop, mode, args.steps, probe)
            phases[mode.name].append(phase)
            print(
                f"  rep {rep + 1} {loop.name:<8} {mode.name:<8} {phase.rate:7.3f} steps/s"
                f"  {phase.seconds:6.2f} s  {probe.label} {phase.busy_share:4.0%}",
                flush=True,
            )
    default, fast = phases[DEFAULT.name], phases[FAST.name]
    medians = {name: statistics.median(p.rate for p in runs) for name, runs in phases.items()}
    busy = {name: statistics.median(p.busy_share for p in runs) for name, runs in phases.items()}
    ratio = medians[FAST.name] / medians[DEFAULT.name]
    paired = paired_ratio(default, fast)
    return (
        f"{label} {loop.name:<8} default {medians[DEFAULT.name]:7.3f} steps/s"
        f"  10ms {medians[FAST.name]:7.3f} steps/s"
        f"  ratio default/10ms {ratio:.2f}x wall per step (paired {paired:.2f}x;"
        f" target <= 1.15)  {probe.label} {busy[DEFAULT.name]:.0%} default,"
        f" {busy[FAST.name]:.0%} 10ms"
    )


def sample_tokens(results: list) -> int:
    return sum(len(s.tokens) for r in results for s in r.sequences)


def one_wide_op(
    session: SessionClient, prompt: dict, params: dict, count: int, polling: Polling
) -> list:
    return [
        session.generator.sample(
            prompt, num_samples=count, sampling_params=params, **polling.kwargs()
        )
    ]


def many_narrow_ops(
    session: SessionClient, prompt: dict, params: dict, count: int, polling: Polling
) -> list:
    async def gather() -> list:
        return await asyncio.gather(
            *(
                session.generator.sample_async(
                    prompt, num_samples=1, sampling_params=params, **polling.kwargs()
                )
                for _ in range(count)
            )
        )

    return asyncio.run(gather())


def children_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process's children so far: the server's, which
    local_server starts. Read from /proc; 0 where there is none (the ratio then says nothing)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():  # fields[1]: parent pid; [11], [12]: utime, stime
            total += int(fields[11]) + int(fields[12])
    return total / tick


def bench_fanout(
    session: SessionClient, vocab: int, args: argparse.Namespace, probe: BusyProbe, label: str
) -> list[str]:
    """N concurrent one-sample operations vs one N-sample operation of the same session.

    Besides wall time it reports the CPU seconds each side spent: the client's (the SDK, this
    process, all its threads) and the server's (every thread, the engine's included). Where
    the SDK's own CPU for the N operations passes the target's budget (1.5 x the one
    operation's wall time), no server can meet the target on this machine."""
    sizes: Sizes = args.sizes
    count = sizes.fanout
    prompt = model_input(random_tokens(random.Random(7), vocab, sizes.fanout_prompt_tokens))
    params = {"max_tokens": sizes.fanout_new_tokens, "temperature": 1.0}
    shapes = {"narrow": many_narrow_ops, "wide": one_wide_op}
    for run in shapes.values():
        run(session, prompt, params, count, DEFAULT)  # warm-up
    lines = []
    for mode in MODES:
        phases: dict[str, list[Phase]] = {name: [] for name in shapes}
        tokens: dict[str, list[int]] = {name: [] for name in shapes}
        client_cpu: dict[str, list[float]] = {name: [] for name in shapes}
        server_cpu: dict[str, list[float]] = {name: [] for name in shapes}
        for rep in range(args.reps):
            for name in shapes if rep % 2 == 0 else reversed(list(shapes)):
                busy_before = probe.read()
                cpu_before, served_before = time.process_time(), children_cpu_seconds()
                start = time.perf_counter()
                results = shapes[name](session, prompt, params, count, mode)
                seconds = time.perf_counter() - start
                client_cpu[name].append(time.process_time() - cpu_before)
                server_cpu[name].append(children_cpu_seconds() - served_before)
                phase = Phase(1, seconds, probe.read() - busy_before)
                phases[name].append(phase)
                tokens[name].append(sample_tokens(results))
                print(
                    f"  rep {rep + 1} fanout   {mode.name:<8} {name:<6} {seconds:6.2f} s"
                    f"  {tokens[name][-1]} tokens  {probe.label} {phase.busy_share:4.0%}"
                    f"  CPU s: client {client_cpu[name][-1]:.3f} server {server_cpu[name][-1]:.3f}",
                    flush=True,
                )
        narrow = statistics.median(p.seconds for p in phases["narrow"])
        wide = statistics.median(p.seconds for p in phases["wide"])
        lines.append(
            f"{label} fanout   {mode.name:<8} {count} x 1-sample ops {narrow:.2f} s"
            f" ({statistics.median(tokens['narrow']):.0f} tokens)  1 x {count}-sample op"
            f" {wide:.2f} s ({statistics.median(tokens['wide']):.0f} tokens)"
            f"  ratio {count}x1/1x{count} {narrow / wide:.2f}x"
            f" (paired {paired_ratio(phases['narrow'], phases['wide']):.2f}x; target <= 1.5)"
            f"; CPU s, narrow vs wide: SDK client {statistics.median(client_cpu['narrow']):.3f}"
            f" vs {statistics.median(client_cpu['wide']):.3f}, server"
            f" {statistics.median(server_cpu['narrow']):.3f}"
            f" vs {statistics.median(server_cpu['wide']):.3f}"
            f" (target budget {1.5 * wide:.3f} s of wall)"
        )
    return lines


# ------------------------------------------------------------------ per model


@contextlib.contextmanager
def served_model(name: str) -> Iterator[tuple[str, tuple[str, ...], int]]:
    """(base model id, extra `posttrain serve` flags, vocabulary size) of --models `name`."""
    if name == "tiny":
        vocab = json.loads((BUILTIN_MODEL_DIR / "config.json").read_text())["vocab_size"]
        yield BUILTIN_MODEL_ID, (), vocab
        return
    with tempfile.TemporaryDirectory(prefix="sdk-loops-") as scratch:
        directory = Path(scratch) / name  # served under its directory name
        transformers.utils.logging.disable_progress_bar()  # save_pretrained's shard bar
        write_model(directory)
        yield name, ("--model", str(directory)), RANDOM_CONFIGS[name]["vocab_size"]


def build_loops(
    base_url: str, resources: ModelResourcesClient, base_model: str, vocab: int, sizes: Sizes
) -> list[Loop]:
    """The four loops, each on its own session of `resources`."""
    rng = random.Random(0)

    def prompts(count: int, tokens: int) -> list[list[int]]:
        return [random_tokens(rng, vocab, tokens) for _ in range(count)]

    service = tinker.ServiceClient(
        base_url=base_url, api_key=API_KEY, model_resources_id=resources.model_resources_id
    )
    training = service.create_lora_training_client(base_model=base_model, rank=RANK, seed=2)
    return [
        sft_loop(open_session(resources, 0), rng, vocab, sizes),
        GrpoLoop(
            open_session(resources, 1),
            prompts(sizes.grpo_groups, sizes.grpo_prompt_tokens),
            sizes.grpo_group_size,
            sizes.grpo_new_tokens,
        ),
        ShimRlLoop(
            training,
            prompts(sizes.shim_prompts, sizes.shim_prompt_tokens),
            sizes.shim_group_size,
            sizes.shim_new_tokens,
        ),
        dpo_loop(open_session(resources, 3), rng, vocab, sizes),
    ]


def open_session(resources: ModelResourcesClient, seed: int) -> SessionClient:
    return resources.create_session(lora_config={"rank": RANK, "seed": seed}, interval=0.05)


def bench_model(name: str, args: argparse.Namespace) -> list[str]:
    """Every loop and the fanout comparison on one server; their summary lines."""
    with (
        served_model(name) as (base_model, extra_args, vocab),
        local_server(extra_args=extra_args) as base_url,
    ):
        # The SDK prints resource and session creation progress; keep the report readable.
        with contextlib.redirect_stdout(io.StringIO()):
            resources = ModelResourcesClient.create(
                base_url=base_url, api_key=API_KEY, base_model=base_model, interval=0.05
            )
        loops: list[Loop] = []
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                loops = build_loops(base_url, resources, base_model, vocab, args.sizes)
                fanout_session = open_session(resources, 4)
            # After build_loops ran operations: a labelled counter may appear only then.
            probe = BusyProbe.detect(base_url)
            source = probe.family
            if probe.is_fallback:
                source += f" (FALLBACK: the server has no {BUSY_COUNTER})"
            print(f"\n{name} ({base_model}); engine busy time from {source}", flush=True)
            summary = [bench_loop(loop, args, probe, name) for loop in loops]
            summary += bench_fanout(fanout_session, vocab, args, probe, name)
        finally:
            with contextlib.redirect_stdout(io.StringIO()):
                for loop in loops:
                    if isinstance(loop, ShimRlLoop):
                        loop.training.close()
                resources.stop(force=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=["tiny", "qwen3-40m"],
        help="default: tiny qwen3-40m (--quick: tiny)",
    )
    parser.add_argument("--steps", type=int, help="measured steps per phase (3; --quick: 1)")
    parser.add_argument("--reps", type=int, help="repetitions of each mode (3; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="smoke run: see above")
    args = parser.parse_args()
    quick = {"models": ["tiny"], "steps": 1, "reps": 1}
    full = {"models": ["tiny", "qwen3-40m"], "steps": 3, "reps": 3}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.sizes = QUICK if args.quick else FULL
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(
        f"torch {torch.__version__}; OMP_NUM_THREADS={threads}, torch threads in this process"
        f" {torch.get_num_threads()} (the server inherits the environment)"
    )
    print(f"steps per phase {args.steps}, repetitions {args.reps}, sizes {args.sizes}")
    print(
        "polling: default = the SDK's defaults (GET right after the POST, then 0.5 s sleeps);"
        f" 10ms = interval={FAST_INTERVAL_S} on Trainer/Generator calls, and for the tinker shim"
        " (which has no interval knob) PATCHED in this mode only:"
        " together.post_training._operations.DEFAULT_OPERATION_INTERVAL (its futures) and the"
        " interval default of Trainer.weights_sync_async (its save_weights_and_get_sampling_client)"
    )
    summary = []
    for name in args.models:
        summary += bench_model(name, args)
    print("\nmedians")
    for line in summary:
        print(line)


if __name__ == "__main__":
    main()
