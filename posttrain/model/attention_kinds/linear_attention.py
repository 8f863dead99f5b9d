"""Linear-attention layers (Gated DeltaNet: Qwen3-Next, Qwen3.5) through posttrain's caches: a
recurrent state per row beside the KV of the full-attention layers.

A Gated DeltaNet layer keeps no keys and values. What a row's next position needs of its past
is a fixed-size state per layer: the last K - 1 inputs of its causal convolution (conv state,
C channels) and the delta rule's matrix per value head (Hv x Dk x Dv, float32). Decode is O(1)
per token in these layers, whatever the row's length.

transformers' own module forward runs in every pass (training, scoring and sampling alike):
it asks its `cache` for the states (`get_conv_state`, `get_recurrent_state`), hands it the
convolution's input to prepend the conv state to (`update_conv_state`) and the delta rule's
final state (`update_recurrent_state`). posttrain's caches (kv_cache.py, fanout_kv_cache.py)
answer those calls through a `RecurrentPass` over a `RecurrentState`, rows aligned with their
KV rows, so every row operation of a cache (keep, grow, joins, copies) moves the state too:

- rows of one pass may append different counts of positions (a prefill of prompts of
  different lengths, right-padded). Padding follows a row's real positions, so the outputs at
  real positions are exact; only the state must be taken at each row's own end. The conv state
  is gathered at each row's end; for the delta rule the pass asks transformers to keep the
  per-position states of the last positions (`get_recurrent_states_to_keep`: from the shortest
  row's end on, stepped token by token) and takes each row's at its end. A row appending
  nothing keeps its state. The sampler's prefills avoid the token-by-token steps: each of their
  passes runs as many positions for every row that runs (engine/generate/prefill.py).
- a fanout cache's own row that holds no position yet starts from its prompt's state (the
  prefix row's): a fork copies the prompt's state, not its tokens.

Not served: spans of positions (the prefix cache stores KV spans; a recurrent state exists
only at a row's end, so a hybrid's prompts skip it, the reason counted in /metrics), packed
joining passes (one row of many sequences) and the static decode passes; the sampler keeps
hybrids off them (engine/generate). `install` numbers a hybrid's attention modules 0, 1, ...,
so its KV caches hold no slot for a linear layer.

Legend: L = linear-attention layers, R = allocated rows, B = rows of a pass, C = conv
channels, K1 = conv kernel - 1, Hv = value heads, Dk / Dv = key / value head dims, Q = new
positions per row of a pass, k = per-position states kept.

Imports: torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

# transformers' Gated DeltaNet modules (Qwen3-Next, Qwen3.5 dense and MoE): their forward
# reads and writes its state through the cache calls answered here.
LINEAR_ATTENTION_CLASSES = frozenset(
    {"Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"}
)


@dataclass(frozen=True)
class RecurrentShape:
    """What one row's recurrent state holds: per linear-attention layer (the decoder layer
    indices `layers`), a conv state [C, K1] and a delta-rule state [Hv, Dk, Dv]."""

    layers: tuple[int, ...]
    conv_channels: int
    conv_columns: int
    value_heads: int
    key_dim: int
    value_dim: int

    def bytes_per_row(self, conv_element_size: int) -> int:
        """Bytes of one row's state: the conv state in the model's dtype, the delta rule's in
        float32 (what transformers' delta rule computes in)."""
        conv = self.conv_channels * self.conv_columns * conv_element_size
        delta = self.value_heads * self.key_dim * self.value_dim * 4
        return len(self.layers) * (conv + delta)


def linear_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's Gated DeltaNet modules, in model order."""
    return [m for m in model.modules() if type(m).__name__ in LINEAR_ATTENTION_CLASSES]


def install(model: nn.Module) -> None:
    """Number a hybrid's attention modules 0, 1, ... in model order (their `layer_idx`, which
    posttrain's KV caches and pass layouts index by), so its KV caches hold the attention
    layers only, not a slot for every linear layer; the linear layers keep their decoder
    index (the recurrent state's, RecurrentShape.layers). Idempotent; nothing for a model
    without linear attention."""
    if not linear_attention_modules(model):
        return
    indexed = [
        m
        for m in model.modules()
        if isinstance(vars(m).get("layer_idx"), int)
        and type(m).__name__ not in LINEAR_ATTENTION_CLASSES
    ]
    if any(hasattr(m, "_posttrain_decoder_layer") for m in indexed):
        return
    order = {
        index: i for i, index in enumerate(sorted({int(vars(m)["layer_idx"]) for m in indexed}))
    }
    for module in indexed:
        decoder_layer = int(vars(module)["layer_idx"])
        # Plain ints as nn.Module attributes (nn.Module's stub types a Tensor or a Module).
        module._posttrain_decoder_layer = decoder_layer  # type: ignore[assignment]
        module.layer_idx = order[decoder_layer]  # type: ignore[assignment]


def recurrent_shape(model: nn.Module) -> RecurrentShape | None:
    """The recurrent state of `model`'s linear-attention layers (None: it has none), from the
    modules (meta-device ones too)."""
    found = linear_attention_modules(model)
    if not found:
        return None
    shapes = set()
    for module in found:
        m = cast(Any, module)  # transformers' attributes (untyped)
        shapes.add(
            (
                int(m.conv_dim),
                int(m.conv_kernel_size) - 1,
                int(m.num_v_heads),
                int(m.head_k_dim),
                int(m.head_v_dim),
            )
        )
    assert len(shapes) == 1, f"linear-attention layers of different shapes: {shapes}"
    ((channels, columns, heads, key_dim, value_dim),) = shapes
    layers = tuple(int(cast(Any, m).layer_idx) for m in found)
    return RecurrentShape(layers, channels, columns, heads, key_dim, value_dim)


class RecurrentState:
    """The states of `rows` rows: conv [L, R, C, K1] (`dtype`), delta [L, R, Hv, Dk, Dv]
    (float32); rows start at zero (a fresh sequence)."""

    def __init__(
        self, shape: RecurrentShape, rows: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.shape = shape
        self.slot = {layer: i for i, layer in enumerate(shape.layers)}
        count = len(shape.layers)
        self.conv = torch.zeros(
            count, rows, shape.conv_channels, shape.conv_columns, dtype=dtype, device=device
        )
        self.delta = torch.zeros(
            count,
            rows,
            shape.value_heads,
            shape.key_dim,
            shape.value_dim,
            dtype=torch.float32,
            device=device,
        )

    @property
    def rows(self) -> int:
        return self.conv.shape[1]

    def resized(self, rows: int, live: int) -> RecurrentState:
        """A state of `rows` rows whose first `live` are this one's."""
        state = RecurrentState(self.shape, rows, self.conv.dtype, self.conv.device)
        state.conv[:, :live] = self.conv[:, :live]
        state.delta[:, :live] = self.delta[:, :live]
        return state

    def zero(self, start: int, end: int) -> None:
        self.conv[:, start:end] = 0
        self.delta[:, start:end] = 0

    def copy_rows(self, source: RecurrentState, source_rows_R: Tensor, rows_R: Tensor) -> None:
        """Row rows_R[i] becomes source row source_rows_R[i] (the right side is gathered into a
        new tensor first, so `source` may be this state)."""
        self.conv[:, rows_R] = source.conv[:, source_rows_R].to(self.conv.dtype)
        self.delta[:, rows_R] = source.delta[:, source_rows_R]


# A pass's starting states of one layer slot: (conv [B, C, K1], delta [B, Hv, Dk, Dv]).
Initial = Callable[[int], tuple[Tensor, Tensor]]


class RecurrentPass:
    """The cache calls of transformers' Gated DeltaNet forward for one pass: rows 0..B-1 of
    `state` receive the states after each row's num_new_B[b] new positions, starting from
    `initial` (a KV cache's own rows, or a fanout row's prompt state)."""

    def __init__(
        self,
        state: RecurrentState,
        num_new_B: Tensor,
        width: int,
        ragged: bool,
        initial: Initial | None = None,
    ) -> None:
        self.state = state
        self.rows = num_new_B.shape[0]
        self.num_new_B = num_new_B
        self.width = width
        self._initial = initial or self._own
        self._starts: dict[int, tuple[Tensor, Tensor]] = {}
        # Ragged: keep the per-position states from the shortest appending row's end on.
        self.keep = 0
        if ragged:
            appending = num_new_B[num_new_B > 0]
            shortest = int(appending.min()) if appending.numel() else width
            # Rows that run all `width` positions or none need only the final state.
            self.keep = width - shortest + 1 if shortest < width else 0

    def _own(self, slot: int) -> tuple[Tensor, Tensor]:
        return self.state.conv[slot, : self.rows], self.state.delta[slot, : self.rows]

    def _start(self, layer_idx: int) -> tuple[int, Tensor, Tensor]:
        slot = self.state.slot[layer_idx]
        if slot not in self._starts:
            # Cloned: the layer's writes go to the storage a start may be a view of.
            conv, delta = self._initial(slot)
            self._starts[slot] = (conv.clone(), delta.clone())
        return (slot, *self._starts[slot])

    # ------------------------------------------------ transformers' cache calls

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor:
        return self._start(layer_idx)[2]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor:
        return self._start(layer_idx)[1]

    def is_recording_past(self, layer_idx: int) -> bool:
        # True: transformers' in-place single-token conv update is not taken, every pass
        # prepends the conv state through update_conv_state (a fanout row's starts are copies).
        return True

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        return None

    def get_recurrent_states_to_keep(self, layer_idx: int) -> int:
        return self.keep

    def update_conv_state(
        self, states_BCQ: Tensor, layer_idx: int, state_idx: int = 0, **kwargs: object
    ) -> Tensor:
        """The convolution's input with each row's conv state prepended ([B, C, K1 + Q]); the
        row's new conv state is the K1 columns ending at its last real position."""
        slot, conv_BCK, _ = self._start(layer_idx)
        full_BCX = torch.cat([conv_BCK.to(states_BCQ.dtype), states_BCQ], dim=-1)
        columns = self.state.shape.conv_columns
        index_BK = self.num_new_B[:, None] + torch.arange(columns, device=full_BCX.device)
        index_BCK = index_BK[:, None, :].expand(-1, full_BCX.shape[1], -1)
        self.state.conv[slot, : self.rows] = full_BCX.gather(-1, index_BCK).to(
            self.state.conv.dtype
        )
        return full_BCX

    def update_recurrent_state(self, state: Tensor | list[Tensor], layer_idx: int) -> None:
        """The delta rule's state after the pass: the final one (every row appends `width`
        positions), or per row its state at its own end among the kept ones (ragged)."""
        slot, _, start_BHKV = self._start(layer_idx)
        if isinstance(state, Tensor):
            ended_BHKV = state
        else:
            kept_kBHKV = torch.stack(state)
            first_kept = self.width - kept_kBHKV.shape[0]
            at_B = (self.num_new_B - 1 - first_kept).clamp(min=0)
            ended_BHKV = kept_kBHKV[at_B, torch.arange(self.rows, device=at_B.device)]
        appended_B = (self.num_new_B > 0)[:, None, None, None]
        self.state.delta[slot, : self.rows] = torch.where(appended_B, ended_BHKV, start_BHKV)


class LinearAttentionCalls:
    """transformers' Gated DeltaNet cache calls on a posttrain cache, answered by the pass the
    cache's `linear_pass` gives (kv_cache.py, fanout_kv_cache.py)."""

    def linear_pass(self) -> RecurrentPass:
        raise NotImplementedError

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor:
        return self.linear_pass().get_recurrent_state(layer_idx, state_idx)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor:
        return self.linear_pass().get_conv_state(layer_idx, state_idx)

    def is_recording_past(self, layer_idx: int) -> bool:
        return self.linear_pass().is_recording_past(layer_idx)

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        self.linear_pass().increase_count(layer_idx, state_idx)

    def get_recurrent_states_to_keep(self, layer_idx: int) -> int:
        return self.linear_pass().get_recurrent_states_to_keep(layer_idx)

    def update_conv_state(
        self, states_BCQ: Tensor, layer_idx: int, state_idx: int = 0, **kwargs: object
    ) -> Tensor:
        return self.linear_pass().update_conv_state(states_BCQ, layer_idx, state_idx, **kwargs)

    def update_recurrent_state(self, state: Tensor | list[Tensor], layer_idx: int) -> None:
        self.linear_pass().update_recurrent_state(state, layer_idx)
