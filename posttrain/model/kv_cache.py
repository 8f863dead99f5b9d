"""A preallocated key/value cache for batched generation, rows of different lengths side by side.

Layout: one tensor `kv` of shape [N, 2, B, H, T, D]:
N = decoder layers, 2 = keys then values, B = rows (allocated), H = KV heads, T = positions
(allocated capacity), D = head dim. Row b holds the keys and values of its tokens at positions
0 .. lengths_B[b] - 1 in columns 0 .. lengths_B[b] - 1: a token's column is its position id, so
rows of different lengths need no padding offset and RoPE positions are just column indices.
Columns at or past a row's length hold zeros or stale values that every attention mask built
here hides (they are always finite, so a masked softmax weight of 0 never meets a NaN).

A forward pass appends per-row chunks: `begin(num_new_B)` takes how many of the Q query
positions of each row are real (shorter rows are right-padded), returns their position ids and
remembers where to write; each attention layer then calls `update` (the Hugging Face Cache
protocol), which stores the real positions only and returns the keys and values of the visible
columns; `commit()` advances the lengths. `attention_masks` gives the boolean masks per layer
type, which the attention function reads from the pass layout (model/attention.py).

Rows come and go without reallocation: `keep` moves the live rows to the front (finished rows
free their slot). `grow` makes room for more positions as rows get long (a new tensor, live
rows only, or the pool's rows); `add_rows` appends rows (requests joining a running decode
batch): within the allocated rows nothing moves, so a cache made with `pool_rows` (a sample
stream's, sized for the rows that may join it) takes joins without touching the running rows'
storage; past them it reallocates and copies. `copy_rows`
fills rows from another cache (KV recomputed after a weights update); `write_span` / `span`
move a row's positions in and out (the prefix cache). A KVCache also serves as either part of
a FanoutKVCache (fanout_kv_cache.py): one row per prompt, and one row per sampled sequence
holding only what it generated.

Legend: N = layers, B = rows, H = KV heads, T = capacity, D = head dim, Q = new positions per
row in one pass, K = visible columns, P = positions of a span.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.model.attention_kinds.linear_attention import (
    LinearAttentionCalls,
    RecurrentPass,
    RecurrentShape,
    RecurrentState,
)
from posttrain.model.kv_shape import KVShape


def power_of_two_at_least(count: int, least: int = 1) -> int:
    """`count` rounded up to a power of two, and to at least `least`: a size that changes
    rarely as `count` grows, so what is made for it (a captured pass) is reused."""
    return max(least, 1 << (count - 1).bit_length())


def fill_holes(keep: list[int]) -> list[int]:
    """A new order of the batch positions in `keep` (ascending) that leaves every kept position
    below len(keep) in place and moves the ones beyond into the holes: the fewest row copies."""
    count = len(keep)
    staying = {i for i in keep if i < count}
    movers = iter(i for i in keep if i >= count)
    return [i if i in staying else next(movers) for i in range(count)]


class KVCache(LinearAttentionCalls):
    """Keys and values of `num_rows` sequences of up to `capacity` positions each."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_rows: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        pool_rows: int = 0,
        recurrent: RecurrentShape | None = None,
    ) -> None:
        """`pool_rows`: rows allocated at least, here and whenever the positions grow (rows
        past `num_rows` wait for add_rows). `recurrent`: the linear-attention layers' state
        each row holds beside its KV (model/attention_kinds/linear_attention.py)."""
        self.pool_rows = pool_rows
        self.num_rows = num_rows
        self.kv = self._allocate(
            (num_layers, 2, max(num_rows, pool_rows), num_kv_heads, capacity, head_dim),
            dtype,
            device,
        )
        self.lengths_B = torch.zeros(max(num_rows, pool_rows), dtype=torch.int64, device=device)
        self._rows_W: Tensor | None = None  # row of each position written by the current pass
        self._cols_W: Tensor | None = None  # its column
        self._valid_BQ: Tensor | None = None  # None: every query position of the pass is real
        self._num_new_B: Tensor | None = None
        self._visible = 0
        # Whether the current pass's rows all append the same positions after the same
        # number of cached ones (set by begin when it reads the lengths): attention may then
        # run as a CausalChunk (model/attention.py) instead of through a mask.
        self.same_start = False
        self.recurrent = (
            None
            if recurrent is None
            else RecurrentState(recurrent, max(num_rows, pool_rows), dtype, device)
        )
        self.recurrent_pass: RecurrentPass | None = None  # the current pass's, set by begin

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A KV tensor whose live rows (the first num_rows) are zeros: masked columns are
        multiplied by a 0 attention weight, and 0 * NaN from uninitialised memory would poison
        the row. Pool rows beyond them stay uninitialised (no writes, and on the CPU no
        resident pages, until used): add_rows zeroes each row it hands out."""
        if shape[2] == self.num_rows:
            return torch.zeros(shape, dtype=dtype, device=device)
        kv = torch.empty(shape, dtype=dtype, device=device)
        kv[:, :, : self.num_rows].zero_()
        return kv

    @classmethod
    def for_model(
        cls,
        shape: KVShape,
        *,
        num_rows: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        pool_rows: int = 0,
    ) -> KVCache:
        """A cache of the shape a model's attention writes (model/kv_shape.py probes it from
        the modules: a config may carry head counts its family ignores)."""
        return cls(
            num_layers=shape.num_layers,
            num_rows=num_rows,
            capacity=capacity,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            dtype=dtype,
            device=device,
            pool_rows=pool_rows,
            recurrent=shape.recurrent,
        )

    @property
    def free_rows(self) -> int:
        """Rows add_rows can hand out without reallocating."""
        return self.kv.shape[2] - self.num_rows

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    def recurrent_bytes(self) -> int:
        """Bytes of the rows' recurrent states (0: no linear-attention layers)."""
        if self.recurrent is None:
            return 0
        return self.recurrent.conv.nbytes + self.recurrent.delta.nbytes

    # ------------------------------------------------------------ one forward pass

    def begin(self, num_new_B: Tensor, uniform: tuple[int, int] | None = None) -> Tensor:
        """Prepare a pass that appends num_new_B[b] positions to row b; returns position ids
        [B, Q] (Q = max num_new_B; positions past a row's num_new are padding).

        `uniform` = (width, longest): the caller knows that every row appends `width`
        positions and that the longest row then holds `longest` (the sampler's decode passes),
        so nothing is read back from the device."""
        assert num_new_B.shape == (self.num_rows,), "one count per row"
        lengths_B = self.lengths_B[: self.num_rows]
        self.same_start = False
        if uniform is None:
            width = int(num_new_B.max())
            longest = int((lengths_B + num_new_B).max())
            same_width = bool((num_new_B == width).all())
            self.same_start = same_width and bool((lengths_B == longest - width).all())
        else:
            (width, longest), same_width = uniform, True
        assert longest <= self.capacity, "KV cache capacity exceeded"
        offsets_Q = torch.arange(width, device=lengths_B.device)
        positions_BQ = lengths_B[:, None] + offsets_Q[None, :]
        if same_width:
            self._valid_BQ = None
            rows_B = torch.arange(self.num_rows, device=lengths_B.device)
            self._rows_W = rows_B.repeat_interleave(width)
            self._cols_W = positions_BQ.reshape(-1)
        else:
            valid_BQ = offsets_Q[None, :] < num_new_B[:, None]
            rows_BQ = torch.arange(self.num_rows, device=lengths_B.device)[:, None].expand_as(
                positions_BQ
            )
            self._valid_BQ = valid_BQ
            self._rows_W = rows_BQ[valid_BQ]
            self._cols_W = positions_BQ[valid_BQ]
        self._num_new_B = num_new_B
        if self.recurrent is not None:
            self.recurrent_pass = RecurrentPass(
                self.recurrent, num_new_B, width, ragged=not same_width
            )
        # Padding positions may lie past the capacity; they are never stored, so the visible
        # columns end at the last real position.
        self._visible = longest
        return positions_BQ

    def attention_masks(
        self, positions_BQ: Tensor, layer_types: list[str], sliding_window: int | None
    ) -> dict[str, Tensor]:
        """Boolean [B, 1, Q, K] masks per layer type: query at position p sees columns <= p
        (and > p - window for sliding-attention layers). True = attend."""
        columns_K = torch.arange(self._visible, device=positions_BQ.device)
        causal_BQK = columns_K[None, None, :] <= positions_BQ[:, :, None]
        masks = {"full_attention": causal_BQK[:, None]}
        if "sliding_attention" in layer_types:
            assert sliding_window is not None, "sliding-attention layers need a window"
            recent_BQK = columns_K[None, None, :] > positions_BQ[:, :, None] - sliding_window
            masks["sliding_attention"] = (causal_BQK & recent_BQK)[:, None]
        return masks

    def placeholder_columns(self, positions_BQ: Tensor) -> int:
        """Columns of the placeholder mask a pass hands the model: its last position + 1."""
        return int(positions_BQ.max()) + 1

    def visible_columns(self) -> int:
        """Columns the current pass's attention reads (set by begin)."""
        return self._visible

    def update(
        self, key_BHQD: Tensor, value_BHQD: Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        """Called by each attention layer: store this pass's real positions, return the keys
        and values of the visible columns ([B, H, K, D] views)."""
        flat = []
        for new_BHQD in (key_BHQD, value_BHQD):
            new_BQHD = new_BHQD.transpose(1, 2)
            if self._valid_BQ is None:
                flat.append(new_BQHD.reshape(-1, *new_BQHD.shape[2:]))
            else:
                flat.append(new_BQHD[self._valid_BQ])
        self.store(flat[0], flat[1], layer_idx)
        visible = self.kv[layer_idx, :, : self.num_rows, :, : self._visible]
        return visible[0], visible[1]

    def store(self, key_WHD: Tensor, value_WHD: Tensor, layer_idx: int) -> None:
        """Store this pass's real positions given flat [W, H, D], row after row in position
        order (what `update` takes padded; a pass whose tokens come packed, one per batch row,
        hands them so: model/joining_pass_cache.py)."""
        assert self._rows_W is not None, "store() outside begin()/commit()"
        for slot, new_WHD in ((0, key_WHD), (1, value_WHD)):
            self.kv[layer_idx, slot, self._rows_W, :, self._cols_W] = new_WHD.to(self.kv.dtype)

    def commit(self) -> None:
        assert self._num_new_B is not None, "commit() without begin()"
        self.lengths_B[: self.num_rows] += self._num_new_B
        self._rows_W = self._cols_W = self._valid_BQ = self._num_new_B = None
        self.recurrent_pass = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Hugging Face Cache protocol; models only ask when no position ids are given."""
        return int(self.lengths_B[: self.num_rows].max()) if self.num_rows else 0

    def linear_pass(self) -> RecurrentPass:
        """What a linear-attention layer reads and writes in this pass (a recurrent cache)."""
        assert self.recurrent_pass is not None, "a linear-attention layer outside begin()"
        return self.recurrent_pass

    # ------------------------------------------------------------ rows

    def keep(self, rows_R: Tensor) -> None:
        """Row i becomes old row rows_R[i]; rows past len(rows_R) are freed. Only rows that
        change place are copied, so filling the holes of finished rows with rows from the end
        costs one row copy per finished row, not a copy of the whole batch."""
        count = len(rows_R)
        targets_R = torch.arange(count, device=rows_R.device)
        moved_R = rows_R != targets_R
        if bool(moved_R.any()):
            sources, destinations = rows_R[moved_R], targets_R[moved_R]
            used = int(self.lengths_B[sources].max())
            # The right side is gathered into a new tensor before any write: overlap is safe.
            self.kv[:, :, destinations, :, :used] = self.kv[:, :, sources, :, :used]
            self.lengths_B[destinations] = self.lengths_B[sources]
            if self.recurrent is not None:
                self.recurrent.copy_rows(self.recurrent, sources, destinations)
        self.num_rows = count

    def grow(self, capacity: int) -> None:
        """Room for `capacity` positions per row: a new tensor holding the live rows only (or
        the pool's rows), so the memory of freed rows is returned too."""
        assert capacity >= self.capacity, "a cache never shrinks its positions"
        num_layers, _, _, heads, _, head_dim = self.kv.shape
        rows = max(self.num_rows, self.pool_rows)
        shape = (num_layers, 2, rows, heads, capacity, head_dim)
        kv = self._allocate(shape, self.kv.dtype, self.kv.device)
        lengths_B = self.lengths_B.new_zeros(rows)
        if self.num_rows:
            used = int(self.lengths_B[: self.num_rows].max())
            kv[:, :, : self.num_rows, :, :used] = self.kv[:, :, : self.num_rows, :, :used]
            lengths_B[: self.num_rows] = self.lengths_B[: self.num_rows]
        self.kv, self.lengths_B = kv, lengths_B
        if self.recurrent is not None:
            self.recurrent = self.recurrent.resized(rows, self.num_rows)

    def add_rows(
        self, count: int, source: KVCache | None = None, source_rows_R: Tensor | None = None
    ) -> None:
        """Append `count` rows after the live ones: empty (length 0), or copies of `source`'s
        rows source_rows_R (rows joining a running batch). Allocated rows (a pool's, or freed
        by `keep`) are used first, the live rows' storage untouched; past them a new tensor
        holds twice the rows (and, for longer source rows, more positions), so a stream of
        joins copies the live rows a logarithmic number of times, not at every join."""
        needed = self.num_rows + count
        allocated = self.kv.shape[2]
        columns = self.capacity
        if source is not None:
            assert source_rows_R is not None and len(source_rows_R) == count
            if count:
                columns = max(columns, int(source.lengths_B[source_rows_R].max()))
        if needed > allocated or columns > self.capacity:
            rows = max(needed, 2 * allocated) if needed > allocated else allocated
            num_layers, _, _, heads, _, head_dim = self.kv.shape
            kv = self.kv.new_zeros(num_layers, 2, rows, heads, columns, head_dim)
            lengths_B = self.lengths_B.new_zeros(rows)
            if self.num_rows:
                used = int(self.lengths_B[: self.num_rows].max())
                kv[:, :, : self.num_rows, :, :used] = self.kv[:, :, : self.num_rows, :, :used]
                lengths_B[: self.num_rows] = self.lengths_B[: self.num_rows]
            self.kv, self.lengths_B = kv, lengths_B
            if self.recurrent is not None:
                self.recurrent = self.recurrent.resized(rows, self.num_rows)
        if self.recurrent is not None:
            self.recurrent.zero(self.num_rows, needed)
        # A pool's row was never written: zeroed (finite, and hidden by every mask).
        self.kv[:, :, self.num_rows : needed] = 0
        self.lengths_B[self.num_rows : needed] = 0
        targets_R = torch.arange(self.num_rows, needed, device=self.kv.device)
        self.num_rows = needed
        if source is not None:
            assert source_rows_R is not None
            self.copy_rows(source, source_rows_R, targets_R)

    def copy_rows(self, source: KVCache, source_rows_R: Tensor, target_rows_R: Tensor) -> None:
        """Row target_rows_R[i] becomes a copy of source row source_rows_R[i]."""
        if len(source_rows_R) == 0:
            return
        used = int(source.lengths_B[source_rows_R].max())
        assert used <= self.capacity, "KV cache capacity exceeded"
        self.kv[:, :, target_rows_R, :, :used] = source.kv[:, :, source_rows_R, :, :used].to(
            self.kv.dtype
        )
        self.lengths_B[target_rows_R] = source.lengths_B[source_rows_R]
        if self.recurrent is not None:
            assert source.recurrent is not None, "a recurrent state comes from a cache with one"
            self.recurrent.copy_rows(source.recurrent, source_rows_R, target_rows_R)

    def write_span(self, row: int, start: int, span_N2HPD: Tensor) -> None:
        """Store a span of positions start .. start + P - 1 into `row`; its length becomes the
        span's end. Not for a cache with a recurrent state (a span carries no state)."""
        assert self.recurrent is None, "a recurrent state exists only at a row's end"
        end = start + span_N2HPD.shape[3]
        self.kv[:, :, row, :, start:end] = span_N2HPD
        self.lengths_B[row] = end

    def span(self, row: int, start: int, end: int) -> Tensor:
        """A view [N, 2, H, P, D] of positions start .. end - 1 of `row`."""
        return self.kv[:, :, row, :, start:end]
