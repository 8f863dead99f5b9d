"""posttrain's attention function: sdpa, plus attention over a prompt shared by many rows.

RL samples several completions of each prompt. With one KV-cache row per completion, every
decode step reads each prompt's keys and values once per completion: num_samples times the
memory traffic of the prompt, which dominates attention (and on a small model, the whole
step). `SharedPrefixAttention` reads a prompt's keys and values once per decode step for all
the rows that continue it:

    scores = [ q K_prefix[group(row)]^T | q K_own[row]^T ] * scale     (one softmax over both)
    out    = softmax(scores)[:, :P] V_prefix[group(row)] + softmax(scores)[:, P:] V_own[row]

The prefix products run per group: the queries of a group's rows (and of the query heads that
share a KV head) are stacked into the rows of one matrix, so each group's prefix keys and values
enter one matmul. Scores are small ([rows, heads, new positions, columns]); only they move
between the row layout and the group layout. One softmax over both parts makes the result
exactly attention over the concatenated sequence.

The model selects attention by name (`config._attn_implementation`); `install` names ours.
It is sdpa for every mask that is not a SharedPrefixAttention (training, prefill, Hugging Face
`generate`), so installing it changes nothing else. The per-pass object travels as the layer's
`attention_mask`: Hugging Face models hand a mapping of masks given to them to the attention
function unchanged.

Legend: B = rows, G = prefix groups, M = most rows of one group, Hq/Hkv = query/KV heads,
r = Hq / Hkv, Q = new positions per row, P = prefix columns, S = own columns, D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

IMPLEMENTATION = "posttrain"


@dataclass(frozen=True)
class SharedPrefixAttention:
    """One forward pass's attention layout for one layer type: rows reading a shared prefix.

    `prefix_kv` is [N, 2, G, Hkv, P, D] (layers, keys/values, groups); row b reads group
    `group_B[b]` and sits in slot `slot_B[b]` of the [G * M] group layout. `visible_BQK`
    (True = attend) covers the P prefix columns then the S own columns, for each row's Q new
    positions."""

    prefix_kv: Tensor
    group_B: Tensor
    slot_B: Tensor
    rows_per_group: int
    visible_BQK: Tensor

    def attend(self, layer: int, query: Tensor, key: Tensor, value: Tensor, scale: float):
        """query [B, Hq, Q, D], own keys and values [B, Hkv, S, D] -> output [B, Q, Hq, D]."""
        rows, query_heads, width, head_dim = query.shape
        kv_heads = key.shape[1]
        stacked = query_heads // kv_heads * width  # r * Q query rows per KV head
        prefix_keys, prefix_values = self.prefix_kv[layer, 0], self.prefix_kv[layer, 1]
        groups, _, columns, _ = prefix_keys.shape
        # Query head h uses KV head h // r, so [Hq, Q] regroups as [Hkv, r * Q] without a copy
        # of the keys (grouped-query attention).
        q_BHZD = query.reshape(rows, kv_heads, stacked, head_dim)
        q_GHXD = self._to_groups(q_BHZD, groups)
        prefix_GHXP = torch.matmul(q_GHXD, prefix_keys.transpose(-1, -2))
        own_BHZS = torch.matmul(q_BHZD, key.transpose(-1, -2))
        scores_BHZK = torch.cat([self._to_rows(prefix_GHXP, groups), own_BHZS], dim=-1)
        scores_BHrQK = scores_BHZK.view(rows, kv_heads, -1, width, scores_BHZK.shape[-1])
        scores_BHrQK = scores_BHrQK.float().mul_(scale)
        scores_BHrQK.masked_fill_(~self.visible_BQK[:, None, None], float("-inf"))
        weights_BHZK = scores_BHrQK.softmax(-1).to(query.dtype).view_as(scores_BHZK)
        weights_GHXP = self._to_groups(weights_BHZK[..., :columns].contiguous(), groups)
        out_BHZD = self._to_rows(torch.matmul(weights_GHXP, prefix_values), groups)
        out_BHZD = out_BHZD + torch.matmul(weights_BHZK[..., columns:], value)
        out_BHqQD = out_BHZD.view(rows, query_heads, width, head_dim)
        return out_BHqQD.transpose(1, 2).contiguous()

    def _to_groups(self, x_BHZE: Tensor, groups: int) -> Tensor:
        """[B, Hkv, Z, E] -> [G, Hkv, M * Z, E]: row b's Z rows land in its group's matrix
        (slots of absent rows are zero)."""
        rows, heads, z, e = x_BHZE.shape
        m = self.rows_per_group
        slots = x_BHZE.new_zeros(groups * m, heads, z, e)
        slots[self.slot_B] = x_BHZE
        return slots.view(groups, m, heads, z, e).transpose(1, 2).reshape(groups, heads, m * z, e)

    def _to_rows(self, x_GHXE: Tensor, groups: int) -> Tensor:
        """The inverse of _to_groups: [G, Hkv, M * Z, E] -> [B, Hkv, Z, E]."""
        _, heads, x, e = x_GHXE.shape
        m = self.rows_per_group
        slots = x_GHXE.view(groups, heads, m, x // m, e).transpose(1, 2)
        return slots.reshape(groups * m, heads, x // m, e)[self.slot_B]


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | SharedPrefixAttention | None,
    **kwargs,
) -> tuple[Tensor, None]:
    """The function registered as IMPLEMENTATION: shared-prefix attention for the sampler's
    decode passes, sdpa for everything else."""
    if isinstance(attention_mask, SharedPrefixAttention):
        scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
        return attention_mask.attend(module.layer_idx, query, key, value, scale), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(IMPLEMENTATION, attention_forward)
# Masks for everything but shared-prefix passes are sdpa's.
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def install(model: PreTrainedModel) -> None:
    """Make `model` attend with IMPLEMENTATION (idempotent). Only sdpa models: ours is sdpa for
    them, so nothing but shared-prefix passes changes."""
    current = model.config._attn_implementation
    if current == IMPLEMENTATION:
        return
    if current != "sdpa":
        raise ValueError(f"shared-prefix sampling needs an sdpa model, not {current!r}")
    model.set_attn_implementation(IMPLEMENTATION)
