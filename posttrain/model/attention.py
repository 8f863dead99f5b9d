"""posttrain's attention function: sdpa, plus attention over a prompt shared by many rows.

RL samples several completions of each prompt. With one KV-cache row per completion, every
decode step reads each prompt's keys and values once per completion: num_samples times the
memory traffic of the prompt, which dominates attention (and on a small model, the whole
step). `SharedPrefixAttention` reads a prompt's keys and values once per decode step for all
the rows that continue it, in two parts merged exactly by their log-sum-exps:

    prefix part, per group g: the queries of g's rows over g's prompt  -> out_p, lse_p
    own part, per row b:      b's queries over b's own generated tokens -> out_o, lse_o
    out = out_p * exp(lse_p - lse) + out_o * exp(lse_o - lse),   lse = logaddexp(lse_p, lse_o)

which is softmax attention over the concatenated sequence. The prefix part stacks the queries
of a group's rows (and of the query heads that share a KV head) as the rows of one matrix, so
each prompt's keys and values enter one product. On the CPU both parts run in PyTorch's fused
flash-attention kernel, on CUDA in the memory-efficient one (both return the log-sum-exp;
model/attention_kernels.py); elsewhere, and for sliding windows (which can hide a whole prompt,
where the CPU kernel reports a log-sum-exp of 0 instead of -inf), as explicit matmuls.

A long prompt's prefill runs in chunks over the KV cache; a chunk of rows that share their
start attends as a `CausalChunk`: the cached columns and the chunk's own (causal) columns as
two fused parts merged the same way, so no [Q, K] mask is built for a 32k-token prompt.

The model selects attention by name (`config._attn_implementation`); `install` names ours.
For an sdpa model it is IMPLEMENTATION: sdpa for every mask outside sampler passes (training,
Hugging Face `generate`), so installing it changes nothing else. For an eager model (attention
sdpa cannot express: Gemma 2's soft-capped scores) it is EAGER_IMPLEMENTATION: the family's own
eager attention, with sampler passes' masks made additive and each row's shared prefix
materialised next to its own keys (slower, still exact). A sampler pass's masks travel beside
the forward (`pass_layout`), one per decoder layer, not as the model's `attention_mask`:
families build and hand on masks differently, and a 4-D placeholder passes through all of them.

Legend: B = rows, G = prefix groups, M = most rows of one group, Hq/Hkv = query/KV heads,
Z = (Hq / Hkv) * Q stacked query rows per KV head, Q = new positions per row, P = prefix
columns, S = own columns, D = head dim, X = M * Z.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask, sdpa_mask

from posttrain.model.attention_kernels import merge_by_lse, partial_attention

IMPLEMENTATION = "posttrain"
EAGER_IMPLEMENTATION = "posttrain_eager"

# A family's `eager_attention_forward(module, query, key, value, attention_mask, **kwargs)`:
# the output [B, Q, Hq, D] and the attention weights (None where a family returns none). Its
# keyword arguments are transformers' attention kwargs (scaling, dropout, softcap, ...).
EagerAttention = Callable[..., tuple[Tensor, Tensor | None]]


@dataclass(frozen=True)
class SharedPrefixAttention:
    """One forward pass's attention layout for one layer type: rows reading a shared prefix.

    `prefix_kv` is [N, 2, G, Hkv, P, D] (layers, keys/values, groups); row b sits in slot
    `slot_B[b]` of the [G * M] group layout, that is in group slot_B[b] // M (None: row b is
    slot b, every group has M rows in order, and the layouts are views of each other). The
    additive biases (0 = attend, -inf = not) give, for each row's Q new positions, the visible
    prefix columns [B, Q, P] and own columns [B, Q, S]; None when every column is visible.
    `fused`: run the parts in the device's fused kernel that returns the log-sum-exp (CPU
    flash, CUDA memory-efficient; attention_kernels.py); no query may see an empty prefix."""

    prefix_kv: Tensor
    slot_B: Tensor | None
    rows_per_group: int
    prefix_bias_BQP: Tensor | None
    own_bias_BQS: Tensor | None
    fused: bool
    # The biases in the layouts the products use, per query-heads-per-KV-head: built by the
    # first layer of the pass, reused by the others.
    _stacked: dict[int, tuple[Tensor | None, Tensor | None]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def attend(self, layer: int, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
        """query [B, Hq, Q, D], own keys and values [B, Hkv, S, D] -> output [B, Q, Hq, D]."""
        rows, query_heads, width, head_dim = query.shape
        kv_heads = key.shape[1]
        repeat = query_heads // kv_heads
        prefix_keys, prefix_values = self.prefix_kv[layer, 0], self.prefix_kv[layer, 1]
        groups = prefix_keys.shape[0]
        # Query head h uses KV head h // r, so [Hq, Q] regroups as [Hkv, r * Q] without a copy
        # of the keys (grouped-query attention).
        q_BHZD = query.reshape(rows, kv_heads, repeat * width, head_dim)
        prefix_bias, own_bias = self._stacked_biases(repeat, groups)
        out_GHXD, lse_GHX = partial_attention(
            self._to_groups(q_BHZD, groups),
            prefix_keys,
            prefix_values,
            prefix_bias,
            scale,
            self.fused,
        )
        out_p = self._to_rows(out_GHXD, groups)
        lse_p = self._to_rows(lse_GHX[..., None], groups)[..., 0]
        out_o, lse_o = partial_attention(q_BHZD, key, value, own_bias, scale, self.fused)
        out_BHZD = merge_by_lse(out_p, lse_p, out_o, lse_o).to(query.dtype)
        out_BHqQD = out_BHZD.reshape(rows, query_heads, width, head_dim)
        return out_BHqQD.transpose(1, 2).contiguous()

    def _stacked_biases(self, repeat: int, groups: int) -> tuple[Tensor | None, Tensor | None]:
        """The prefix bias in the group layout [G, 1, X, P] and the own bias [B, 1, Z, S]."""
        if repeat not in self._stacked:
            prefix_bias = own_bias = None
            if self.prefix_bias_BQP is not None:
                prefix_bias = self._to_groups(_stack_heads(self.prefix_bias_BQP, repeat), groups)
            if self.own_bias_BQS is not None:
                own_bias = _stack_heads(self.own_bias_BQS, repeat)
            self._stacked[repeat] = (prefix_bias, own_bias)
        return self._stacked[repeat]

    def _to_groups(self, x_BHZE: Tensor, groups: int) -> Tensor:
        """[B, H, Z, E] -> [G, H, M * Z, E]: row b's Z rows land in its group's matrix (slots
        of absent rows are zero)."""
        rows, heads, z, e = x_BHZE.shape
        m = self.rows_per_group
        if self.slot_B is None:
            slots = x_BHZE
        else:
            slots = x_BHZE.new_zeros(groups * m, heads, z, e)
            slots.index_copy_(0, self.slot_B, x_BHZE)
        return slots.view(groups, m, heads, z, e).transpose(1, 2).reshape(groups, heads, m * z, e)

    def _to_rows(self, x_GHXE: Tensor, groups: int) -> Tensor:
        """The inverse of _to_groups: [G, H, M * Z, E] -> [B, H, Z, E]."""
        _, heads, x, e = x_GHXE.shape
        m = self.rows_per_group
        slots = x_GHXE.view(groups, heads, m, x // m, e).transpose(1, 2)
        slots = slots.reshape(groups * m, heads, x // m, e)
        return slots if self.slot_B is None else slots.index_select(0, self.slot_B)


@dataclass(frozen=True)
class JoiningPassAttention:
    """One pass's attention layout for one layer type when the prompts joining a running decode
    batch run inside its next decode pass (chunked prefill): the pass's tokens come packed, one
    per batch row ([N, 1]): first one new position of each of the B decode rows, which attend
    through `decode` (their shared prefixes and own parts), then the joining prompts' positions,
    prompt after prompt, written to `prefill_kv` ([N, 2, G, Hkv, T, D], the joining prompts'
    cache, by model/joining_pass_cache.py before attention runs). Those attend as a prefill
    does: spread back to one row per prompt (`real_W`: the real positions of the [G, Q]
    layout flattened, in packing order), sdpa over the prompt's columns with `mask_G1QK`,
    packed again. One pass through every linear layer serves both, instead of a prefill pass
    per join."""

    decode: SharedPrefixAttention
    decode_rows: int
    prefill_kv: Tensor
    visible: int  # prefill columns the pass reads
    real_W: Tensor  # index, not a boolean mask: indexing by a mask reads the device back
    mask_G1QK: Tensor

    def attend(
        self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, **kwargs: Any
    ) -> Tensor:
        """query [N, Hq, 1, D]; key and value the own part of the B decode rows ([B, Hkv, S,
        D], what the cache's update returned) -> output [N, 1, Hq, D]."""
        rows = self.decode_rows
        scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
        layer = _layer_idx(module)
        decoded = self.decode.attend(layer, query[:rows], key, value, scale)
        groups, _, width, _ = self.mask_G1QK.shape
        _, heads, _, head_dim = query.shape
        query_XHD = query.new_zeros(groups * width, heads, head_dim)
        query_XHD.index_copy_(0, self.real_W, query[rows:, :, 0])
        query_GHQD = query_XHD.view(groups, width, heads, head_dim).transpose(1, 2)
        kv = self.prefill_kv[layer, :, :groups, :, : self.visible]
        prefilled_GQHD, _ = sdpa_attention_forward(
            module, query_GHQD, kv[0], kv[1], self.mask_G1QK, **kwargs
        )
        prefilled_XHD = prefilled_GQHD.reshape(groups * width, heads, head_dim)
        return torch.cat([decoded, prefilled_XHD.index_select(0, self.real_W)[:, None]])


@dataclass(frozen=True)
class CausalChunk:
    """One pass's attention layout when every row appends the same Q positions after the same
    P cached ones (a chunk of one long prompt's prefill, or of prompts of one length): each
    query sees every cached column and the chunk's own columns up to itself. Attended as two
    parts merged by their log-sum-exps (attention_kernels.py): the queries over the P cached
    columns (no mask) and over the Q own columns (the kernel's causal masking). No [Q, P + Q]
    mask or score tensor is built, so a layer's attention memory is linear in P + Q where the
    boolean mask (and the float copy sdpa makes of it) costs Q * (P + Q) each."""

    def attend(self, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
        """query [B, Hq, Q, D], keys and values of the visible columns [B, Hkv, P + Q, D] ->
        output [B, Q, Hq, D]."""
        rows, query_heads, width, head_dim = query.shape
        kv_heads = key.shape[1]
        repeat = query_heads // kv_heads
        past = key.shape[2] - width
        # The own part's keys per query head: Q positions, as small as the chunk.
        own_keys = key[:, :, past:].repeat_interleave(repeat, 1)
        own_values = value[:, :, past:].repeat_interleave(repeat, 1)
        out_o, lse_o = partial_attention(
            query, own_keys, own_values, None, scale, fused=True, causal=True
        )
        if past == 0:
            return out_o.to(query.dtype).transpose(1, 2).contiguous()
        # Query head h uses KV head h // r: [Hq, Q] regroups as [Hkv, r * Q], so the cached
        # keys enter without a copy per query head.
        q_BHZD = query.reshape(rows, kv_heads, repeat * width, head_dim)
        out_p, lse_p = partial_attention(
            q_BHZD, key[:, :, :past], value[:, :, :past], None, scale, fused=True
        )
        out_BHqQD = merge_by_lse(
            out_p.reshape(query.shape), lse_p.reshape(query.shape[:-1]), out_o, lse_o
        )
        return out_BHqQD.to(query.dtype).transpose(1, 2).contiguous()

    def mask(self, query: Tensor, key: Tensor) -> Tensor:
        """The same visibility as a boolean [1, 1, Q, P + Q] mask (True = attend), for
        attention functions that only take a mask (eager families)."""
        width, columns = query.shape[2], key.shape[2]
        rows_Q1 = torch.arange(columns - width, columns, device=key.device)[:, None]
        return (torch.arange(columns, device=key.device)[None, :] <= rows_Q1)[None, None]


def _stack_heads(bias_BQK: Tensor, repeat: int) -> Tensor:
    """A per-position bias [B, Q, K] for the stacked query rows [B, 1, r * Q, K]."""
    rows, width, columns = bias_BQK.shape
    return (
        bias_BQK[:, None, None]
        .expand(rows, 1, repeat, width, columns)
        .reshape(rows, 1, repeat * width, columns)
    )


def _own_eager(module: nn.Module) -> EagerAttention:
    """The eager attention of the family `module` belongs to (every modeling file defines its
    own `eager_attention_forward`, e.g. Gemma 2's soft-capping one)."""
    modeling = sys.modules[type(module).__module__]
    eager: EagerAttention = modeling.eager_attention_forward
    return eager


def _layer_idx(module: nn.Module) -> int:
    """The decoder layer an attention module belongs to (its `layer_idx`, which the cache
    protocol indexes by), read from the instance: nn.Module's stubs type an attribute they do
    not declare as a Tensor or a Module."""
    index = vars(module)["layer_idx"]
    assert isinstance(index, int), f"{type(module).__name__}.layer_idx is {index!r}"
    return index


def _materialized(
    layout: SharedPrefixAttention, layer: int, query: Tensor, key: Tensor, value: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's prefix and own keys and values as one sequence [B, Hkv, P + S, D] and its
    additive mask [B, 1, Q, P + S]: the generic (slower, exact) shared-prefix path, for
    attention functions that only take a plain mask."""
    rows = key.shape[0]
    if layout.slot_B is None:
        slot_B = torch.arange(rows, device=key.device)
    else:
        slot_B = layout.slot_B
    group_B = slot_B // layout.rows_per_group
    prefix_keys = layout.prefix_kv[layer, 0].index_select(0, group_B)
    prefix_values = layout.prefix_kv[layer, 1].index_select(0, group_B)
    width = query.shape[2]
    prefix_bias = layout.prefix_bias_BQP
    if prefix_bias is None:
        prefix_bias = key.new_zeros(rows, width, prefix_keys.shape[2], dtype=torch.float32)
    own_bias = layout.own_bias_BQS
    if own_bias is None:
        own_bias = key.new_zeros(rows, width, key.shape[2], dtype=torch.float32)
    bias = torch.cat([prefix_bias.expand(rows, width, -1), own_bias.expand(rows, width, -1)], -1)
    mask = bias.clamp(min=torch.finfo(query.dtype).min).to(query.dtype)[:, None]
    return torch.cat([prefix_keys, key], 2), torch.cat([prefix_values, value], 2), mask


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean mask (True = attend) as the additive one eager attention adds to its scores."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, torch.finfo(dtype).min
    )


# What one layer attends with in a sampler pass: a boolean mask or one of the layouts above.
Layout = Tensor | SharedPrefixAttention | JoiningPassAttention | CausalChunk

# The layout of the current sampler pass, one mask per decoder layer (None: no pass; the
# model's own masks apply). It travels beside the model's forward rather than as its
# `attention_mask`, because families build and hand on masks differently (a per-layer-type
# mapping only some forwards accept, a 4-D tensor others): each attention call picks its
# layer's entry here, whatever the family's forward did with the placeholder mask.
_PASS: ContextVar[list[Layout] | None] = ContextVar("posttrain_pass", default=None)


@contextmanager
def pass_layout(
    masks_per_layer: list[Layout],
) -> Iterator[None]:
    """Attend with masks_per_layer[layer] inside this block (boolean [B, 1, Q, K] masks over
    the cache's visible columns, or one of the layouts above)."""
    token = _PASS.set(masks_per_layer)
    try:
        yield
    finally:
        _PASS.reset(token)


def _layout_mask(module: nn.Module, given: Tensor | None) -> Layout | None:
    layout = _PASS.get()
    return given if layout is None else layout[_layer_idx(module)]


def layer_layout(module: nn.Module, given: Tensor | None) -> Layout | None:
    """What `module`'s layer attends with in the current sampler pass (`given`, the model's own
    mask, outside one): for attention modules that attend by themselves (latent_attention.py)."""
    return _layout_mask(module, given)


def materialized(
    layout: SharedPrefixAttention, layer: int, query: Tensor, key: Tensor, value: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's prefix and own keys and values as one sequence, with its additive mask (see
    _materialized)."""
    return _materialized(layout, layer, query, key, value)


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The function registered as IMPLEMENTATION: shared-prefix attention for the sampler's
    decode passes, sdpa for everything else."""
    mask = _layout_mask(module, attention_mask)
    if isinstance(mask, SharedPrefixAttention):
        scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
        return mask.attend(_layer_idx(module), query, key, value, scale), None
    if isinstance(mask, JoiningPassAttention):
        return mask.attend(module, query, key, value, **kwargs), None
    if isinstance(mask, CausalChunk):
        if key.shape[-1] != value.shape[-1]:  # latent attention: the fused kernels take one
            mask = mask.mask(query, key)
        else:
            scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
            return mask.attend(query, key, value, scale), None
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


def eager_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """The function registered as EAGER_IMPLEMENTATION, for models whose attention sdpa cannot
    express (Gemma 2's soft-capped scores): the family's own eager attention, with sampler
    passes' masks made additive and shared prefixes materialised per row."""
    mask = _layout_mask(module, attention_mask)
    eager = _own_eager(module)
    assert not isinstance(mask, JoiningPassAttention), "joins prefill apart on eager models"
    if isinstance(mask, SharedPrefixAttention):
        key, value, mask = _materialized(mask, _layer_idx(module), query, key, value)
    elif isinstance(mask, CausalChunk):
        mask = _additive(mask.mask(query, key), query.dtype)
    elif mask is not None and mask.dtype == torch.bool:
        mask = _additive(mask, query.dtype)
    return eager(module, query, key, value, mask, **kwargs)


AttentionInterface.register(IMPLEMENTATION, attention_forward)
AttentionInterface.register(EAGER_IMPLEMENTATION, eager_forward)
# Masks for everything but shared-prefix passes are sdpa's (eager's).
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
AttentionMaskInterface.register(EAGER_IMPLEMENTATION, eager_mask)


# The attention implementations posttrain serves, each with the one it installs for it.
SERVED = {"sdpa": IMPLEMENTATION, "eager": EAGER_IMPLEMENTATION}


def install(model: PreTrainedModel) -> None:
    """Make `model` attend with IMPLEMENTATION (sdpa models) or EAGER_IMPLEMENTATION (eager
    ones); idempotent. Outside sampler passes each is exactly what the model ran before."""
    current = model.config._attn_implementation
    if current in SERVED.values():
        return
    if current not in SERVED:
        raise ValueError(f"attention implementation {current!r} cannot be served (sdpa, eager)")
    model.set_attn_implementation(SERVED[current])
