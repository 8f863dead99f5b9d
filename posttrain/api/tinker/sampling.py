"""A Tinker asample body -> the domain SampleRequest.

`stop`: None keeps EOS as the only stop; `[]` stops at nothing, not even EOS; strings stop
after the text; token ids stop at the token (the cookbook's renderers give token ids).
`max_tokens` None samples up to the model's context.

Imports: api.tinker.wire, errors, types.
"""

from __future__ import annotations

import base64
import binascii

from posttrain.api.tinker.wire import Chunk, Sample
from posttrain.errors import InvalidRequest
from posttrain.types import ImageInput, SampleRequest, SamplingParams


def prompt_tokens(body: Sample) -> tuple[tuple[int, ...], tuple[ImageInput, ...]]:
    """The prompt's tokens (an image's expected_tokens positions held by 0s, which the
    service sets to the model's placeholder once it has checked the image) and its images."""
    tokens: list[int] = []
    images: list[ImageInput] = []
    for index, chunk in enumerate(body.prompt.chunks):
        param = f"prompt.chunks[{index}]"
        if chunk.type == "image":
            image = _image(chunk, index, len(tokens), param)
            images.append(image)
            tokens.extend([0] * image.num_tokens)
            continue
        if chunk.type != "encoded_text" or chunk.tokens is None:
            raise InvalidRequest(
                f"prompt chunk of type {chunk.type!r}: prompts take encoded_text and image chunks",
                param=param,
            )
        tokens.extend(chunk.tokens)
    if not tokens:
        raise InvalidRequest("prompt has no tokens", param="prompt.chunks")
    return tuple(tokens), tuple(images)


def _image(chunk: Chunk, index: int, offset: int, param: str) -> ImageInput:
    # The prompt's positions count an image as its expected_tokens (the SDK's
    # ImageChunk.length); the service checks the count against the model's processor.
    if chunk.expected_tokens is None or chunk.expected_tokens <= 0:
        raise InvalidRequest(
            f"chunk {index} is an image chunk without a positive expected_tokens", param=param
        )
    if chunk.format is None or chunk.data is None:
        raise InvalidRequest(f"chunk {index} is an image chunk without data or format", param=param)
    if (chunk.model_extra or {}).get("override_dimensions") is not None:
        raise InvalidRequest(
            f"chunk {index}: override_dimensions is not served (the image is processed at its"
            " own size)",
            param=param,
        )
    try:
        data = base64.b64decode(chunk.data, validate=True)
    except binascii.Error as exc:
        raise InvalidRequest(f"chunk {index}: data is not base64 ({exc})", param=param) from None
    return ImageInput(
        offset=offset, num_tokens=chunk.expected_tokens, chunk=index, data=data, format=chunk.format
    )


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
    tokens, images = prompt_tokens(body)
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
        prompt_images=(images,) if images else (),
    )
