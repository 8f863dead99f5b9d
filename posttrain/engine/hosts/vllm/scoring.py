"""The trainer's scoring of what vLLM sampled (engine/hosts/vllm/engine.py): for a share of
sample operations (`--vllm-mismatch-rate`), each sampled sequence is scored by the trainer's own
generator, which serves the same published weights in float32 through posttrain's shared
logprob function, and the result carries the mean and max |difference| (types.LogprobMismatch,
also summed into /metrics).

The trainer engine runs on the resource's trainer lane; scoring runs on a generator lane, so
each call into the trainer here holds the lock VllmEngine holds around every one of its own
(`trainer_lock`, hosts/trainer_forwarding.py): a scoring never interleaves with a training step.

Imports: types, engine.interface.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace

from posttrain.engine.interface import Engine
from posttrain.types import LogprobMismatch, SampleRequest, SampleResult, SamplingParams


def mismatch(
    trainer: Engine,
    lock: AbstractContextManager[object],
    resource_id: str,
    session_id: str,
    prompt: tuple[int, ...],
    result: SampleResult,
    context_length: int,
) -> LogprobMismatch | None:
    """|vLLM's logprob - the trainer generator's| over the result's sampled tokens: each
    sequence is the prompt of a one-token sample whose prompt logprobs score it."""
    diffs: list[float] = []
    for sequence in result.sequences:
        tokens = tuple(sequence.tokens)
        if not tokens or len(prompt) + len(tokens) + 1 > context_length:
            continue
        request = SampleRequest(
            (prompt + tokens,), 1, SamplingParams(max_tokens=1, seed=0), prompt_logprobs=True
        )
        with lock:
            ((scored,),) = trainer.sample_batch(resource_id, [(session_id, request)])
        assert scored.prompt_logprobs is not None, "asked for with prompt_logprobs"
        expected = scored.prompt_logprobs[len(prompt) :]
        diffs += [abs(a - b) for a, b in zip(expected, sequence.logprobs, strict=True)]
    if not diffs:
        return None
    return LogprobMismatch(mean=statistics.fmean(diffs), max=max(diffs), tokens=len(diffs))


def scored(
    trainer: Engine,
    lock: AbstractContextManager[object],
    resource_id: str,
    session_id: str,
    request: SampleRequest,
    results: list[SampleResult],
    context_length: int,
    current: Callable[[], bool],
) -> list[SampleResult]:
    """`results` (one per prompt of `request`) with their mismatch: only for a result of one
    policy version while `current()` says the trainer serves what vLLM sampled with (checked
    again after scoring: a change meanwhile leaves it None). `lock`: held around each call
    into the trainer."""
    found = []
    for prompt, result in zip(request.prompts, results, strict=True):
        diff = None
        if len(result.policy_segments) == 1 and current():
            diff = mismatch(trainer, lock, resource_id, session_id, prompt, result, context_length)
        found.append(replace(result, logprob_mismatch=diff if current() else None))
    return found
