"""The model's output head as its own forward applies it: the projection to the vocabulary
plus whatever the family's ForCausalLM.forward does to the logits after it.

The trainer's chunked log-softmax and the sampler call the head on hidden states themselves
(they never run the ForCausalLM forward, which would materialise every position's logits), so
the post-processing must be applied here or every logprob is silently off: Granite divides by
`logits_scaling`, Cohere multiplies by `logit_scale`, some families by `output_multiplier`,
Gemma 2 and 3 soft-cap with `final_logit_softcapping`. Each is read from the config in the
order the forwards apply them: scaling first, then soft-capping.

Imports: torch, transformers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel


def logit_transform(config: object) -> Callable[[Tensor], Tensor] | None:
    """What the family's forward applies to lm_head's output, or None when nothing."""
    steps: list[Callable[[Tensor], Tensor]] = []
    divide = getattr(config, "logits_scaling", None)
    if divide not in (None, 1, 1.0):
        steps.append(_divided_by(float(divide)))
    for name in ("logit_scale", "output_multiplier"):
        multiply = getattr(config, name, None)
        if isinstance(multiply, (int, float)) and multiply != 1:
            steps.append(_multiplied_by(float(multiply)))
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        steps.append(_soft_capped(float(cap)))
    if not steps:
        return None

    def apply(logits: Tensor) -> Tensor:
        for step in steps:
            logits = step(logits)
        return logits

    return apply


def _divided_by(divisor: float) -> Callable[[Tensor], Tensor]:
    return lambda x: x / divisor


def _multiplied_by(factor: float) -> Callable[[Tensor], Tensor]:
    return lambda x: x * factor


def _soft_capped(cap: float) -> Callable[[Tensor], Tensor]:
    return lambda x: torch.tanh(x / cap) * cap


class TransformedHead(nn.Module):
    """A projection followed by the family's logit post-processing."""

    def __init__(self, projection: nn.Module, transform: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.projection = projection
        self.transform = transform

    def forward(self, hidden: Tensor) -> Tensor:
        return self.transform(self.projection(hidden))


def output_head(model: PreTrainedModel) -> nn.Module:
    """hidden states -> the logits model(ids).logits has (the bare projection when the family
    applies nothing more, so the frozen-head fast path of engine/train/logprobs.py still
    applies)."""
    projection = output_projection(model)
    assert projection is not None, f"{type(model).__name__} has no output embeddings"
    transform = logit_transform(model.config.get_text_config())
    return projection if transform is None else TransformedHead(projection, transform)


def output_projection(model: PreTrainedModel) -> nn.Module | None:
    """The model's projection to the vocabulary (its lm_head), None for a model without one:
    `get_output_embeddings`, which transformers leaves unannotated."""
    get_output_embeddings: Callable[[], nn.Module | None] = model.get_output_embeddings
    return get_output_embeddings()
