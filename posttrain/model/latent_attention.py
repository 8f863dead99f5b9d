"""Multi-head latent attention (DeepSeek-V3) through posttrain's KV caches.

MLA projects each position to a compressed latent: `kv_a_proj_with_mqa` gives the key/value
latent c (kv_lora_rank wide, normalised by `kv_a_layernorm`) and one rope key k_rot shared by
every head (qk_rope_head_dim wide); `kv_b_proj` expands c into each head's key part k_nope
(qk_nope_head_dim) and its value (v_head_dim). A head's key is [k_nope | k_rot], qk_head_dim =
qk_nope_head_dim + qk_rope_head_dim wide, and its value is v_head_dim wide: keys and values of
different widths.

transformers' own forward hands the cache the latents (c as keys [B, 1, S, kv_lora_rank], k_rot
as values [B, 1, S, qk_rope_head_dim]) and expands what the cache returns. posttrain's caches
(kv_cache.py, fanout_kv_cache.py, the prefix cache, shared-prefix attention) hold keys and
values of one width and read the prefix keys and values directly as attention's: the latents
do not fit them (a "shape mismatch" at the first store), and a shared prefix of latents would
be attended as if they were keys. So `install` gives each MLA attention module a forward that,
in passes with a cache, expands the keys and values first and hands the cache the expanded
heads, values zero-padded to the key width (zeros in the padded value columns give zeros in
those output columns, which are cut away; keys and queries are padded instead where values are
wider, which adds 0 to every score). Without a cache (training, scoring) the module runs
transformers' forward, op for op.

Legend: B = rows, H = heads, S = positions of the pass, K = visible columns, D = the padded
width max(qk_head_dim, v_head_dim).

Imports: torch, transformers (the attention interface registry).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# The attention classes whose forward this module replaces in cached passes; their modeling
# files define `apply_rotary_pos_emb`, `apply_rotary_pos_emb_interleave` and
# `eager_attention_forward`.
LATENT_ATTENTION_CLASSES = frozenset({"DeepseekV3Attention"})


class _Cache(Protocol):
    def update(
        self, key_BHSD: Tensor, value_BHSD: Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]: ...


def latent_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's MLA attention modules, in model order."""
    return [m for m in model.modules() if type(m).__name__ in LATENT_ATTENTION_CLASSES]


def install(model: nn.Module) -> None:
    """Give every MLA attention module of `model` the cache-aware forward; idempotent. An
    instance attribute (a bound method), so a deep copy of the model (a full-weight generator)
    gets one bound to its own modules."""
    for module in latent_attention_modules(model):
        if "forward" in vars(module):
            continue
        module.forward = types.MethodType(_forward, module)


def _forward(
    module: nn.Module,
    hidden_states: Tensor,
    position_embeddings: tuple[Tensor, Tensor],
    attention_mask: Tensor | None,
    cache: _Cache | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    own_forward = cast(Callable[..., tuple[Tensor, Tensor | None]], type(module).forward)
    if cache is None:
        return own_forward(module, hidden_states, position_embeddings, attention_mask, **kwargs)
    m = cast(Any, module)  # the MLA module's own attributes (transformers is untyped)
    modeling = sys.modules[type(module).__module__]
    batch, width = hidden_states.shape[:-1]
    nope, rope, value_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    if m.q_lora_rank is None:
        q_states = m.q_proj(hidden_states)
    else:
        q_states = m.q_b_proj(m.q_a_layernorm(m.q_a_proj(hidden_states)))
    q_BHSE = q_states.view(batch, width, -1, m.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = q_BHSE.split([nope, rope], dim=-1)
    kv_nope, k_rot = m.kv_a_proj_with_mqa(hidden_states).split([m.kv_lora_rank, rope], dim=-1)
    kv_nope = m.kv_a_layernorm(kv_nope).view(batch, 1, width, m.kv_lora_rank)
    k_rot = k_rot.view(batch, 1, width, rope)
    cos, sin = position_embeddings
    if m.config.rope_interleave:
        q_rot, k_rot = modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    else:
        q_rot, k_rot = modeling.apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
    query = torch.cat((q_pass, q_rot), dim=-1)
    key, value = m.expand_kv(kv_nope, k_rot)
    padded = max(m.qk_head_dim, value_dim)
    query, key, value = (_pad_to(x, padded) for x in (query, key, value))
    key, value = cache.update(key, value, m.layer_idx, kwargs=kwargs)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(
        m.config._attn_implementation, modeling.eager_attention_forward
    )
    out_BSHD, weights = attend(
        module, query, key, value, attention_mask, dropout=0.0, scaling=m.scaling, **kwargs
    )
    out = out_BSHD[..., :value_dim].reshape(batch, width, -1)
    return m.o_proj(out), weights


def _pad_to(x_BHSE: Tensor, width: int) -> Tensor:
    """x zero-padded on its last dimension to `width` (itself when already that wide)."""
    extra = width - x_BHSE.shape[-1]
    return x_BHSE if extra == 0 else F.pad(x_BHSE, (0, extra))
