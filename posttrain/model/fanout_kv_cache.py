"""A decode cache whose rows continue shared prefixes: each prompt's KV stored once for all the
rows sampled from it. It lives for one generate call (engine/generate/sampler.py); prompt KV kept
between requests is the prefix cache's (engine/generate/prefix_cache.py), not this.

Two parts:
- `prefix`: a KVCache with one row per prefix group (a prompt's prefill), P_g positions each;
- `own`: a KVCache with one row per sequence holding only the positions after its prefix: own
  column c of row b is position P_group(b) + c.

A forward pass appends to the own part (`begin` / `update` / `commit`, the KVCache protocol
with absolute position ids) and attends through SharedPrefixAttention (model/attention.py),
which `attention_masks` returns per layer type. `keep` frees finished rows like KVCache.keep and
also frees the prefixes no live row reads any more, so attention never reads a dead prompt;
`join` appends the prefixes and rows of requests joining a running decode batch; `refill` puts
one in the place of a prefix whose rows all ended (static passes keep them as padding) or of a
placeholder's (`add_placeholders`: rows a stream's static layout holds for joins).

Prefix groups are named by the caller's ids (`group_ids_B`); `prefix_row` maps them to rows of
the prefix cache, which move when dead prefixes are freed.

Legend: B = rows, G = live prefix groups, Q = new positions per row, P = prefix columns,
S = own columns, K = P + S.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.model.attention import SharedPrefixAttention
from posttrain.model.attention_kinds.linear_attention import LinearAttentionCalls, RecurrentPass
from posttrain.model.kv_cache import KVCache, fill_holes, power_of_two_at_least


def _bias(visible_BQK: Tensor, width: int, *, check: bool = True) -> Tensor | None:
    """Additive bias [B, Q, K] (0 = attend, -inf = not), or None when every column is visible
    (`check` off: the caller knows some column is hidden, nothing is read back)."""
    if check and bool(visible_BQK.all()):
        return None
    visible_BQK = visible_BQK.expand(-1, width, -1)
    return torch.zeros(visible_BQK.shape, device=visible_BQK.device).masked_fill_(
        ~visible_BQK, float("-inf")
    )


class FanoutKVCache(LinearAttentionCalls):
    """Rows of `own` continuing the prefixes in rows of `prefix`."""

    def __init__(
        self, prefix: KVCache, prefix_ids: list[int], own: KVCache, group_ids_B: list[int]
    ):
        assert len(prefix_ids) == prefix.num_rows, "one id per prefix row"
        assert len(group_ids_B) == own.num_rows, "one prefix group per own row"
        self.prefix = prefix
        self.own = own
        self.prefix_row = {gid: row for row, gid in enumerate(prefix_ids)}
        self.group_ids_B = list(group_ids_B)
        self._layout: tuple[Tensor | None, int, Tensor] | None = None
        # Per layout: the longest prefix, and the prefix bias of full-attention layers (it
        # does not depend on the query positions); reset with the layout.
        self._prefix_columns: int | None = None
        self._full_prefix_bias: dict[int, Tensor | None] = {}
        self._uniform = False  # this pass: every row holds the same own length (see begin)
        self._ragged = False  # this pass: own lengths differ, the longest known (see begin)
        self._linear: RecurrentPass | None = None  # this pass's recurrent states (hybrids)

    # ------------------------------------------------------------ sizes

    @property
    def capacity(self) -> int:
        """Own positions per row."""
        return self.own.capacity

    def longest_own(self) -> int:
        """Most own positions any row holds (compare with `capacity`)."""
        return self.own.get_seq_length()

    def grow(self, capacity: int) -> None:
        self.own.grow(capacity)

    # ------------------------------------------------------------ one forward pass

    def _group_layout(self) -> tuple[Tensor | None, int, Tensor]:
        """(slot of each row in the [G * M] group layout [B], or None when row b is slot b; M;
        prefix length of each row [B]); recomputed after rows change."""
        if self._layout is None:
            device = self.own.kv.device
            prefix_rows = [self.prefix_row[g] for g in self.group_ids_B]
            seen = [0] * self.prefix.num_rows
            slots = []
            for row in prefix_rows:
                slots.append((row, seen[row]))
                seen[row] += 1
            m = max(seen, default=1) or 1
            slot_list = [row * m + s for row, s in slots]
            identity = slot_list == list(range(self.prefix.num_rows * m))
            slot_B = None if identity else torch.tensor(slot_list, device=device)
            prefix_lengths_B = self.prefix.lengths_B[torch.tensor(prefix_rows, device=device)]
            self._layout = (slot_B, m, prefix_lengths_B)
        return self._layout

    def begin(
        self, num_new_B: Tensor, uniform: tuple[int, int] | None = None, ragged: bool = False
    ) -> Tensor:
        """Append num_new_B[b] positions to row b; returns their absolute position ids [B, Q].
        `uniform` = (width, longest) as in KVCache.begin, and more: the caller knows every
        row's own part then holds `longest` positions (the sampler's decode passes: all rows
        start together and each pass adds one to every row), so every own column is visible
        to every query and the masks need nothing read back from the device. `ragged`: the
        rows' own parts differ (rows that joined a running batch) and `longest` is the
        longest's; the own masks are per row, still built without reading back."""
        own_positions_BQ = self.own.begin(num_new_B, uniform)
        self._uniform = uniform is not None and not ragged
        self._ragged = uniform is not None and ragged
        if self.own.recurrent_pass is not None:
            own_pass = self.own.recurrent_pass
            self._linear = RecurrentPass(
                own_pass.state,
                num_new_B,
                own_pass.width,
                ragged=own_pass.keep > 0,
                initial=self._recurrent_start(),
            )
        return own_positions_BQ + self._group_layout()[2][:, None]

    def _recurrent_start(self) -> Callable[[int], tuple[Tensor, Tensor]]:
        """A pass's starting recurrent states: a row's own, or its prompt's (the prefix row's)
        while its own part is empty, so a fork starts from the prompt's state."""
        own, prefix = self.own.recurrent, self.prefix.recurrent
        assert own is not None and prefix is not None, "both parts of a hybrid's cache"
        rows = self.own.num_rows
        device = self.own.kv.device
        prefix_rows_B = torch.tensor([self.prefix_row[g] for g in self.group_ids_B], device=device)
        fresh_B = self.own.lengths_B[:rows] == 0

        def start(slot: int) -> tuple[Tensor, Tensor]:
            conv = torch.where(
                fresh_B[:, None, None], prefix.conv[slot, prefix_rows_B], own.conv[slot, :rows]
            )
            delta = torch.where(
                fresh_B[:, None, None, None],
                prefix.delta[slot, prefix_rows_B],
                own.delta[slot, :rows],
            )
            return conv, delta

        return start

    def linear_pass(self) -> RecurrentPass:
        assert self._linear is not None, "a linear-attention layer outside begin()"
        return self._linear

    def _longest_prefix(self) -> int:
        if self._prefix_columns is None:
            self._prefix_columns = int(self.prefix.lengths_B[: self.prefix.num_rows].max())
        return self._prefix_columns

    def prefix_layout(self, round_up: int = 0) -> tuple[Tensor, Tensor | None, int, Tensor]:
        """What a decode pass's prefix part reads, fixed until rows change: (the live prefix
        keys and values [N, 2, G, Hkv, P, D], slot_B and M of the group layout, the prefix
        length of each row [B]). P is the longest prefix, or with `round_up` the next power of
        two at least that large, as far as the prefix cache holds (model/static_decode_cache.py:
        a longer prompt joining later fits). For static-shape passes."""
        slot_B, m, prefix_lengths_B = self._group_layout()
        columns = self._longest_prefix()
        if round_up:
            columns = min(self.prefix.capacity, power_of_two_at_least(columns, round_up))
        prefix_kv = self.prefix.kv[:, :, : self.prefix.num_rows, :, :columns]
        return prefix_kv, slot_B, m, prefix_lengths_B

    def _full_prefix_bias_of(self, width: int) -> Tensor | None:
        """The full-attention prefix bias [B, width, P] of a pass of `width` queries per row
        (each row sees its own prompt's columns), kept per layout; None if all are seen."""
        if width not in self._full_prefix_bias:
            _, _, prefix_lengths_B = self._group_layout()
            prefix_P = torch.arange(self._longest_prefix(), device=prefix_lengths_B.device)
            visible_B1P = (prefix_P[None, :] < prefix_lengths_B[:, None])[:, None, :]
            self._full_prefix_bias[width] = _bias(visible_B1P, width)
        return self._full_prefix_bias[width]

    def placeholder_columns(self, positions_BQ: Tensor) -> int:
        """Columns of the placeholder mask a pass hands the model: its last position + 1."""
        if self._uniform or self._ragged:
            # The last position is at most the longest prefix's plus the longest own part (the
            # placeholder only needs to be wide enough: attention reads the pass layout).
            return self._longest_prefix() + self.own.visible_columns()
        return int(positions_BQ.max()) + 1

    def attention_masks(
        self, positions_BQ: Tensor, layer_types: list[str], sliding_window: int | None
    ) -> dict[str, SharedPrefixAttention]:
        """Per layer type, the SharedPrefixAttention of this pass: a query at position p sees
        its prefix, and own columns at positions <= p (and > p - window for sliding layers)."""
        slot_B, m, prefix_lengths_B = self._group_layout()
        device = positions_BQ.device
        prefix_columns = self._longest_prefix()
        own_columns = self.own.visible_columns()
        prefix_P = torch.arange(prefix_columns, device=device)
        own_BS = prefix_lengths_B[:, None] + torch.arange(own_columns, device=device)[None, :]
        query_BQ1 = positions_BQ[:, :, None]
        prefix_BQP = (prefix_P[None, :] < prefix_lengths_B[:, None])[:, None, :]
        own_BQS = own_BS[:, None, :] <= query_BQ1  # absolute positions, so causal
        prefix_kv = self.prefix.kv[:, :, : self.prefix.num_rows, :, :prefix_columns]
        masks = {}
        for layer_type in dict.fromkeys(layer_types):
            prefix_visible, own_visible = prefix_BQP, own_BQS
            sliding = layer_type == "sliding_attention"
            if sliding:
                assert sliding_window is not None, "sliding-attention layers need a window"
                prefix_visible = prefix_visible & (
                    prefix_P[None, None, :] > query_BQ1 - sliding_window
                )
                own_visible = own_visible & (own_BS[:, None, :] > query_BQ1 - sliding_window)
            width = positions_BQ.shape[1]
            if sliding:
                prefix_bias = _bias(prefix_visible, width)
            else:
                prefix_bias = self._full_prefix_bias_of(width)
            uniform_own = self._uniform and not sliding
            masks[layer_type] = SharedPrefixAttention(
                prefix_kv,
                slot_B,
                m,
                prefix_bias,
                None if uniform_own else _bias(own_visible, width, check=not self._ragged),
                # The fused kernels (CPU flash, CUDA memory-efficient) are not trusted with a
                # query that sees no column (the CPU one gives it a log-sum-exp of 0, not
                # -inf); only a window can hide a whole prefix.
                fused=device.type in ("cpu", "cuda") and not sliding,
            )
        return masks

    def update(
        self, key_BHQD: Tensor, value_BHQD: Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        """The own part's keys and values after storing this pass (the prefix comes through
        the attention mask)."""
        return self.own.update(key_BHQD, value_BHQD, layer_idx)

    def commit(self) -> None:
        self.own.commit()
        self._linear = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Hugging Face Cache protocol: the longest row, prefix included (models only ask when
        no position ids are given)."""
        if not self.own.num_rows:
            return 0
        own_lengths_B = self.own.lengths_B[: self.own.num_rows]
        return int((self._group_layout()[2] + own_lengths_B).max())

    # ------------------------------------------------------------ rows

    def keep(self, rows_R: Tensor) -> None:
        """Row i becomes old row rows_R[i] (KVCache.keep); prefixes no row reads are freed."""
        self.own.keep(rows_R)
        self.group_ids_B = [self.group_ids_B[i] for i in rows_R.tolist()]
        live = dict.fromkeys(self.group_ids_B)
        if len(live) < len(self.prefix_row):
            # The dead prompts' rows are filled from the end, as the own rows are: a stream
            # frees a prompt at almost every block, and shifting every later prompt down by
            # one copied all of them each time. With one row per prompt both parts move
            # alike, so a prompt stays at its row's position (the identity layout).
            order = fill_holes(sorted(self.prefix_row[g] for g in live))
            self.prefix.keep(torch.tensor(order, dtype=torch.int64, device=self.own.kv.device))
            moved_to = {row: position for position, row in enumerate(order)}
            self.prefix_row = {g: moved_to[self.prefix_row[g]] for g in live}
        self._reset_layout()

    def join(
        self, prefix: KVCache, prefix_rows: list[int], prefix_ids: list[int], group_ids_B: list[int]
    ) -> None:
        """Rows joining at a decode block boundary: rows prefix_rows of `prefix` (a prefill of
        the joining prompts) become the prefixes named prefix_ids, and len(group_ids_B) empty
        own rows continuing them are appended after the running rows (KVCache.add_rows)."""
        assert not set(prefix_ids) & set(self.prefix_row), "joining prefixes are new"
        device = self.own.kv.device
        start = self.prefix.num_rows
        self.prefix.add_rows(
            len(prefix_rows), prefix, torch.tensor(prefix_rows, dtype=torch.int64, device=device)
        )
        for offset, gid in enumerate(prefix_ids):
            self.prefix_row[gid] = start + offset
        self.own.add_rows(len(group_ids_B))
        self.group_ids_B += group_ids_B
        self._reset_layout()

    def add_placeholders(self, prefix_ids: list[int]) -> None:
        """Rows appended after the running ones, each continuing a prefix of its own named by
        prefix_ids: one position of zero keys and values, so every part of their attention
        sees a column and what they compute (and store) stays finite. They start no sequence:
        a static layout's rows for joins to take (`refill`), allocated rows only."""
        assert not set(prefix_ids) & set(self.prefix_row), "placeholder prefixes are new"
        start = self.prefix.num_rows
        self.prefix.add_rows(len(prefix_ids))  # zeroed, length 0
        self.prefix.lengths_B[start : start + len(prefix_ids)] = 1
        for offset, gid in enumerate(prefix_ids):
            self.prefix_row[gid] = start + offset
        self.own.add_rows(len(prefix_ids))
        self.group_ids_B += prefix_ids
        self._reset_layout()

    def refill(self, readers: list[int], prefix_id: int, prefix: KVCache, prefix_row: int) -> None:
        """Rows `readers`, every row that reads one prefix (rows that ended, kept as padding
        by static passes), restart on a new one: row prefix_row of `prefix` (a joining prompt's
        prefill) is copied over the prefix they read, which is named prefix_id now, and their
        own parts restart empty. Nothing moves, so a static pass's tensors stay where they are
        (engine/generate/padding_joins.py)."""
        (old_id,) = {self.group_ids_B[b] for b in readers}
        assert readers == [b for b, g in enumerate(self.group_ids_B) if g == old_id]
        assert prefix_id not in self.prefix_row, "a joining prefix is new"
        row = self.prefix_row.pop(old_id)
        self.prefix_row[prefix_id] = row
        device = self.own.kv.device
        self.prefix.copy_rows(
            prefix,
            torch.tensor([prefix_row], device=device),
            torch.tensor([row], device=device),
        )
        for b in readers:
            self.group_ids_B[b] = prefix_id
        self.own.lengths_B[torch.tensor(readers, device=device)] = 0
        self._reset_layout()

    def replace_prefix(self, group_id: int, source: KVCache, source_row: int) -> None:
        """The prefix of `group_id` becomes a copy of `source_row` of `source` (new weights)."""
        row = self.prefix_row[group_id]
        device = self.own.kv.device
        self.prefix.copy_rows(
            source,
            torch.tensor([source_row], device=device),
            torch.tensor([row], device=device),
        )
        self._reset_layout()

    def _reset_layout(self) -> None:
        self._layout = None
        self._prefix_columns = None
        self._full_prefix_bias = {}

    def subset(self, own: KVCache, group_ids_B: list[int]) -> FanoutKVCache:
        """A cache whose rows, the (new, empty) rows of `own`, continue prefixes of this one:
        the same prefix tensors, so nothing of them is copied."""
        prefix_ids = sorted(self.prefix_row, key=self.prefix_row.__getitem__)
        return FanoutKVCache(self.prefix, prefix_ids, own, group_ids_B)
