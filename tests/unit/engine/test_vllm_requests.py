"""A sample operation in vLLM's words and back (engine/hosts/vllm/requests.py): every sampling
field reaches the generate body, and a reply's choices, logprobs, stop reasons, cached prompt
tokens and weight-version spans become the SampleResult the API returns; a prompt of more
sequences than a server takes goes as seeded parts whose results merge in order."""

from __future__ import annotations

from posttrain.engine.hosts.vllm.requests import generate_body, merged, parts, result_of
from posttrain.types import (
    PolicySegment,
    SampledSequence,
    SampleRequest,
    SampleResult,
    SamplingParams,
    StopReason,
)


def test_every_sampling_field_reaches_the_generate_body():
    params = SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=4, seed=3, stop=("ab",),
        stop_token_ids=(5,), stop_at_eos=False,
    )  # fmt: skip
    body = generate_body((1, 2, 3), SampleRequest(((1, 2, 3),), 2, params), "ts-1")
    assert body["token_ids"] == [1, 2, 3] and body["model"] == "ts-1"
    assert body["sampling_params"] == {
        "n": 2, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "seed": 3,
        "stop_token_ids": [5], "ignore_eos": True, "logprobs": 0,
        "skip_special_tokens": False, "stop": ["ab"], "include_stop_str_in_output": True,
    }  # fmt: skip
    plain = generate_body((1,), SampleRequest(((1,),)), "base")["sampling_params"]
    assert plain["top_k"] == -1 and plain["detokenize"] is False and "stop" not in plain
    assert plain["ignore_eos"] is False


def reply(spans: list[list[dict]]) -> dict:
    return {
        "usage": {"prompt_tokens_details": {"cached_tokens": 3}},
        "choices": [
            {
                "index": i,
                "finish_reason": "length" if i else "stop",
                "token_ids": [10, 11, 12],
                "logprobs": {"content": [{"logprob": -0.5 * (k + 1)} for k in range(3)]},
                "weight_versions": s,
            }
            for i, s in reversed(list(enumerate(spans)))
        ],
    }


def test_a_reply_becomes_the_sample_result_with_policy_versions_from_its_labels():
    labels = {"default": 0, "1": 4, "2": 5}
    whole = [{"version": "1", "start": 0, "end": 3}]
    switched = [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 1, "end": 3}]
    result = result_of(reply([whole, switched]), labels.__getitem__, fallback=9)
    assert [s.stop_reason for s in result.sequences] == [StopReason.STOP, StopReason.LENGTH]
    assert result.sequences[0].tokens == [10, 11, 12]
    assert result.sequences[0].logprobs == [-0.5, -1.0, -1.5]
    assert {s.prompt_cache_hit_tokens for s in result.sequences} == {3}
    assert result.policy_segments == [PolicySegment(0, 4), PolicySegment(1, 5)]
    same = [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 3}]
    labels["2"] = 4  # two labels of one policy version: one segment
    assert result_of(reply([same]), labels.__getitem__, 9).policy_segments == [PolicySegment(0, 4)]
    assert result_of(reply([[]]), labels.__getitem__, 9).policy_segments == [PolicySegment(0, 9)]


def test_a_prompt_of_more_sequences_than_a_server_takes_goes_in_seeded_parts():
    request = SampleRequest(((1, 2),), 300, SamplingParams(max_tokens=3, seed=5))
    split = parts(request, 256)
    assert [(p.num_samples, p.sampling_params.seed) for p in split] == [(256, 5), (44, 261)]
    assert all(p.prompts == request.prompts and p.sampling_params.max_tokens == 3 for p in split)
    unseeded = SampleRequest(((1,),), 513, SamplingParams(seed=None))
    assert [(p.num_samples, p.sampling_params.seed) for p in parts(unseeded, 256)] == [
        (256, None),
        (256, None),
        (1, None),
    ]
    assert parts(request, 300) == [request]


def test_parts_merge_in_order_with_the_segments_of_the_part_that_switched():
    def result(tokens: list[int], segments: list[PolicySegment]) -> SampleResult:
        return SampleResult(
            [SampledSequence(tokens, [0.0] * len(tokens), StopReason.LENGTH)], segments
        )

    first = result([1], [PolicySegment(0, 2)])
    second = result([2, 3], [PolicySegment(0, 2), PolicySegment(1, 3)])
    one = merged([first, second])
    assert [s.tokens for s in one.sequences] == [[1], [2, 3]]
    assert one.policy_segments == second.policy_segments
    assert merged([first]) is first
