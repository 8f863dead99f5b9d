"""Images as a vision-language model takes them: decoded, checked, run through the image
processor its directory names, and turned into the keyword arguments of the model's own
forward (`pixel_values`, `image_grid_thw`, `mm_token_type_ids`).

The processor is the one `preprocessor_config.json` names, loaded through transformers' PIL
backend (`Qwen2VLImageProcessorPil` for the Qwen VL families): the torchvision backend is not
required, and where torchvision is present the same PIL path runs, so numbers do not depend on
it. An image's placeholder count is its grid's patches over the merge window
(`prod(image_grid_thw) / merge_size**2`), which is how the model's own processor expands
`<|image_pad|>` and what the model's vision tower emits per image. The vision embeddings, the
deepstack features and the M-RoPE position ids are computed inside the model's forward, by
its own code: nothing here copies a family's math.

Not here: which models take images and their towers' attention and memory (towers.py), where
an image sits in a sample (engine/images.py), the forward itself (engine/train/trainer.py).

Legend: B = rows, T = tokens, P = patches of all images, C = patch channels.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from transformers import AutoConfig, AutoImageProcessor

# The formats an image chunk may name, as PIL reports them.
FORMATS = {"png": "PNG", "jpeg": "JPEG"}
# Processed images kept per model (by the bytes' sha256): a pass runs the processor once per
# distinct image, and the submit check's result is reused by the pass that follows.
_KEPT_GRIDS = 256


class ImageProblem(ValueError):
    """An image the server cannot take; the message says why (the caller names the chunk)."""


@dataclass(frozen=True)
class ImageGrid:
    """One processed image: its patches [P, C], its grid (t, h, w) in patches, how many
    placeholder tokens stand for it in the token sequence, and its size as sent."""

    pixel_values_PC: Tensor
    grid_thw: tuple[int, int, int]
    num_tokens: int
    width: int
    height: int


def image_hash(data: bytes) -> str:
    """The key of an image's bytes (processed grids, prefix caches)."""
    return hashlib.sha256(data).hexdigest()


class VisionInputs:
    """The image processor of one model directory and the model's placeholder token."""

    def __init__(self, directory: Path) -> None:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        self.image_token_id = int(config.image_token_id)
        video = getattr(config, "video_token_id", None)
        # Token ids that only a vision chunk may place (a text chunk holding one would be read
        # as a placeholder by the model's own forward).
        self.reserved_ids = frozenset(
            int(i) for i in (self.image_token_id, video) if isinstance(i, int)
        )
        self.processor = AutoImageProcessor.from_pretrained(
            directory, backend="pil", local_files_only=True
        )
        self.merge_size = int(self.processor.merge_size)
        # Set by the loader once the model is built (tower_activation_bytes).
        self.token_activation_bytes = 0
        self._grids: OrderedDict[tuple[str, str], ImageGrid] = OrderedDict()

    def grid(self, data: bytes, image_format: str, *, max_pixels: int) -> ImageGrid:
        """The processed image in `data`; raises ImageProblem for bytes that are not a
        `image_format` image or hold more than `max_pixels` pixels."""
        key = (image_hash(data), image_format)
        kept = self._grids.get(key)
        if kept is not None:
            _check_size(kept.width, kept.height, max_pixels)
            self._grids.move_to_end(key)
            return kept
        image = decoded(data, image_format, max_pixels=max_pixels)
        out = self.processor(images=[image], return_tensors="pt")
        thw = out["image_grid_thw"][0]
        t, h, w = (int(v) for v in thw)
        grid = ImageGrid(
            pixel_values_PC=out["pixel_values"],
            grid_thw=(t, h, w),
            num_tokens=t * h * w // self.merge_size**2,
            width=image.width,
            height=image.height,
        )
        self._grids[key] = grid
        if len(self._grids) > _KEPT_GRIDS:
            self._grids.popitem(last=False)
        return grid

    def forward_inputs(self, grids: Sequence[ImageGrid], tokens_BT: Tensor) -> dict[str, Tensor]:
        """The model forward's image arguments for rows `tokens_BT` whose placeholders stand
        for `grids` in row-major order (the order the model scatters its embeddings in)."""
        device = tokens_BT.device
        return {
            "pixel_values": torch.cat([g.pixel_values_PC for g in grids]).to(device),
            "image_grid_thw": torch.tensor([g.grid_thw for g in grids], device=device),
            "mm_token_type_ids": (tokens_BT == self.image_token_id).to(torch.int32),
        }


def decoded(data: bytes, image_format: str, *, max_pixels: int) -> Image.Image:
    """The RGB image in `data`, which must be a `image_format` ("png" or "jpeg") image of at
    most `max_pixels` pixels; ImageProblem says what is wrong otherwise."""
    expected = FORMATS.get(image_format)
    if expected is None:
        raise ImageProblem(f"format {image_format!r} is not served (png, jpeg)")
    try:
        # A decompression-bomb warning is an error here: the pixel limit below is ours.
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format != expected:
                raise ImageProblem(
                    f"the bytes are a {image.format or 'unknown'} image, not {image_format}"
                )
            _check_size(*image.size, max_pixels)
            image.load()
    except (
        UnidentifiedImageError,
        OSError,
        SyntaxError,
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,
    ) as exc:
        raise ImageProblem(f"the bytes are not a readable {image_format} image ({exc})") from exc
    return image.convert("RGB")


def _check_size(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise ImageProblem(
            f"the image is {width}x{height} = {width * height} pixels; the limit is"
            f" {max_pixels} (--max-image-pixels)"
        )
