"""A Tinker asample body -> the domain SampleRequest.

`stop`: None keeps EOS as the only stop; `[]` stops at nothing, not even EOS; strings stop
after the text; token ids stop at the token (the cookbook's renderers give token ids).
`max_tokens` None samples up to the model's context.

Imports: api.tinker.wire, errors, types.
"""

from __future__ import annotations

from posttrain.api.tinker.wire import Sample
from posttrain.errors import InvalidRequest
from posttrain.types import SampleRequest, SamplingParams


def prompt_tokens(body: Sample) -> tuple[int, ...]:
    tokens: list[int] = []
    for index, chunk in enumerate(body.prompt.chunks):
        if chunk.type == "image":
            # The generator's passes place text positions only: an image's vision embeddings
            # and its M-RoPE position offsets are not in prefill and decode.
            raise InvalidRequest(
                f"prompt chunk {index} is an image chunk: sampling and compute_logprobs take"
                " text prompts only (forward and forward_backward take images)",
                param=f"prompt.chunks[{index}]",
            )
        if chunk.type != "encoded_text" or chunk.tokens is None:
            raise InvalidRequest(
                f"prompt chunk of type {chunk.type!r}: prompts take encoded_text chunks",
                param=f"prompt.chunks[{index}]",
            )
        tokens.extend(chunk.tokens)
    if not tokens:
        raise InvalidRequest("prompt has no tokens", param="prompt.chunks")
    return tuple(tokens)


def sample_request(body: Sample) -> SampleRequest:
    params = body.sampling_params
    for name in ("topk_sample_logprobs", "prompt_alt_tokens_k"):
        if getattr(body, name):
            raise InvalidRequest(f"{name} is not served", param=name)
    if body.target_prompt_logprobs is not None:
        raise InvalidRequest("target_prompt_logprobs is not served", param="target_prompt_logprobs")
    if body.prompt_logprobs_last_n is not None:
        raise InvalidRequest("prompt_logprobs_last_n is not served", param="prompt_logprobs_last_n")
    if body.record_stability_info:
        raise InvalidRequest(
            "record_stability_info is not served (stable_reinforce is not one of posttrain's"
            " losses)",
            param="record_stability_info",
        )
    tokens = prompt_tokens(body)
    stop = params.stop
    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()
    at_eos = True
    if isinstance(stop, str):
        strings = (stop,)
    elif isinstance(stop, list):
        if not stop:
            at_eos = False
        elif all(isinstance(s, str) for s in stop):
            strings = tuple(stop)  # type: ignore[arg-type]
        else:
            token_ids = tuple(int(s) for s in stop)
    sampling = SamplingParams(
        max_tokens=params.max_tokens,  # None: what the context leaves (the service resolves it)
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop=strings,
        stop_token_ids=token_ids,
        stop_at_eos=at_eos,
    )
    return SampleRequest(
        prompts=(tokens,),
        num_samples=body.num_samples,
        sampling_params=sampling,
        prompt_logprobs=bool(body.prompt_logprobs) or body.topk_prompt_logprobs > 0,
        topk_prompt_logprobs=body.topk_prompt_logprobs,
    )
