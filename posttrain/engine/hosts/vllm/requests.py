"""A sample operation in vLLM's words and back: one /inference/v1/generate body per prompt
(token ids in, `n` = num_samples), and its reply as a SampleResult.

A prompt of more sequences than the server decodes at once goes as several requests (`parts`,
seeded so each sequence draws as in one), whose results merge (`merged`). The sampling API maps
one to one: temperature, top_p, top_k (-1: off), seed (vLLM gives each of
the `n` sequences seed + index, so a seeded request repeats within the engine; its tokens need
not equal the built-in sampler's), stop strings (detokenized on the server; the token that
completes one is the last returned, as the built-in sampler does), stop token ids, EOS
(`ignore_eos` where the request does not stop at it) and max_tokens. `logprobs: 0` returns the
sampled token's own logprob, of the raw distribution (vLLM's default `raw_logprobs`), which is
what the trainer scores. Policy versions come from each choice's `weight_versions` spans, whose
labels the engine maps to the session's policy version (hosts/vllm/engine.py).

Imports: types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from posttrain.types import PolicySegment, SampledSequence, SampleRequest, SampleResult, StopReason


def generate_body(
    prompt: tuple[int, ...], request: SampleRequest, model: str, salt: str | None = None
) -> dict[str, Any]:
    """The /inference/v1/generate body of one prompt of `request`, on adapter (or base) `model`;
    `salt`: the prefix-cache salt of the weights it samples (hosts/vllm/replica.py)."""
    params = request.sampling_params
    sampling: dict[str, Any] = {
        "n": request.num_samples,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "seed": params.seed,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": not params.stop_at_eos,
        "logprobs": 0,
        "skip_special_tokens": False,
    }
    if params.stop:
        sampling |= {"stop": list(params.stop), "include_stop_str_in_output": True}
    else:
        sampling["detokenize"] = False  # tokens only: no text work on the server
    body = {"token_ids": list(prompt), "model": model, "sampling_params": sampling}
    if salt is not None:
        body["cache_salt"] = salt
    return body


def segments_of(
    spans: list[dict[str, Any]] | None, version_of: Callable[[str], int]
) -> list[PolicySegment]:
    """Policy segments of one choice from its `weight_versions` spans (label, start, end):
    consecutive spans of one policy version merge; at least one segment, from token 0."""
    segments: list[PolicySegment] = []
    for span in spans or ():
        version = version_of(span["version"])
        if not segments or segments[-1].version != version:
            segments.append(PolicySegment(0 if not segments else int(span["start"]), version))
    return segments


def result_of(
    reply: dict[str, Any], version_of: Callable[[str], int], fallback: int
) -> SampleResult:
    """One prompt's SampleResult from its generate reply. `version_of` maps a weight-version
    label to the session's policy version; `fallback`: the version served when the reply
    carries no spans (a sequence that generated nothing)."""
    usage = reply.get("usage") or {}
    cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    sequences = []
    segments: list[PolicySegment] = []
    for choice in sorted(reply["choices"], key=lambda c: c["index"]):
        tokens = list(choice.get("token_ids") or [])
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(entry["logprob"]) for entry in content]
        assert len(logprobs) == len(tokens), "vLLM returned a logprob per sampled token"
        stop = StopReason.LENGTH if choice.get("finish_reason") == "length" else StopReason.STOP
        sequences.append(SampledSequence(tokens, logprobs, stop, prompt_cache_hit_tokens=cached))
        # A prompt's sequences are decoded together: the first choice that switched weights
        # (the most segments) says where the switch fell.
        found = segments_of(choice.get("weight_versions"), version_of)
        if len(found) > len(segments):
            segments = found
    return SampleResult(sequences, segments or [PolicySegment(0, fallback)])


def parts(request: SampleRequest, most: int) -> list[SampleRequest]:
    """`request` as requests of at most `most` sequences each: a server refuses `n` past its
    max_num_seqs. A seeded part starts at the seed plus its first sequence's index, so every
    sequence is seeded as in one request (vLLM seeds sequence i of n with seed + i)."""
    n, params = request.num_samples, request.sampling_params
    if n <= most:
        return [request]
    return [
        replace(
            request,
            num_samples=min(most, n - start),
            sampling_params=replace(
                params, seed=None if params.seed is None else params.seed + start
            ),
        )
        for start in range(0, n, most)
    ]


def merged(results: list[SampleResult]) -> SampleResult:
    """One prompt's parts (`parts`) as one result: their sequences in order, and the policy
    segments of the part that switched weights most (as among one reply's choices)."""
    if len(results) == 1:
        return results[0]
    segments = max((result.policy_segments for result in results), key=len)
    sequences = [sequence for result in results for sequence in result.sequences]
    return replace(results[0], sequences=sequences, policy_segments=segments)
