"""Image chunks of training samples checked against the model before anything is queued: each
image decoded and processed by the model's own image processor (model/vision/), its
placeholder count compared with the count the client expected, and its positions filled with
the model's image placeholder token.

A mismatch, bytes that are not an image of the named format, or an image past the pixel limit
is an InvalidRequest naming the sample and the chunk, raised before any compute, so nothing
changes. A text chunk may not hold the placeholder ids themselves: the model's forward would
read them as image positions.

`image_inputs` gives a training forward the model's image arguments for rows whose
placeholders are in place; `ImagePass` gives a sampler prefill pass the same, and position ids
from the model's own `get_rope_index` (M-RoPE), shifted per row so that the position after the
prompt is the prompt's length: rotary attention depends on position differences only, so the
shift changes nothing within the prompt, and the decode passes after it place each new token
at its index as for text (no per-row offset to carry through decoding).

Not here: the forwards themselves (engine/train/trainer.py, engine/generate/prefill.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import Tensor
from transformers import AutoConfig, PreTrainedModel

from posttrain.errors import InvalidRequest
from posttrain.model.loader import LoadedModel
from posttrain.model.vision import ImageProblem, VisionInputs, image_hash, is_vision_language
from posttrain.types import ImageInput, SampleRequest, TrainingSample

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
        dataclasses.replace(
            sample,
            tokens=_placed(
                vision,
                sample.tokens,
                sample.images,
                f"samples[{index}].model_input",
                max_image_pixels,
            ),
        )
        if sample.images
        else sample
        for index, sample in enumerate(samples)
    )


def checked_prompt_images(
    model_dir: Path, request: SampleRequest, *, max_image_pixels: int
) -> SampleRequest:
    """`request` with each prompt image's positions set to the model's placeholder token, as
    checked_images does for training samples (param `model_inputs[i]`)."""
    if not any(request.prompt_images):
        return request
    vision = vision_inputs(model_dir)
    prompts = tuple(
        _placed(vision, prompt, images, f"model_inputs[{index}]", max_image_pixels)
        if images
        else prompt
        for index, (prompt, images) in enumerate(
            zip(request.prompts, request.prompt_images, strict=True)
        )
    )
    return dataclasses.replace(request, prompts=prompts)


def _placed(
    vision: VisionInputs | None,
    tokens_in: tuple[int, ...],
    images: tuple[ImageInput, ...],
    param: str,
    max_pixels: int,
) -> tuple[int, ...]:
    """`tokens_in` with `images`' positions holding the placeholder token."""
    if vision is None:
        raise InvalidRequest(
            f"chunk {images[0].chunk} is an image chunk and this model takes text only",
            param=param,
        )
    tokens = list(tokens_in)
    placed = [False] * len(tokens)
    for image in images:
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
    return tuple(tokens)


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


def shifted_positions(
    model: PreTrainedModel,
    vision: VisionInputs,
    prompt: tuple[int, ...],
    images: tuple[ImageInput, ...],
) -> tuple[Tensor, int]:
    """The M-RoPE position ids [3, len(prompt)] of a prompt with its placeholders in place:
    the model's own (`get_rope_index`), shifted so that the position after the prompt is
    len(prompt) (module docstring); and the shift."""
    device = next(model.parameters()).device
    ids_1Q = torch.tensor([prompt], device=device)
    grids = [
        vision.grid(image.data, image.format, max_pixels=_CHECKED_AT_SUBMIT) for image in images
    ]
    # nn.Module's attribute lookup types every attribute as a tensor or module.
    rope_index = cast(Callable[..., tuple[Tensor, Tensor]], model.base_model.get_rope_index)
    # The model's positions [3, 1, Q] and the offset of the position after the prompt from
    # its length [1, 1].
    positions_31Q, delta_11 = rope_index(
        input_ids=ids_1Q,
        mm_token_type_ids=(ids_1Q == vision.image_token_id).to(torch.int32),
        image_grid_thw=torch.tensor([g.grid_thw for g in grids], device=device),
    )
    shift = -int(delta_11.reshape(()))
    return positions_31Q[:, 0] + shift, shift


def prefix_key(
    model: PreTrainedModel,
    vision: VisionInputs,
    prompt: tuple[int, ...],
    images: tuple[ImageInput, ...],
) -> tuple[int, ...]:
    """What the prefix cache keys an image prompt by: its tokens, each image's placeholders
    replaced by an id of the image's bytes (equal-sized images have equal placeholders), and,
    where the prompt's positions are shifted, its first token by an id of (token, shift): a
    prefix's KV depends on the shift, so prompts share cached prefixes only under one shift.
    The ids are negative: no real token equals one."""
    key = list(prompt)
    for image in images:
        virtual = -2 - int(image_hash(image.data)[:15], 16)
        key[image.offset : image.offset + image.num_tokens] = [virtual] * image.num_tokens
    _, shift = shifted_positions(model, vision, prompt, images)
    if shift:
        key[0] = -2 - int(image_hash(f"{shift}:{prompt[0]}".encode())[:15], 16)
    return tuple(key)


def cacheable_length(prompt_length: int, images: tuple[ImageInput, ...]) -> int:
    """The longest prefix a prompt may take from the prefix cache: all but its last token,
    ending before an image rather than inside one (an image's embeddings come whole)."""
    limit = prompt_length - 1
    for image in images:
        if image.offset < limit < image.offset + image.num_tokens:
            return image.offset
    return limit


@dataclass(frozen=True)
class ImagePass:
    """The images of a prefill pass, per row: the row's whole prompt, its images, and the
    position the pass starts it at (a prefix-cache hit ends before an image, never in one)."""

    model: PreTrainedModel
    vision: VisionInputs
    prompts_B: list[tuple[int, ...]]
    images_B: list[tuple[ImageInput, ...]]
    starts_B: list[int]

    def inputs(
        self, tokens_BQ: Tensor, positions_BQ: Tensor, num_new_B: Tensor
    ) -> dict[str, Tensor]:
        """The forward's image arguments (the images the pass's positions hold) and its
        position ids [3, B, Q]: a text row's positions on every axis, an image row's
        shifted M-RoPE positions (module docstring)."""
        grids = [
            self.vision.grid(image.data, image.format, max_pixels=_CHECKED_AT_SUBMIT)
            for images, start in zip(self.images_B, self.starts_B, strict=True)
            for image in images
            if image.offset >= start
        ]
        # After a prefix-cache hit a pass may hold no image, only positions that follow one.
        inputs = self.vision.forward_inputs(grids, tokens_BQ) if grids else {}
        rope_3BQ = positions_BQ.unsqueeze(0).expand(3, -1, -1).clone()
        for b, (prompt, images, start) in enumerate(
            zip(self.prompts_B, self.images_B, self.starts_B, strict=True)
        ):
            if images:
                count = int(num_new_B[b])
                full_3P, _ = shifted_positions(self.model, self.vision, prompt, images)
                rope_3BQ[:, b, :count] = full_3P[:, start : start + count]
        inputs["position_ids"] = rope_3BQ
        return inputs
