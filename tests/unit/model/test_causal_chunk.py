"""CausalChunk (model/attention.py): a prefill chunk's attention as a cached part and a causal
own part merged by log-sum-exp equals softmax attention under the causal mask (explicit float64
matmuls), with grouped-query heads, with and without cached positions, in the CPU's fused
kernels and in the explicit-matmul fallback; and no tensor as large as the chunk's [Q, K] mask
is ever allocated, where sdpa under that mask allocates a float copy of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from posttrain.model.attention import CausalChunk
from posttrain.model.attention_kernels import matmul_attention, partial_attention


def reference(query, key, value, scale):
    """Softmax attention in float64 under the visibility CausalChunk.mask gives: [B, Q, Hq, D]."""
    repeat = query.shape[1] // key.shape[1]
    key = key.double().repeat_interleave(repeat, 1)
    value = value.double().repeat_interleave(repeat, 1)
    scores = query.double() @ key.transpose(-1, -2) * scale
    visible = CausalChunk().mask(query, key)
    scores = scores.masked_fill(~visible, -torch.inf)
    return (scores.softmax(-1) @ value).transpose(1, 2).float()


@pytest.mark.parametrize("past", [0, 37])
def test_a_chunk_attends_as_the_causal_mask_says(past):
    generator = torch.Generator().manual_seed(past)
    width, head_dim = 23, 16
    query = torch.randn(2, 4, width, head_dim, generator=generator)
    key = torch.randn(2, 2, past + width, head_dim, generator=generator)
    value = torch.randn(2, 2, past + width, head_dim, generator=generator)
    scale = head_dim**-0.5
    out = CausalChunk().attend(query, key, value, scale)
    assert out.shape == (2, width, 4, head_dim)
    torch.testing.assert_close(out, reference(query, key, value, scale), atol=1e-5, rtol=0)


def test_the_causal_part_is_the_same_fused_or_as_matmuls():
    generator = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(1, 2, 19, 8, generator=generator) for _ in range(3))
    fused = partial_attention(query, key, value, None, 0.3, True, causal=True)
    plain = partial_attention(query, key, value, None, 0.3, False, causal=True)
    for ours, theirs in zip(fused, plain, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    # The first query sees only itself: its output is its own value, its lse its own score.
    torch.testing.assert_close(fused[0][..., 0, :], value[..., 0, :], atol=1e-6, rtol=0)
    own_score = (query[..., 0, :] * key[..., 0, :]).sum(-1) * 0.3
    torch.testing.assert_close(fused[1][..., 0], own_score, atol=1e-5, rtol=0)
    # And the matmul path is the one the shared-prefix kernels fall back to elsewhere.
    future = torch.ones(19, 19, dtype=torch.bool).triu(1)
    bias = torch.zeros(19, 19).masked_fill(future, -torch.inf)
    torch.testing.assert_close(plain[0], matmul_attention(query, key, value, bias, 0.3)[0])


def largest_allocation(run) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        run()
    return max(event.cpu_memory_usage for event in profiled.events())


def test_a_chunk_allocates_nothing_the_size_of_its_mask():
    width, past, head_dim = 512, 4096, 16
    query = torch.randn(1, 4, width, head_dim)
    key, value = torch.randn(1, 2, past + width, head_dim), torch.randn(1, 2, past + width, 16)
    mask_elements = width * (past + width)
    chunk = CausalChunk()
    ours = largest_allocation(lambda: chunk.attend(query, key, value, 0.25))
    masked = largest_allocation(
        lambda: F.scaled_dot_product_attention(
            query, key, value, attn_mask=chunk.mask(query, key), enable_gqa=True
        )
    )
    assert masked >= 4 * mask_elements  # sdpa's float copy of the mask
    assert ours < mask_elements // 4, (ours, mask_elements)
