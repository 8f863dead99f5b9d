"""The shape of a model's keys and values, read from its modules rather than from its config.

A config may carry fields its family ignores: a GPT-NeoX `config.json` with
`num_key_value_heads` or `head_dim` still builds attention with one key/value head per query
head, each `hidden_size / num_attention_heads` wide. Sizing a KV cache from such fields
allocates the wrong shape. So `kv_shape` asks the model itself: it runs the embedding and the
first attention layer on one token with a probe in place of the cache, and the probe stops the
pass at the first `update` call, whose keys are [B, H, Q, D]. The pass stops before any MLP,
so the probe also runs on the meta device (no weights read or allocated) and costs next to
nothing on a real one.

Every attention layer of a model posttrain serves has the same KV heads and head dim (the KV
cache holds them in one tensor); the layer count is the number of attention layers, the
modules that carry the `layer_idx` the cache protocol and model/attention.py index by. A
hybrid's attention modules are numbered 0, 1, ... (linear_attention.install), its linear
layers keep no KV and add a recurrent state per row instead (attention_kinds/linear_attention.py).

Not here: the cache itself (kv_cache.py), the memory estimate (engine/memory/estimate.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

import torch
from torch import Tensor
from transformers import PreTrainedModel

from posttrain.model.attention_kinds.linear_attention import (
    LINEAR_ATTENTION_CLASSES,
    RecurrentShape,
    recurrent_shape,
)


@dataclass(frozen=True)
class KVShape:
    """What one position of one row costs in a KV cache: num_layers x 2 x heads x head_dim;
    and what a row's recurrent state holds beside it (linear-attention layers; None: none)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    recurrent: RecurrentShape | None = None


class _FirstUpdate(Exception):
    """Raised by the probe cache to end the pass once the first keys are seen."""

    def __init__(self, key_BHQD: Tensor) -> None:
        super().__init__("probe pass stopped at the first attention layer")
        self.shape = tuple(key_BHQD.shape)


class _ProbeCache:
    """The Hugging Face cache protocol as far as a pass reaches before its first `update`."""

    def update(
        self, key_BHQD: Tensor, value_BHQD: Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> NoReturn:
        raise _FirstUpdate(key_BHQD)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    # A hybrid's linear-attention layers (Gated DeltaNet, linear_attention.py) that run
    # before the first attention layer read and write recurrent state instead: none is kept.
    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> None:
        return None

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> None:
        return None

    def update_conv_state(self, states_BCQ: Tensor, *args: object, **kwargs: object) -> Tensor:
        return states_BCQ

    def get_recurrent_states_to_keep(self, layer_idx: int) -> int:
        return 0

    def update_recurrent_state(self, *args: object, **kwargs: object) -> None:
        return None


def kv_shape(model: PreTrainedModel) -> KVShape:
    """The KV shape `model`'s attention layers write (a causal LM, on any device, meta too)."""
    device = next(model.parameters()).device
    tokens_BQ = torch.zeros(1, 1, dtype=torch.int64, device=device)
    # A 4-D mask is passed on as-is by every family's mask creation (engine/generate/prefill.py
    # does the same), so the probe needs no more of the cache protocol than `update`.
    mask_BHQK = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
    try:
        with torch.no_grad():
            model.base_model(
                input_ids=tokens_BQ,
                position_ids=tokens_BQ,
                attention_mask=mask_BHQK,
                cache=_ProbeCache(),
                use_cache=True,
            )
    except _FirstUpdate as probed:
        _, heads, _, head_dim = probed.shape
    else:
        raise AssertionError(f"{type(model).__name__}: a forward pass never updated its cache")
    # Attention modules carry their layer's index; a decoder layer that carries it too has the
    # same one, so the distinct indices count the attention layers.
    layers = {
        index
        for m in model.modules()
        if isinstance(index := vars(m).get("layer_idx"), int)
        and type(m).__name__ not in LINEAR_ATTENTION_CLASSES
    }
    assert layers == set(range(len(layers))), f"attention layer indices {sorted(layers)}"
    return KVShape(
        num_layers=len(layers),
        num_kv_heads=heads,
        head_dim=head_dim,
        recurrent=recurrent_shape(model),
    )
