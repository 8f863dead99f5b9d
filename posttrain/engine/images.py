"""Image chunks of training samples checked against the model before anything is queued: each
image decoded and processed by the model's own image processor (model/vision.py), its
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
from posttrain.model.vision import ImageGrid, ImageProblem, VisionInputs, is_vision_language
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


@dataclass(frozen=True)
class ImagePass:
    """The images of a prefill pass, per row (a row with images holds its whole prompt from
    position 0)."""

    model: PreTrainedModel
    vision: VisionInputs
    images_B: list[tuple[ImageInput, ...]]

    def inputs(
        self, tokens_BQ: Tensor, positions_BQ: Tensor, num_new_B: Tensor
    ) -> dict[str, Tensor]:
        """The forward's image arguments and its position ids [3, B, Q]: a text row's
        positions on every axis, an image row's M-RoPE positions shifted (module docstring)."""
        grids_B = [
            [
                self.vision.grid(image.data, image.format, max_pixels=_CHECKED_AT_SUBMIT)
                for image in images
            ]
            for images in self.images_B
        ]
        inputs = self.vision.forward_inputs([g for grids in grids_B for g in grids], tokens_BQ)
        rope_3BQ = positions_BQ.unsqueeze(0).expand(3, -1, -1).clone()
        for b, grids in enumerate(grids_B):
            if grids:
                count = int(num_new_B[b])
                assert int(positions_BQ[b, 0]) == 0, "an image prompt prefills from position 0"
                rope_3BQ[:, b, :count] = self._shifted_positions(tokens_BQ[b, :count], grids)
        inputs["position_ids"] = rope_3BQ
        return inputs

    def _shifted_positions(self, tokens_Q: Tensor, grids: list[ImageGrid]) -> Tensor:
        ids_1Q = tokens_Q.unsqueeze(0)
        device = tokens_Q.device
        # The model's own M-RoPE positions ([3, 1, Q]) and the offset of the position after
        # the prompt from its length ([1, 1]).
        # nn.Module's attribute lookup types every attribute as a tensor or module.
        rope_index = cast(
            Callable[..., tuple[Tensor, Tensor]], self.model.base_model.get_rope_index
        )
        positions_31Q, delta_11 = rope_index(
            input_ids=ids_1Q,
            mm_token_type_ids=(ids_1Q == self.vision.image_token_id).to(torch.int32),
            image_grid_thw=torch.tensor([g.grid_thw for g in grids], device=device),
        )
        shifted: Tensor = positions_31Q[:, 0] - delta_11.reshape(()).to(device)
        return shifted
