"""A vision-language model's parts beside its language model: whether transformers builds a
config as one, its vision tower's attention implementation, and an upper bound on the tower's
activation bytes per image token (engine/memory/estimate.py).

Not here: images and their processor (images.py).
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from posttrain.model.logit_head import output_projection


def is_vision_language(config: PreTrainedConfig) -> bool:
    """Whether transformers builds `config` as an image-text-to-text model and not as a plain
    causal LM (Qwen3-VL, Qwen2.5-VL, ...)."""
    model_type = config.model_type
    return (
        model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )


def keep_tower_attention(model: PreTrainedModel, implementation: str) -> None:
    """Give the sub-models other than the language model (the vision tower) back their own
    attention `implementation`: posttrain's attention (model/attention.py) serves decoder
    layers, whose masks a sampler pass lays out per layer; a vision tower's attention is
    bidirectional within each image and has no such layer."""
    towers = {key: implementation for key in model.config.sub_configs if key != "text_config"}
    model.set_attn_implementation(towers)


def tower_activation_bytes(model: PreTrainedModel, merge_size: int) -> int:
    """An upper bound on the vision tower's activation bytes per image placeholder token: the
    merge window's patches (merge_size**2) through every Linear outside the decoder layers and
    the head, twice (beside each output, the input of a norm or residual add)."""
    head = output_projection(model)
    widths = sum(
        module.out_features
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and ".layers." not in f".{name}." and module is not head
    )
    itemsize = next(model.parameters()).element_size()
    return 2 * widths * merge_size**2 * itemsize
