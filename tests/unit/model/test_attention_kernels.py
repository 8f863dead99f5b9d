"""Shared-prefix attention's kernels (model/attention_kernels.py): two parts merged by their
log-sum-exps equal softmax attention over all the keys, each fused kernel equals the explicit
matmuls (output and log-sum-exp), and the CUDA kernel's bias layout keeps the bias's values.
The CUDA kernel itself runs only where there is a GPU (and in bench/gpu_check.py)."""

from __future__ import annotations

import pytest
import torch

from posttrain.model.attention_kernels import (
    aligned_bias,
    efficient_attention_cuda,
    matmul_attention,
    merge_by_lse,
    partial_attention,
)

ROWS, HEADS, QUERIES, KEYS, DIM = 3, 2, 4, 19, 8
SCALE = DIM**-0.5


def inputs(generator: torch.Generator, device: str = "cpu", dtype=torch.float32):
    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    return (
        rand(ROWS, HEADS, QUERIES, DIM),
        rand(ROWS, HEADS, KEYS, DIM),
        rand(ROWS, HEADS, KEYS, DIM),
    )


def bias_hiding(hidden):  # [ROWS, QUERIES, KEYS] bool -> additive [ROWS, 1, QUERIES, KEYS]
    return torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))[:, None]


def reference(q, k, v, bias):
    """Softmax attention over all keys, float64."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * SCALE + bias.double()
    return scores.softmax(-1) @ v.double()


def test_two_parts_merged_by_lse_equal_attention_over_all_keys():
    generator = torch.Generator().manual_seed(0)
    q, k, v = inputs(generator)
    hidden = torch.rand(ROWS, QUERIES, KEYS, generator=generator) < 0.3
    split = 11  # part 1: keys [0, 11), part 2: keys [11, 19)
    hidden[:, :, split:] = False  # every query sees all of part 2
    hidden[0, 1, :split] = True  # this query sees nothing of part 1: lse -inf, weight 0
    bias = bias_hiding(hidden)
    out_1, lse_1 = matmul_attention(q, k[:, :, :split], v[:, :, :split], bias[..., :split], SCALE)
    out_2, lse_2 = matmul_attention(q, k[:, :, split:], v[:, :, split:], bias[..., split:], SCALE)
    assert lse_1[0, :, 1].eq(float("-inf")).all()
    merged = merge_by_lse(out_1, lse_1, out_2, lse_2)
    torch.testing.assert_close(merged.double(), reference(q, k, v, bias), atol=1e-5, rtol=1e-5)
    # The merged log-sum-exp is the whole row's.
    whole = ((q.double() @ k.double().transpose(-1, -2)) * SCALE + bias.double()).logsumexp(-1)
    torch.testing.assert_close(torch.logaddexp(lse_1, lse_2).double(), whole)


@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_fused_kernel_equals_the_matmuls_with_its_log_sum_exp(with_bias):
    generator = torch.Generator().manual_seed(1)
    q, k, v = inputs(generator)
    bias = None
    if with_bias:
        hidden = torch.rand(ROWS, QUERIES, KEYS, generator=generator) < 0.4
        hidden[..., 0] = False  # every query sees a key
        bias = bias_hiding(hidden)
    fused_out, fused_lse = partial_attention(q, k, v, bias, SCALE, fused=True)
    plain_out, plain_lse = partial_attention(q, k, v, bias, SCALE, fused=False)
    torch.testing.assert_close(fused_out, plain_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_lse, plain_lse, atol=1e-5, rtol=1e-5)
    assert fused_lse.dtype == torch.float32


def test_aligned_bias_keeps_values_with_a_16_element_aligned_row_stride():
    bias = torch.randn(ROWS, 1, QUERIES, KEYS)
    shape = (ROWS, HEADS, QUERIES, KEYS)
    aligned = aligned_bias(bias, shape, torch.bfloat16)
    assert aligned.shape == shape and aligned.dtype == torch.bfloat16
    assert aligned.stride(-2) % 16 == 0 and aligned.stride(-1) == 1
    assert torch.equal(aligned, bias.to(torch.bfloat16).expand(shape))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_efficient_kernel_equals_the_matmuls_with_its_log_sum_exp(dtype):
    generator = torch.Generator().manual_seed(2)
    q, k, v = inputs(generator, "cuda", dtype)
    hidden = torch.rand(ROWS, QUERIES, KEYS, generator=generator) < 0.4
    hidden[..., 0] = False
    bias = bias_hiding(hidden).cuda()
    out, lse = efficient_attention_cuda(q, k, v, bias, SCALE)
    plain_out, plain_lse = matmul_attention(q.float(), k.float(), v.float(), bias, SCALE)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), plain_out, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(lse, plain_lse, atol=tolerance, rtol=tolerance)
