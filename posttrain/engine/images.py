"""Image chunks of training samples checked against the model before anything is queued: each
image decoded and processed by the model's own image processor (model/vision.py), its
placeholder count compared with the count the client expected, and its positions filled with
the model's image placeholder token.

A mismatch, bytes that are not an image of the named format, or an image past the pixel limit
is an InvalidRequest naming the sample and the chunk, raised before any compute, so nothing
changes. A text chunk may not hold the placeholder ids themselves: the model's forward would
read them as image positions.

`image_inputs` gives a forward (training, prefill) the model's image arguments for rows whose
placeholders are in place.

Not here: the forwards themselves (engine/train/trainer.py, engine/generate/prefill.py).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from torch import Tensor
from transformers import AutoConfig

from posttrain.errors import InvalidRequest
from posttrain.model.loader import LoadedModel
from posttrain.model.vision import ImageProblem, VisionInputs, is_vision_language
from posttrain.types import ImageInput, TrainingSample

# An image that reaches a forward passed the pixel limit at submit.
_CHECKED_AT_SUBMIT = 1 << 62


@functools.lru_cache(maxsize=8)
def vision_inputs(model_dir: Path) -> VisionInputs | None:
    """The image processor of the model in `model_dir`, None for a text-only model (read once
    per directory: a served model's files do not change while it is served)."""
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return VisionInputs(model_dir) if is_vision_language(config) else None


def checked_images(
    model_dir: Path, samples: tuple[TrainingSample, ...], *, max_image_pixels: int
) -> tuple[TrainingSample, ...]:
    """`samples` with each image's positions set to the model's placeholder token; raises
    InvalidRequest (param `samples[i].model_input`) for an image the model cannot take or
    whose placeholder count differs from its `num_tokens`."""
    if not any(sample.images for sample in samples):
        return samples
    vision = vision_inputs(model_dir)
    return tuple(
        _checked(vision, sample, f"samples[{index}].model_input", max_image_pixels)
        for index, sample in enumerate(samples)
    )


def _checked(
    vision: VisionInputs | None, sample: TrainingSample, param: str, max_pixels: int
) -> TrainingSample:
    if not sample.images:
        return sample
    if vision is None:
        raise InvalidRequest(
            f"chunk {sample.images[0].chunk} is an image chunk and this model takes text only",
            param=param,
        )
    tokens = list(sample.tokens)
    placed = [False] * len(tokens)
    for image in sample.images:
        try:
            grid = vision.grid(image.data, image.format, max_pixels=max_pixels)
        except ImageProblem as exc:
            raise InvalidRequest(f"chunk {image.chunk} (image): {exc}", param=param) from None
        if grid.num_tokens != image.num_tokens:
            t, h, w = grid.grid_thw
            raise InvalidRequest(
                f"chunk {image.chunk} (image): the image is {grid.num_tokens} tokens (grid"
                f" {t}x{h}x{w} patches, merged {vision.merge_size}x{vision.merge_size}) and"
                f" expected_tokens is {image.num_tokens}",
                param=param,
            )
        end = image.offset + image.num_tokens
        tokens[image.offset : end] = [vision.image_token_id] * image.num_tokens
        placed[image.offset : end] = [True] * image.num_tokens
    for position, (token, is_image) in enumerate(zip(tokens, placed, strict=True)):
        if not is_image and token in vision.reserved_ids:
            raise InvalidRequest(
                f"token {position} is {token}, the model's image or video placeholder, which"
                " only an image chunk may place",
                param=param,
            )
    return dataclasses.replace(sample, tokens=tuple(tokens))


def image_inputs(
    loaded: LoadedModel, images: list[ImageInput], tokens_BT: Tensor
) -> dict[str, Tensor]:
    """The model forward's image arguments (`pixel_values`, `image_grid_thw`,
    `mm_token_type_ids`) for rows `tokens_BT` holding `images`' placeholders, in row-major
    order."""
    vision = loaded.vision
    assert vision is not None, "image chunks are checked against the model at submit"
    grids = [
        vision.grid(image.data, image.format, max_pixels=_CHECKED_AT_SUBMIT) for image in images
    ]
    return vision.forward_inputs(grids, tokens_BT)
