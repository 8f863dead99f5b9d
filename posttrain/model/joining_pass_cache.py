"""The cache of a decode pass that also prefills the prompts joining the batch (chunked
prefill): one pass through the model instead of a prefill pass per join and the decode pass.

The pass's tokens come packed, one per batch row ([N, 1]): first the last token of each of the
B decode rows (a FanoutKVCache's rows, one new position each, as a decode pass appends them),
then the joining prompts' uncached positions, prompt after prompt (a KVCache of one row per
prompt, its prefix-cache hits already written). Every linear layer and norm sees N tokens, each
at its own position id, so they need no padding and no change; only attention tells the two
apart, through the JoiningPassAttention of each layer (model/attention.py): `update` stores the
decode rows' keys and values in the fanout cache and returns them, and stores the prompts' in
theirs, which the layout reads back as a prefill pass would.

Legend: B = decode rows, G = joining prompts, Q = widest prompt part of the pass, N = B + the
prompts' positions, K = visible prompt columns.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.model.attention import JoiningPassAttention
from posttrain.model.fanout_kv_cache import FanoutKVCache
from posttrain.model.kv_cache import KVCache


class JoiningPassCache:
    """One pass: decode rows of `decode` and the prompts of `prefill` packed together."""

    def __init__(
        self,
        decode: FanoutKVCache,
        decode_positions: tuple[int, int],
        ragged: bool,
        prefill: KVCache,
        counts_G: list[int],
    ) -> None:
        """`decode_positions` and `ragged`: the decode rows' pass as FanoutKVCache.begin takes
        it (uniform=(1, longest own), ragged); counts_G[g]: positions prompt g runs (at
        least one: its last gives its first token's logits)."""
        assert all(count > 0 for count in counts_G), "every prompt runs its last position"
        self.decode, self.prefill = decode, prefill
        self.decode_rows = decode.own.num_rows
        self._decode_positions, self._ragged = decode_positions, ragged
        self.counts_G = counts_G
        self._positions_GQ: Tensor | None = None
        self._real_W: Tensor | None = None

    @property
    def last_positions(self) -> list[int]:
        """Index in the packed pass of each prompt's last position (its first token's logits)."""
        ends, total = [], self.decode_rows
        for count in self.counts_G:
            total += count
            ends.append(total - 1)
        return ends

    def begin(self, num_new_N: Tensor, uniform: tuple[int, int] | None = None) -> Tensor:
        """The pass's position ids [N, 1] (`num_new_N`: one per packed row, as
        prefill.forward_rows hands it; the split is the constructor's)."""
        device = num_new_N.device
        decode_B1 = self.decode.begin(
            num_new_N[: self.decode_rows], self._decode_positions, ragged=self._ragged
        )
        num_new_G = torch.tensor(self.counts_G, dtype=torch.int64, device=device)
        self._positions_GQ = self.prefill.begin(num_new_G)
        width = self._positions_GQ.shape[1]
        # The real positions of the [G, Q] layout, flattened, known on the host.
        real = [g * width + q for g, count in enumerate(self.counts_G) for q in range(count)]
        self._real_W = torch.tensor(real, dtype=torch.int64, device=device)
        positions_W = self._positions_GQ.reshape(-1).index_select(0, self._real_W)
        packed_N = torch.cat([decode_B1[:, 0], positions_W])
        assert packed_N.shape == num_new_N.shape, "one packed row per new position"
        return packed_N[:, None]

    def attention_masks(
        self, positions_N1: Tensor, layer_types: list[str], sliding_window: int | None
    ) -> dict[str, JoiningPassAttention]:
        assert self._positions_GQ is not None and self._real_W is not None, "after begin()"
        decode = self.decode.attention_masks(
            positions_N1[: self.decode_rows], layer_types, sliding_window
        )
        prefill = self.prefill.attention_masks(self._positions_GQ, layer_types, sliding_window)
        return {
            kind: JoiningPassAttention(
                decode[kind],
                self.decode_rows,
                self.prefill.kv,
                self.prefill.visible_columns(),
                self._real_W,
                prefill[kind],
            )
            for kind in decode
        }

    def placeholder_columns(self, positions_N1: Tensor) -> int:
        assert self._positions_GQ is not None, "after begin()"
        return max(
            self.decode.placeholder_columns(positions_N1[: self.decode_rows]),
            self.prefill.placeholder_columns(self._positions_GQ),
        )

    def update(
        self, key_NHQD: Tensor, value_NHQD: Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        """Store the prompts' positions in theirs and the decode rows' in the fanout cache;
        returns the decode rows' own keys and values (JoiningPassAttention reads the
        prompts' from their cache)."""
        rows = self.decode_rows
        self.prefill.store(key_NHQD[rows:, :, 0], value_NHQD[rows:, :, 0], layer_idx)
        return self.decode.update(key_NHQD[:rows], value_NHQD[:rows], layer_idx)

    def commit(self) -> None:
        self.decode.commit()
        self.prefill.commit()
        self._positions_GQ = self._real_W = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Hugging Face Cache protocol (models only ask when no position ids are given)."""
        return max(self.decode.get_seq_length(), self.prefill.get_seq_length())
