"""Gradient accumulation across forward-backwards, all-or-nothing per session: a backward whose
gradients are not finite fails its session's item and leaves the session's accumulated
gradients exactly as they were (losses.md 11.3). In a trainer group (parallel/data_parallel.py)
the new gradients are summed over the ranks first, and every rank decides the same.

Not here: the forward passes and losses that produce the summed loss (trainer.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from posttrain.engine.parallel.data_parallel import DataParallel
from posttrain.engine.parallel.fsdp import local
from posttrain.engine.state import SessionState
from posttrain.errors import NonFiniteLoss


def accumulate_many(
    items: list[tuple[SessionState, Tensor]],
    *,
    group: DataParallel | None = None,
    reduced: frozenset[int] = frozenset(),
) -> list[NonFiniteLoss | None]:
    """Add d loss_i / d params_i to each session's gradients, all-or-nothing per session.

    One backward over the summed losses runs into empty .grad buffers (sessions own disjoint
    parameters, and rows never mix, so each session receives only its own loss's gradient).
    Only when a session's new gradients are all finite are its earlier accumulated
    gradients added back; otherwise they are restored exactly and its item fails. In a
    trainer `group` the new gradients are first summed over its ranks (parallel/data_parallel.py),
    and the ranks AND their finiteness, so every rank decides the same. `reduced`: ids of
    parameters whose gradients the backward itself already reduce-scattered (a session sharded
    with FSDP2, parallel/fsdp.py: each rank checks its slices)."""
    stashed = []
    for session, _ in items:
        params = [p for _, p in session.optimizer.named_params]
        stashed.append((params, [p.grad for p in params]))
        for p in params:
            p.grad = None
    try:
        total = torch.stack([loss for _, loss in items]).sum()
        if group is None:
            torch.autograd.backward(total)
        else:
            if total.requires_grad:  # else none of the rank's rows is a trainable member's
                torch.autograd.backward(total)
            params = [p for params, _ in stashed for p in params]
            group.all_reduce_gradients([p for p in params if id(p) not in reduced])
    except BaseException:
        # Out of memory mid-backward, say: the items fail, their earlier gradients stay.
        for params, earlier in stashed:
            for p, g in zip(params, earlier, strict=True):
                p.grad = g
        raise
    finite = [
        all(p.grad is None or bool(torch.isfinite(local(p.grad)).all()) for p in params)
        for params, _ in stashed
    ]
    if group is not None:  # a sharded session's ranks each checked only their own slices
        finite = group.all_true(finite, stashed[0][0][0].device)
    errors: list[NonFiniteLoss | None] = []
    for (params, earlier), ok in zip(stashed, finite, strict=True):
        new = [p.grad for p in params]
        if not ok:
            for p, g in zip(params, earlier, strict=True):
                p.grad = g
            errors.append(NonFiniteLoss("gradient is not finite; nothing was accumulated"))
            continue
        for p, old, g in zip(params, earlier, new, strict=True):
            p.grad = g if old is None else (old if g is None else old + g)
        errors.append(None)
    return errors


@contextmanager
def frozen(params: list[nn.Parameter]) -> Iterator[None]:
    """Keep forward_only sessions out of a shared pass's graph, so the backward of the other
    sessions' losses leaves their .grad exactly as it was (not a tensor of zeros)."""
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)
