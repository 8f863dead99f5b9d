"""A Tinker asample body's image chunks (api/tinker/sampling.py), as the tinker 0.38 SDK's
ImageChunk serializes them (data base64, format, expected_tokens): the prompt holds the
image's expected_tokens positions, the request its bytes; a chunk without expected_tokens, data
or with override_dimensions, or data that is not base64, is a 400 naming the chunk."""

from __future__ import annotations

import base64

import pytest

from posttrain.api.tinker.sampling import sample_request
from posttrain.api.tinker.wire import Sample
from posttrain.errors import InvalidRequest
from posttrain.types import ImageInput

PNG = b"\x89PNG\r\n\x1a\n-not-decoded-here"


def body(*chunks: dict) -> Sample:
    return Sample.model_validate(
        {
            "num_samples": 2,
            "prompt": {"chunks": list(chunks)},
            "sampling_params": {"max_tokens": 3},
        }
    )


def image(**fields) -> dict:
    return {"type": "image", "data": base64.b64encode(PNG).decode(), "format": "png", **fields}


def test_an_image_chunk_holds_its_positions_and_travels_with_its_bytes():
    request = sample_request(
        body(
            {"type": "encoded_text", "tokens": [1, 99]},
            image(expected_tokens=3),
            {"type": "encoded_text", "tokens": [100, 7]},
            image(expected_tokens=2),
        )
    )
    assert request.prompts == ((1, 99, 0, 0, 0, 100, 7, 0, 0),)
    assert request.prompt_images == (
        (ImageInput(2, 3, 1, PNG, "png"), ImageInput(7, 2, 3, PNG, "png")),
    )
    assert request.num_samples == 2


def test_a_text_prompt_carries_no_images():
    request = sample_request(body({"type": "encoded_text", "tokens": [1, 2]}))
    assert request.prompt_images == ()


@pytest.mark.parametrize(
    ("chunk", "why"),
    [
        (image(), "without a positive expected_tokens"),
        (image(expected_tokens=0), "without a positive expected_tokens"),
        ({"type": "image", "format": "png", "expected_tokens": 2}, "without data or format"),
        (image(expected_tokens=2, data="not base64!"), "data is not base64"),
        (image(expected_tokens=2, override_dimensions={"width": 8}), "override_dimensions"),
        ({"type": "dmel", "dmel": "AA=="}, "encoded_text and image"),
    ],
)
def test_a_bad_image_chunk_names_it(chunk, why):
    with pytest.raises(InvalidRequest) as caught:
        sample_request(body({"type": "encoded_text", "tokens": [1]}, chunk))
    assert caught.value.param == "prompt.chunks[1]" and why in caught.value.message
