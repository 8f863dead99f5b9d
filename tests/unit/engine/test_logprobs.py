"""Chunked target logprobs (engine/train/logprobs.py): values and gradients equal a full log-softmax
on both head paths (frozen head: gradient kept from forward; trainable head: recomputed)."""

from __future__ import annotations

import pytest
import torch

from posttrain.engine.train.logprobs import target_logprobs


def reference(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logprobs = torch.log_softmax(head(hidden).float(), -1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("trainable_head", [False, True])
def test_values_and_gradients_equal_a_full_log_softmax(trainable_head):
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False).requires_grad_(trainable_head)
    hidden = torch.randn(3, 7, 8, requires_grad=True)
    targets = torch.randint(0, 11, (3, 7))
    upstream = torch.randn(3, 7)
    inputs = [hidden, *(p for p in head.parameters() if p.requires_grad)]

    want = reference(head, hidden, targets)
    want_grads = torch.autograd.grad((want * upstream).sum(), inputs)
    got = target_logprobs(head, hidden, targets, chunk_tokens=6)
    got_grads = torch.autograd.grad((got * upstream).sum(), inputs)

    torch.testing.assert_close(got, want)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad)


def test_without_gradients_no_graph_is_built():
    head = torch.nn.Linear(8, 11, bias=False).requires_grad_(False)
    hidden, targets = torch.randn(2, 5, 8), torch.randint(0, 11, (2, 5))
    with torch.no_grad():
        got = target_logprobs(head, hidden, targets, chunk_tokens=4)
    assert got.grad_fn is None
    torch.testing.assert_close(got, reference(head, hidden, targets))
