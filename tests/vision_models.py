"""Random-init vision-language models built by the tests (nothing is downloaded), each with the
image processor its family's `preprocessor_config.json` names saved beside it and the
built-in tokenizer's files: Qwen3-VL (dense, or MoE) at two text layers, hidden 64, and a
vision tower of two blocks with one deepstack layer, so every path of the family's forward
(vision embeddings, deepstack features, M-RoPE) runs.

The text vocabulary is the built-in tokenizer's 99 ids plus the family's four vision ids
(vision start and end, image and video placeholders) at 99..102, as in the real checkpoints
where they sit past the text ids. Patches are 16 pixels, merged 2x2: a 64x32 image is a 4x2
grid of patches, 2 placeholder tokens.

`png(width, height, seed)` makes a small PNG of seeded noise.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

from posttrain.config import BUILTIN_MODEL_DIR

VISION_START, VISION_END, IMAGE_TOKEN, VIDEO_TOKEN = 99, 100, 101, 102
VOCAB = 103
PATCH = 16
MERGE = 2


def build_qwen3_vl(directory: Path, *, seed: int = 0, moe: bool = False) -> Path:
    """A tiny Qwen3-VL (`moe`: Qwen3-VL-MoE, 4 experts, top 2, every layer sparse) with its
    processor and tokenizer in `directory`; the directory."""
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    config_class, model_class = (
        (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration)
        if moe
        else (Qwen3VLConfig, Qwen3VLForConditionalGeneration)
    )
    config = config_class(
        text_config=dict(
            **(experts if moe else {}),
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
            bos_token_id=1,
            eos_token_id=0,
            pad_token_id=0,
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=PATCH,
            spatial_merge_size=MERGE,
            temporal_patch_size=2,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        ),
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model_class(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN_MODEL_DIR / name, directory / name)
    processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
        size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    processor.save_pretrained(directory)
    return directory


def png(width: int, height: int, seed: int) -> bytes:
    """A `width` x `height` RGB PNG of seeded noise."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()
