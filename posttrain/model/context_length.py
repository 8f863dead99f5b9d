"""A model's context length: the positions it was trained for, read from its config.json.

`max_position_embeddings`, unless the config's rope scaling (`rope_scaling`, or transformers
5's `rope_parameters`, flat or per layer type) says the model was extended past it. The rule
per rope type follows transformers' semantics (modeling_rope_utils.py):

- yarn: `factor` is the ratio of the extended context to the pretrained one,
  `original_max_position_embeddings` (in the rope dict, or beside it in the config, or when
  absent `max_position_embeddings`, as transformers' standardize_rope_params fills it in): the
  context is their product. Qwen3 with YaRN: 4 x 32,768 = 131,072 beside
  max_position_embeddings 40,960; DeepSeek-V3: 40 x 4,096 = its max_position_embeddings.
- dynamic (NTK): transformers rescales once a sequence passes `max_position_embeddings`, the
  pretrained length: the context is `factor` times it.
- every other type (default, linear, llama3, longrope, mrope, ...): the config's
  `max_position_embeddings` already is the context (Llama 3.1's 131,072 with llama3 factor 8
  over 8,192; Phi-3's longrope; Gemma 3's linear factor 8 over 131,072).

Never less than `max_position_embeddings`. Imports nothing from posttrain.
"""

from __future__ import annotations

from collections.abc import Mapping

# What transformers assumes of a config without the field (PretrainedConfig's old default).
DEFAULT_POSITIONS = 2048
ORIGINAL = "original_max_position_embeddings"


def text_config(config: Mapping[str, object]) -> Mapping[str, object]:
    """The part of a config.json (as a dict) that describes the language model: the nested
    `text_config` of a vision-language model, else the config itself."""
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) else config


def context_length(config: Mapping[str, object]) -> int:
    """Positions a model of this config.json (as a dict) takes in one sequence."""
    config = text_config(config)
    positions = _int(config.get("max_position_embeddings"), DEFAULT_POSITIONS)
    extended = [_scaled(config, positions, rope) for rope in _rope_dicts(config)]
    return max([positions, *extended])


def _rope_dicts(config: Mapping[str, object]) -> list[Mapping[str, object]]:
    """The config's rope dicts: the one dict, or one per layer type (Gemma 3's nesting)."""
    found: list[Mapping[str, object]] = []
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key)
        if not isinstance(rope, Mapping):
            continue
        nested = [value for value in rope.values() if isinstance(value, Mapping)]
        found.extend(nested if nested else [rope])
    return found


def _scaled(config: Mapping[str, object], positions: int, rope: Mapping[str, object]) -> int:
    """The context one rope dict extends the model to (`positions` where it does not)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    factor = rope.get("factor")
    if not isinstance(factor, int | float) or factor <= 1:
        return positions
    if kind == "yarn":
        original = _int(rope.get(ORIGINAL), _int(config.get(ORIGINAL), positions))
        return int(original * factor)
    if kind == "dynamic":
        return int(positions * factor)
    return positions


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
