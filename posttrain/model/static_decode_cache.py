"""One-token decode passes over a FanoutKVCache with static shapes, so that a CUDA graph can
capture a pass and replay it (engine/generate/decode_graph.py).

A FanoutKVCache pass (fanout_kv_cache.py) slices the own part to the columns in use and
builds its write indices and masks from Python ints that change every pass. Here every shape
is fixed for the life of the batch's layout and everything a pass reads that changes lives
in a persistent tensor, advanced in place by the pass itself:

- `own_length`, a 0-d device tensor: the own positions every row holds (all rows of a decode
  batch hold the same count, engine/generate/sampler.py). A pass writes its keys and values at that
  column (index_copy_, no host index) and then adds one;
- attention reads the own part's full capacity, hiding the columns past `own_length` with an
  additive bias built in the pass from it; the prefix part and its bias are the layout's;
- position ids are the prefix lengths plus `own_length`.

The capacity and rows are the FanoutKVCache's at construction: a grow, a compaction or a new
prefix makes a new StaticDecodeCache. Full-attention layers only (a sliding window would need
per-pass prefix biases too): static_decode_supported says when it applies.

Legend: B = rows, S = own capacity, P = prefix columns, Q = new positions per row (1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.model.attention import SharedPrefixAttention
from posttrain.model.fanout_kv_cache import FanoutKVCache


def static_decode_supported(layer_types: list[str]) -> bool:
    """Whether every layer's attention is full (no window): the only masks built here."""
    return all(kind == "full_attention" for kind in layer_types)


class StaticDecodeCache:
    """The KVCache protocol of forward passes (begin / attention_masks / update / commit) for
    one-token decode passes whose every shape is fixed."""

    def __init__(self, fanout: FanoutKVCache, own_length: int) -> None:
        own = fanout.own
        device = own.kv.device
        self.fanout = fanout
        self.rows = own.num_rows
        self.capacity = own.capacity
        assert own_length < self.capacity, "no room for the next own position"
        self.own_length = torch.tensor(own_length, device=device)
        self._columns_S = torch.arange(self.capacity, device=device)
        (self._prefix_kv, self._slot_B, self._per_group, self._prefix_lengths_B, bias) = (
            fanout.prefix_layout()
        )
        self._prefix_bias_BQP = bias
        self._prefix_columns = self._prefix_kv.shape[4]

    def begin(self, num_new_B: Tensor | None = None, uniform: object = None) -> Tensor:
        """Position ids [B, 1] of this pass's token of every row."""
        return (self._prefix_lengths_B + self.own_length)[:, None]

    def placeholder_columns(self, positions_BQ: Tensor) -> int:
        return self._prefix_columns + self.capacity

    def attention_masks(
        self, positions_BQ: Tensor, layer_types: list[str], sliding_window: int | None
    ) -> dict[str, SharedPrefixAttention]:
        assert static_decode_supported(layer_types), "static passes serve full attention only"
        own_bias_S = torch.zeros(self.capacity, device=positions_BQ.device).masked_fill_(
            self._columns_S > self.own_length, float("-inf")
        )
        device_type = positions_BQ.device.type
        return {
            "full_attention": SharedPrefixAttention(
                self._prefix_kv,
                self._slot_B,
                self._per_group,
                self._prefix_bias_BQP,
                own_bias_S.expand(self.rows, 1, self.capacity),
                fused=device_type in ("cpu", "cuda"),
            )
        }

    def update(
        self, key_BHQD: Tensor, value_BHQD: Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        """Store this pass's keys and values at column own_length; return the own part's
        full capacity [B, H, S, D] (the bias hides what is past own_length)."""
        kv = self.fanout.own.kv
        column_1 = self.own_length.view(1)
        for slot, new_BHQD in ((0, key_BHQD), (1, value_BHQD)):
            kv[layer_idx, slot, : self.rows].index_copy_(2, column_1, new_BHQD.to(kv.dtype))
        return kv[layer_idx, 0, : self.rows], kv[layer_idx, 1, : self.rows]

    def commit(self) -> None:
        self.own_length.add_(1)
        self.fanout.own.lengths_B[: self.rows].add_(1)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise AssertionError("static passes always give position ids")
