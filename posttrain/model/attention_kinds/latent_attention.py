"""Multi-head latent attention (DeepSeek-V3, and the families whose attention is its op for op:
LATENT_ATTENTION_CLASSES) through posttrain's caches, which hold the latent.

MLA projects each position to one compressed vector: `kv_a_proj_with_mqa` gives the key/value
latent c (kv_lora_rank wide, normalised by `kv_a_layernorm`) and one rope key k_rot shared by
every head (qk_rope_head_dim wide, rotated); `kv_b_proj` expands c into each head's key part
k_nope (qk_nope_head_dim) and its value (v_head_dim). A head's key is [k_nope | k_rot], its value
is narrower or wider: keys and values of different widths, all from the W = kv_lora_rank +
qk_rope_head_dim numbers [c | k_rot] of a position.

posttrain's caches (kv_cache.py, fanout_kv_cache.py, the prefix cache) hold two slots of one
width per position and head. A cache for MLA holds the latent [c | k_rot] instead of keys and
values: one "head" whose two slots are the latent's halves (W zero-padded to an even width), so
a position costs W numbers per layer, what the architecture promises, and every cache
operation (spans, joins, forks, the prefix cache) moves latents unchanged. `install` gives each
MLA attention module a forward that, in passes with a cache, hands the cache the latent's
halves and attends over the latents it reads back, `kv_b_proj` applied with each row's LoRA
adapter. A shared-prefix (decode) pass attends in latent space (`_absorbed`): kv_b_proj
folded into the queries and into the attended latents, every head reading the latents as one
shared key/value head, each prompt's once for all its rows; so do a joining pass's decode
rows. Other passes expand: a prefill pass the rows' latents, a joining pass each joining
prompt's latents with the adapter of its first packed row, an eager model's decode pass each
row's prefix and own latents (attention.materialized); attention then runs on the
expanded heads as transformers' forward does (sdpa, or the family's eager attention). Without
a cache (training, scoring) the module runs transformers' forward, op for op.

Legend: B = rows, H = heads, Q = new positions per row, S / K = cached columns read,
W = the latent's width, E = half of it (padded), G = joining prompts, N = packed rows.

Imports: torch, transformers (sdpa attention), model/attention.py (the pass layouts),
model/lora.py (kv_b_proj's adapters, for the latent-space products).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from posttrain.model import attention
from posttrain.model.attention import CausalChunk, JoiningPassAttention, SharedPrefixAttention
from posttrain.model.lora import LoraLinear

# The attention classes whose forward this module replaces in cached passes: DeepSeek-V3's MLA
# and the families whose attention is op for op the same (their modeling files define
# `apply_rotary_pos_emb`, `eager_attention_forward` and, where the config has
# `rope_interleave`, `apply_rotary_pos_emb_interleave`; DeepSeek-V2's rotates by complex
# frequencies, `apply_rotary_emb`).
LATENT_ATTENTION_CLASSES = frozenset(
    {
        *("DeepseekV3Attention", "DeepseekV2Attention", "Glm4MoeLiteAttention"),
        *("MiniCPM3Attention", "YoutuAttention", "AXK1Attention", "LongcatFlashMLA"),
    }
)
# Those whose rope is always interleaved (their configs have no `rope_interleave`).
INTERLEAVED_ROPE_CLASSES = frozenset({"LongcatFlashMLA"})

_Attend = Callable[..., tuple[Tensor, Tensor | None]]
_SDPA = cast(_Attend, sdpa_attention_forward)
# Shared-prefix (decode) passes attend in latent space (`_absorbed`); off: every row's keys
# and values are expanded from its prefix and own latents (the joining and eager paths).
ABSORBED_DECODE = True


class _Cache(Protocol):
    def update(
        self, key_BHSD: Tensor, value_BHSD: Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]: ...


def latent_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's MLA attention modules, in model order."""
    return [m for m in model.modules() if type(m).__name__ in LATENT_ATTENTION_CLASSES]


def install(model: nn.Module) -> None:
    """Give every MLA attention module of `model` the latent-caching forward; idempotent. An
    instance attribute (a bound method), so a deep copy of the model (a full-weight generator)
    gets one bound to its own modules."""
    for module in latent_attention_modules(model):
        if "forward" in vars(module):
            continue
        module.forward = types.MethodType(_forward, module)


def latent_width(module: nn.Module) -> int:
    """W: the numbers a position's latent holds in one layer, kv_lora_rank + qk_rope_head_dim."""
    m = cast(Any, module)
    return int(m.kv_lora_rank) + int(m.qk_rope_head_dim)


def _forward(
    module: nn.Module,
    hidden_states: Tensor,
    position_embeddings: tuple[Tensor, Tensor] | Tensor,
    attention_mask: Tensor | None,
    cache: _Cache | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    own_forward = cast(Callable[..., tuple[Tensor, Tensor | None]], type(module).forward)
    if cache is None:
        # By keyword: the families order their forward's parameters differently.
        return own_forward(
            module,
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **kwargs,
        )
    m = cast(Any, module)  # the MLA module's own attributes (transformers is untyped)
    rows, width = hidden_states.shape[:-1]
    query_BHQD, latent_B1QW = _query_and_latent(module, hidden_states, position_embeddings)
    layout = attention.layer_layout(module, attention_mask)
    first, second = _halves(latent_B1QW)
    first, second = cache.update(first, second, m.layer_idx, kwargs=kwargs)
    attend = _attention_function(module)
    if isinstance(layout, JoiningPassAttention):
        out_BQHD = _joining_pass(module, layout, query_BHQD, first, second, attend, kwargs)
        return m.o_proj(out_BQHD.reshape(rows, width, -1)), None
    mask: Tensor | None
    if isinstance(layout, SharedPrefixAttention) and attend is _SDPA and ABSORBED_DECODE:
        out_BQHD = _absorbed(module, layout, query_BHQD, _whole(first, second, latent_width(m)))
        return m.o_proj(out_BQHD.reshape(rows, width, -1)), None
    if isinstance(layout, SharedPrefixAttention):
        first, second, mask = attention.materialized(layout, m.layer_idx, query_BHQD, first, second)
    elif isinstance(layout, CausalChunk):
        mask = layout.mask(query_BHQD, first)
    else:
        mask = layout
    key, value = _expand(module, _whole(first, second, latent_width(module)))
    out_BQHD, weights = attend(
        module, query_BHQD, key, value, mask, dropout=0.0, scaling=m.scaling, **kwargs
    )
    return m.o_proj(out_BQHD.reshape(rows, width, -1)), weights


def _query_and_latent(
    module: nn.Module, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor] | Tensor
) -> tuple[Tensor, Tensor]:
    """The queries [B, H, Q, qk_head_dim] and the positions' latents [B, 1, Q, W], computed op
    for op as transformers' forward computes them."""
    m = cast(Any, module)
    modeling = sys.modules[type(module).__module__]
    rows, width = hidden_states.shape[:-1]
    nope, rope = m.qk_nope_head_dim, m.qk_rope_head_dim
    if m.q_lora_rank is None:
        q_states = m.q_proj(hidden_states)
    else:
        q_states = m.q_b_proj(m.q_a_layernorm(m.q_a_proj(hidden_states)))
    q_BHQD = q_states.view(rows, width, -1, m.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = q_BHQD.split([nope, rope], dim=-1)
    kv_nope, k_rot = m.kv_a_proj_with_mqa(hidden_states).split([m.kv_lora_rank, rope], dim=-1)
    kv_nope = m.kv_a_layernorm(kv_nope)
    if hasattr(m, "mla_scale_q_lora"):  # LongCat-Flash scales the query and the latent
        q_pass, q_rot = q_pass * m.mla_scale_q_lora, q_rot * m.mla_scale_q_lora
        kv_nope = kv_nope * m.mla_scale_kv_lora
    kv_nope = kv_nope.view(rows, 1, width, m.kv_lora_rank)
    k_rot = k_rot.view(rows, 1, width, rope)
    if isinstance(position_embeddings, Tensor):  # DeepSeek-V2: complex frequencies
        frequencies = position_embeddings.to(q_rot.device)
        q_rot, k_rot = modeling.apply_rotary_emb(q_rot, k_rot, frequencies)
    elif getattr(m.config, "rope_interleave", type(module).__name__ in INTERLEAVED_ROPE_CLASSES):
        q_rot, k_rot = modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot, *position_embeddings)
    else:
        q_rot, k_rot = modeling.apply_rotary_pos_emb(q_rot, k_rot, *position_embeddings)
    return torch.cat((q_pass, q_rot), dim=-1), torch.cat((kv_nope, k_rot), dim=-1)


def _halves(latent_X1SW: Tensor) -> tuple[Tensor, Tensor]:
    """The latent as the two cache slots [X, 1, S, E], zero-padded to an even width."""
    padded = latent_X1SW.shape[-1] % 2
    if padded:
        latent_X1SW = F.pad(latent_X1SW, (0, 1))
    first, second = latent_X1SW.chunk(2, dim=-1)
    return first, second


def _whole(first_X1SE: Tensor, second_X1SE: Tensor, width: int) -> Tensor:
    """Inverse of _halves: the latent [X, 1, S, W]."""
    return torch.cat((first_X1SE, second_X1SE), dim=-1)[..., :width]


def _expand(
    module: nn.Module, latent_X1SW: Tensor, at: Tensor | None = None, rows: int = 0
) -> tuple[Tensor, Tensor]:
    """Keys [X, H, S, qk_head_dim] and values [X, H, S, v_head_dim] of the latents, expanded by
    `kv_b_proj` (transformers' expand_kv). Its LoRA adapters pick rows by the pass's row index:
    latent x is row at[x] of a pass of `rows` rows (None: row x of this pass)."""
    m = cast(Any, module)
    if at is not None:
        placed = latent_X1SW.new_zeros(rows, *latent_X1SW.shape[1:])
        latent_X1SW = placed.index_copy_(0, at, latent_X1SW)
    kv_nope, k_rot = torch.split(latent_X1SW, [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
    key, value = m.expand_kv(kv_nope, k_rot)
    if at is not None:
        key, value = key.index_select(0, at), value.index_select(0, at)
    return cast(tuple[Tensor, Tensor], (key, value))


def _absorbed(
    module: nn.Module, layout: SharedPrefixAttention, query_NHQD: Tensor, own_B1SW: Tensor
) -> Tensor:
    """A shared-prefix pass attending in latent space -> output [B, Q, H, v_head_dim]: the
    queries of the pass's N rows, the first B of which are the layout's (a joining pass packs
    its prompts after them; N = B otherwise), and those B rows' own latents.

    Head h's key part is W_k[h] c and its value W_v[h] c (W_k, W_v: kv_b_proj's rows for h's
    key part and value, [nope, r] and [v, r], LoRA adapters included), so

        q . [W_k[h] c | k_rot] = [W_k[h]^T q_nope | q_rot] . [c | k_rot]
        sum_j p_j W_v[h] c_j   = W_v[h] (sum_j p_j [c_j | k_rot_j])[:r]

    every head attends over the latents themselves, one key/value "head" shared by all (as
    multi-query attention): SharedPrefixAttention reads each prompt's latents once for all
    its rows, and nothing is expanded per row or per step."""
    m = cast(Any, module)
    nope, rank = m.qk_nope_head_dim, m.kv_lora_rank
    rows, packed = own_B1SW.shape[0], query_NHQD.shape[0]
    # kv_b_proj's LoRA routing indexes the pass's N rows, so both products run over N rows.
    q_nope, q_rot = torch.split(query_NHQD, [nope, m.qk_rope_head_dim], dim=-1)
    query_NHQW = torch.cat((_through_keys(m.kv_b_proj, q_nope, nope), q_rot), dim=-1)
    prefix = layout.prefix_kv[m.layer_idx]
    prefix_G1PW = _whole(prefix[0], prefix[1], latent_width(module))
    latent = dataclasses.replace(
        layout, prefix_kv=prefix_G1PW[None, None].expand(1, 2, *prefix_G1PW.shape), fused=False
    )
    out_BQHW = latent.attend(0, query_NHQW[:rows], own_B1SW, own_B1SW, float(m.scaling))
    out_NQHR = F.pad(out_BQHW[..., :rank], (0, 0, 0, 0, 0, 0, 0, packed - rows))
    return _through_values(m.kv_b_proj, out_NQHR, nope)[:rows]


def _kv_b_factors(
    projection: nn.Module, heads: int
) -> tuple[Tensor, list[tuple[Tensor | None, Tensor, Tensor, float]]]:
    """kv_b_proj's weight as [H, nope + v, r], and the adapters its current LoRA routing applies:
    (rows or None for all, A [R, r], B [H, nope + v, R], scale)."""
    if isinstance(projection, LoraLinear):
        base: nn.Linear = projection.base
        adapters = []
        for key, rows in projection.routing:
            if (adapter := projection.adapters.get(key)) is not None:
                lora_B = adapter.lora_B.view(heads, -1, adapter.lora_B.shape[-1])
                adapters.append((rows, adapter.lora_A, lora_B, adapter.scale))
    else:
        base, adapters = cast(nn.Linear, projection), []
    assert base.bias is None, "kv_b_proj without bias (DeepSeek-V3's)"
    return base.weight.view(heads, -1, base.in_features), adapters


def _through_keys(projection: nn.Module, q_nope_BHQD: Tensor, nope: int) -> Tensor:
    """W_k[h]^T q for each head h: the queries' nope parts in latent space [B, H, Q, r]."""
    weight_HOR, adapters = _kv_b_factors(projection, q_nope_BHQD.shape[1])
    q_BHQR = torch.einsum("bhqd,hdr->bhqr", q_nope_BHQD, weight_HOR[:, :nope])
    for rows, lora_A, lora_B, scale in adapters:
        q_rows = q_nope_BHQD if rows is None else q_nope_BHQD.index_select(0, rows)
        low = torch.einsum("bhqd,hdk->bhqk", q_rows.to(lora_A.dtype), lora_B[:, :nope])
        delta = (scale * (low @ lora_A)).to(q_BHQR.dtype)
        q_BHQR = q_BHQR + delta if rows is None else q_BHQR.index_add(0, rows, delta)
    return q_BHQR


def _through_values(projection: nn.Module, out_BQHR: Tensor, nope: int) -> Tensor:
    """W_v[h] o for each head h: the attended latents as values [B, Q, H, v_head_dim]."""
    weight_HOR, adapters = _kv_b_factors(projection, out_BQHR.shape[2])
    out = out_BQHR.to(weight_HOR.dtype)
    values_BQHV = torch.einsum("bqhr,hvr->bqhv", out, weight_HOR[:, nope:])
    for rows, lora_A, lora_B, scale in adapters:
        out_rows = out if rows is None else out.index_select(0, rows)
        low = out_rows.to(lora_A.dtype) @ lora_A.t()
        delta = scale * torch.einsum("bqhk,hvk->bqhv", low, lora_B[:, nope:])
        delta = delta.to(values_BQHV.dtype)
        if rows is None:
            values_BQHV = values_BQHV + delta
        else:
            values_BQHV = values_BQHV.index_add(0, rows, delta)
    return values_BQHV


def _attention_function(module: nn.Module) -> _Attend:
    """sdpa, or the family's eager attention for a model posttrain runs eagerly."""
    m = cast(Any, module)
    if m.config._attn_implementation == attention.EAGER_IMPLEMENTATION:
        eager = cast(_Attend, sys.modules[type(module).__module__].eager_attention_forward)

        def additive(
            module: nn.Module, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, **kw: Any
        ) -> tuple[Tensor, Tensor | None]:
            if mask is not None and mask.dtype == torch.bool:
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                    ~mask, torch.finfo(q.dtype).min
                )
            return eager(module, q, k, v, mask, **kw)

        return additive
    return _SDPA


def _joining_pass(
    module: nn.Module,
    layout: JoiningPassAttention,
    query_NHQD: Tensor,
    own_first: Tensor,
    own_second: Tensor,
    attend: _Attend,
    kwargs: dict[str, Any],
) -> Tensor:
    """JoiningPassAttention.attend on latents: the B decode rows attend over their prefixes
    and own parts (in latent space, or expanded), the joining prompts' packed positions over
    their prompts' latents (the packed pass's cache, written by `update`), expanded -> output
    [N, 1, H, v_head_dim]."""
    m = cast(Any, module)
    packed, heads = query_NHQD.shape[0], query_NHQD.shape[1]
    rows, decode = layout.decode_rows, layout.decode
    width = latent_width(module)
    if attend is _SDPA and ABSORBED_DECODE:
        decoded = _absorbed(module, decode, query_NHQD, _whole(own_first, own_second, width))
    else:
        query_BHQD = query_NHQD[:rows]
        first, second, mask = attention.materialized(
            decode, m.layer_idx, query_BHQD, own_first, own_second
        )
        at_B = torch.arange(rows, device=query_NHQD.device)
        key, value = _expand(module, _whole(first, second, width), at_B, packed)
        decoded, _ = attend(module, query_BHQD, key, value, mask, dropout=0.0, scaling=m.scaling)
    groups, _, columns, _ = layout.mask_G1QK.shape
    prompt_kv = layout.prefill_kv[m.layer_idx, :, :groups, :, : layout.visible]
    # Prompt g's latents expand with the adapter of its first packed row: prompts run packed
    # one after another, so its first row is B + the first packed index in group g.
    group_W = torch.div(layout.real_W, columns, rounding_mode="floor")
    first_G = torch.searchsorted(group_W, torch.arange(groups, device=group_W.device)) + rows
    key, value = _expand(module, _whole(prompt_kv[0], prompt_kv[1], width), first_G, packed)
    head_dim = query_NHQD.shape[-1]
    query_XHD = query_NHQD.new_zeros(groups * columns, heads, head_dim)
    query_XHD.index_copy_(0, layout.real_W, query_NHQD[rows:, :, 0])
    query_GHQD = query_XHD.view(groups, columns, heads, head_dim).transpose(1, 2)
    prefilled_GQHD, _ = attend(
        module, query_GHQD, key, value, layout.mask_G1QK, dropout=0.0, scaling=m.scaling, **kwargs
    )
    prefilled_XHD = prefilled_GQHD.reshape(groups * columns, heads, -1)
    return torch.cat([decoded, prefilled_XHD.index_select(0, layout.real_W)[:, None]])
