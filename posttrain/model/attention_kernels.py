"""The kernels of shared-prefix attention (model/attention.py): one part of softmax attention
with its log-sum-exp, and the exact merge of two parts by their log-sum-exps.

A part is softmax attention of queries over some of their keys: (output, lse), lse the float32
log-sum-exp of the part's scaled, biased scores. Two parts over disjoint key sets merge into
attention over their union:

    lse = logaddexp(lse_1, lse_2),   out = out_1 * exp(lse_1 - lse) + out_2 * exp(lse_2 - lse)

A part may be causal (queries and keys the same positions, query i seeing keys 0..i): the
kernels mask it themselves, so a prefill chunk's own part builds no [L, S] mask
(model/attention.py, CausalChunk).

Kernels (`fused`), each returning the log-sum-exp so nothing is recomputed:
- CPU: PyTorch's flash-attention kernel for the CPU;
- CUDA: the memory-efficient kernel (`_scaled_dot_product_efficient_attention` with
  compute_log_sumexp), which takes an additive bias (flash on CUDA takes none) and every
  floating dtype. Its bias must be in the query's dtype, broadcast to [B, H, L, S], with a
  last-dimension stride aligned to 16 elements (the padding sdpa itself applies);
- otherwise (other devices, sliding windows that may hide every key of a part): explicit
  matmuls in float32.

Legend: B = batch (rows or groups), H = heads, L = query rows, S = keys, D = head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# The memory-efficient CUDA kernel reads its bias in blocks of this many elements.
_BIAS_ALIGNMENT = 16


def merge_by_lse(out_1: Tensor, lse_1: Tensor, out_2: Tensor, lse_2: Tensor) -> Tensor:
    """Attention over the union of two parts' keys, float32 [..., L, D] from the parts'
    outputs [..., L, D] and log-sum-exps [..., L]. A part a query sees nothing of has lse -inf
    and weight 0 (its output, whatever it is, does not enter); part 2 must see something."""
    lse = torch.logaddexp(lse_1, lse_2)
    weight_1 = (lse_1 - lse).exp()[..., None]
    weight_2 = (lse_2 - lse).exp()[..., None]
    weighted_1 = torch.where(weight_1 > 0, out_1.float() * weight_1, 0.0)
    return weighted_1 + out_2.float() * weight_2


def partial_attention(
    q_BHLD: Tensor,
    k_BHSD: Tensor,
    v_BHSD: Tensor,
    bias: Tensor | None,
    scale: float,
    fused: bool,
    *,
    causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """Softmax attention of q over k, v with an additive bias: (output [B, H, L, D], float32
    log-sum-exp of the scaled, biased scores [B, H, L]; -inf and output 0 where a query sees
    nothing). `fused`: the device's fused kernel (no query may see nothing). `causal` (L = S,
    no bias): query i sees keys 0..i, the kernels' own causal masking (no [L, S] mask)."""
    assert not causal or (bias is None and q_BHLD.shape[2] == k_BHSD.shape[2])
    if fused and q_BHLD.device.type == "cpu":
        mask = None if bias is None else bias.to(q_BHLD.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_BHLD, k_BHSD, v_BHSD, is_causal=causal, attn_mask=mask, scale=scale
        )
        return out, lse.float()
    if fused and q_BHLD.device.type == "cuda":
        return efficient_attention_cuda(q_BHLD, k_BHSD, v_BHSD, bias, scale, causal=causal)
    if causal:
        width = q_BHLD.shape[2]
        future = torch.ones(width, width, dtype=torch.bool, device=q_BHLD.device).triu(1)
        bias = torch.zeros(width, width, device=q_BHLD.device).masked_fill_(future, -torch.inf)
    return matmul_attention(q_BHLD, k_BHSD, v_BHSD, bias, scale)


def matmul_attention(
    q_BHLD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, bias: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """partial_attention as explicit matmuls, float32 scores (any device, any visibility)."""
    scores = torch.matmul(q_BHLD, k_BHSD.transpose(-1, -2)).float().mul_(scale)
    if bias is not None:
        scores.add_(bias)
    lse = scores.logsumexp(-1)
    safe_lse = torch.where(torch.isfinite(lse), lse, 0.0)
    weights = (scores - safe_lse[..., None]).exp().to(q_BHLD.dtype)
    return torch.matmul(weights, v_BHSD), lse


def aligned_bias(bias: Tensor, shape: tuple[int, int, int, int], dtype: torch.dtype) -> Tensor:
    """`bias` broadcast to `shape` [B, H, L, S] in `dtype`, as a view of a tensor whose last
    dimension is padded to a multiple of _BIAS_ALIGNMENT (what the CUDA kernel reads)."""
    columns = shape[-1]
    padded = -(-columns // _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT
    bias = bias.to(dtype)
    if padded != columns:
        bias = F.pad(bias, (0, padded - columns))
    return bias.expand(*shape[:-1], padded)[..., :columns]


def efficient_attention_cuda(
    q_BHLD: Tensor,
    k_BHSD: Tensor,
    v_BHSD: Tensor,
    bias: Tensor | None,
    scale: float,
    *,
    causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """partial_attention in CUDA's memory-efficient kernel (it returns the log-sum-exp; its
    log-sum-exp tensor is padded along L, so it is cut back)."""
    rows, heads, width, _ = q_BHLD.shape
    attn_bias = None
    if bias is not None:
        attn_bias = aligned_bias(bias, (rows, heads, width, k_BHSD.shape[2]), q_BHLD.dtype)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q_BHLD, k_BHSD, v_BHSD, attn_bias, True, is_causal=causal, scale=scale
    )
    return out, lse[..., :width].float()
