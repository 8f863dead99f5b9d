"""One-token decode passes over a FanoutKVCache with static shapes, so that a CUDA graph can
capture a pass and replay it (engine/generate/decode_graph.py).

A FanoutKVCache pass (fanout_kv_cache.py) slices the own part to the columns in use and
builds its write indices and masks from Python ints that change every pass. Here every shape
is fixed for the life of the batch's layout and everything a pass reads that changes lives
in a persistent tensor, advanced in place by the pass itself:

- `own_length_B`, a device tensor: the own positions each row holds (the same for all rows
  unless rows joined a running batch, engine/generate/sampler.py). A pass writes each row's
  keys and values at its column (an index_put_ with device indices, no host index) and then adds
  one to every row;
- attention reads the own part's full capacity, hiding each row's columns past its
  `own_length_B` with an additive bias built in the pass from it; the prefix part (each
  prefix row up to a power of two of columns, PREFIX_COLUMNS_AT_LEAST) and its bias are the
  layout's;
- position ids are the prefix lengths plus `own_length_B`.

The capacity and rows are the FanoutKVCache's at construction: a grow, a compaction or a
join that appends rows makes a new StaticDecodeCache. Rows that restart on a new prompt in
place (`refill`: a join into padding rows) keep it. Full-attention layers only (a sliding
window would need per-pass prefix biases too): static_decode_supported says when it applies.

Legend: B = rows, S = own capacity, P = prefix columns, Q = new positions per row (1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.model.attention import SharedPrefixAttention
from posttrain.model.fanout_kv_cache import FanoutKVCache

# A layout reads each prefix row up to a power of two of columns, at least this many (as far as
# the prefix cache holds), not only up to the longest prompt's: a prompt joining into padding
# rows (engine/generate/padding_joins.py) up to that long keeps the layout and its CUDA graph,
# whose capture costs about 13 replayed passes on the H200. The columns past a row's prompt are
# masked; what attention reads of them a launch-bound pass does not notice (docs/benchmarks.md).
PREFIX_COLUMNS_AT_LEAST = 64


def static_decode_supported(layer_types: list[str]) -> bool:
    """Whether every layer's attention is full (no window): the only masks built here."""
    return all(kind == "full_attention" for kind in layer_types)


class StaticDecodeCache:
    """The KVCache protocol of forward passes (begin / attention_masks / update / commit) for
    one-token decode passes whose every shape is fixed."""

    def __init__(self, fanout: FanoutKVCache, own_lengths: list[int]) -> None:
        own = fanout.own
        device = own.kv.device
        self.fanout = fanout
        self.rows = own.num_rows
        self.capacity = own.capacity
        assert len(own_lengths) == self.rows, "one own length per row"
        assert max(own_lengths) < self.capacity, "no room for the next own position"
        self.own_length_B = torch.tensor(own_lengths, dtype=torch.int64, device=device)
        self._rows_B = torch.arange(self.rows, device=device)
        self._columns_S = torch.arange(self.capacity, device=device)
        (self._prefix_kv, self._slot_B, self._per_group, prefix_lengths_B) = fanout.prefix_layout(
            round_up=PREFIX_COLUMNS_AT_LEAST
        )
        # Its own copy: `refill` writes it, and the fanout keeps the one it lent per layout.
        self._prefix_lengths_B = prefix_lengths_B.clone()
        self.prefix_columns = self._prefix_kv.shape[4]
        self._prefix_P = torch.arange(self.prefix_columns, device=device)
        self._prefix_bias_BQP = torch.zeros(self.rows, 1, self.prefix_columns, device=device)
        self._hide_past_prefixes()

    def _hide_past_prefixes(self) -> None:
        """The prefix bias [B, 1, P]: each row sees its prompt's columns (-inf past them)."""
        past_BP = self._prefix_P[None, :] >= self._prefix_lengths_B[:, None]
        self._prefix_bias_BQP.zero_().masked_fill_(past_BP[:, None, :], float("-inf"))

    def begin(self, num_new_B: Tensor | None = None, uniform: object = None) -> Tensor:
        """Position ids [B, 1] of this pass's token of every row."""
        return (self._prefix_lengths_B + self.own_length_B)[:, None]

    def placeholder_columns(self, positions_BQ: Tensor) -> int:
        return self.prefix_columns + self.capacity

    def attention_masks(
        self, positions_BQ: Tensor, layer_types: list[str], sliding_window: int | None
    ) -> dict[str, SharedPrefixAttention]:
        assert static_decode_supported(layer_types), "static passes serve full attention only"
        own_bias_B1S = torch.zeros(self.rows, 1, self.capacity, device=positions_BQ.device)
        own_bias_B1S.masked_fill_(
            self._columns_S[None, None, :] > self.own_length_B[:, None, None], float("-inf")
        )
        device_type = positions_BQ.device.type
        return {
            "full_attention": SharedPrefixAttention(
                self._prefix_kv,
                self._slot_B,
                self._per_group,
                self._prefix_bias_BQP,
                own_bias_B1S,
                fused=device_type in ("cpu", "cuda"),
            )
        }

    def refill(self, rows: list[int], prefix_length: int) -> None:
        """Rows `rows` restart empty on a prefix of `prefix_length` positions, which the
        FanoutKVCache's refill put in the prefix row they read: their own lengths, positions
        and prefix bias change in place (the addresses a captured pass reads stay)."""
        assert prefix_length <= self.prefix_columns, "the prefix fits the layout's columns"
        self.restart(rows)
        rows_R = torch.tensor(rows, dtype=torch.int64, device=self.own_length_B.device)
        self._prefix_lengths_B[rows_R] = prefix_length
        self._hide_past_prefixes()

    def restart(self, rows: list[int]) -> None:
        """Rows `rows` hold no own position any more (in place, as `commit` advances them)."""
        rows_R = torch.tensor(rows, dtype=torch.int64, device=self.own_length_B.device)
        self.own_length_B[rows_R] = 0
        self.fanout.own.lengths_B[rows_R] = 0

    def update(
        self, key_BHQD: Tensor, value_BHQD: Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        """Store this pass's keys and values of row b at its column own_length_B[b]; return
        the own part's full capacity [B, H, S, D] (the bias hides what is past each row's)."""
        kv = self.fanout.own.kv
        for slot, new_BHQD in ((0, key_BHQD), (1, value_BHQD)):
            kv[layer_idx, slot][self._rows_B, :, self.own_length_B] = new_BHQD[:, :, 0].to(kv.dtype)
        return kv[layer_idx, 0, : self.rows], kv[layer_idx, 1, : self.rows]

    def commit(self) -> None:
        self.own_length_B.add_(1)
        self.fanout.own.lengths_B[: self.rows].add_(1)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise AssertionError("static passes always give position ids")
