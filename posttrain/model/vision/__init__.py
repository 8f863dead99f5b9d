"""Vision-language models: images into the model's own forward (images.py) and the parts
beside the language model (towers.py)."""

from posttrain.model.vision.images import (
    FORMATS,
    ImageGrid,
    ImageProblem,
    VisionInputs,
    decoded,
    image_hash,
)
from posttrain.model.vision.towers import (
    is_vision_language,
    keep_tower_attention,
    tower_activation_bytes,
)

__all__ = [
    "FORMATS",
    "ImageGrid",
    "ImageProblem",
    "VisionInputs",
    "decoded",
    "image_hash",
    "is_vision_language",
    "keep_tower_attention",
    "tower_activation_bytes",
]
