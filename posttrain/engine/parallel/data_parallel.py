"""Data parallelism of one model resource's trainer over the ranks of a torch.distributed group
(hosts/ranks/trainer_group.py starts them): which rows of a batch each rank forwards, the gather of
their logprobs, and the all-reduce of the gradients.

Exact for every loss: the losses have batch-global normalisers (token means, sequence means,
fixed horizons; reference/losses.md), so a rank cannot score its rows alone. Instead each rank
forwards only its share of the rows, the shares are all-gathered into the full [S, T] logprobs
(its own rows as graph tensors, the others' detached), and every rank scores every member on
the full batch exactly as one process would: loss, metrics and per-token outputs are the same
on every rank. The backward then reaches only the rank's own rows, so the sum over ranks of
the gradients is the gradient of the whole batch: `all_reduce_gradients` adds them up before
the trainer checks them for finiteness, so every rank decides the same and steps the same.

A resource without a group (ResourceState.group None, the single-process engine) never
reaches this module.

Legend: S = samples, T = longest sample, R = rows of one rank.

Imports: torch (torch.distributed); nothing of posttrain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn


@dataclass(frozen=True)
class DataParallel:
    """This process's place in its resource's trainer group."""

    rank: int
    world: int
    group: dist.ProcessGroup | None = None  # None: the default group

    def shares(self, lengths_S: Sequence[int]) -> list[list[int]]:
        """Rows of each rank, ascending, balanced by tokens: the longest row first, each to
        the rank with the fewest tokens so far (the lower rank on a tie). A pure function of
        the lengths, so every rank computes the same split without talking."""
        tokens = [0] * self.world
        shares: list[list[int]] = [[] for _ in range(self.world)]
        for row in sorted(range(len(lengths_S)), key=lambda r: (-lengths_S[r], r)):
            rank = min(range(self.world), key=lambda q: (tokens[q], q))
            shares[rank].append(row)
            tokens[rank] += lengths_S[row]
        return [sorted(share) for share in shares]

    def logprobs(
        self,
        forward: Callable[[list[int]], Tensor],
        lengths_S: Sequence[int],
        width: int,
        device: torch.device,
    ) -> Tensor:
        """The batch's float32 [S, width] logprobs: `forward(rows)` ([R, width], in graph) of
        this rank's rows (called with no rows too), the other ranks' rows gathered from them,
        detached."""
        shares = self.shares(lengths_S)
        own = shares[self.rank]
        own_RT = forward(own)
        most = max(len(share) for share in shares)
        padded_RT = torch.zeros(most, width, device=device)
        padded_RT[: len(own)] = own_RT.detach()
        gathered = [torch.empty_like(padded_RT) for _ in range(self.world)]
        dist.all_gather(gathered, padded_RT, group=self.group)
        full_ST = torch.zeros(len(lengths_S), width, device=device)
        for share, rows_RT in zip(shares, gathered, strict=True):
            if share:
                full_ST[torch.tensor(share, device=device)] = rows_RT[: len(share)]
        # Out of place: the rank's rows carry the graph of its forward, the rest carry none
        # (a rank without rows still carries the graph of its padding forwards, if any).
        own_R = torch.tensor(own, dtype=torch.int64, device=device)
        return full_ST.index_copy(0, own_R, own_RT)

    def all_true(self, flags: Sequence[bool], device: torch.device) -> list[bool]:
        """Each flag AND-ed over the ranks, so every rank decides alike."""
        values = torch.tensor([float(not flag) for flag in flags], device=device)
        dist.all_reduce(values, group=self.group)
        return [value == 0 for value in values.tolist()]

    def all_reduce_gradients(self, params: Sequence[nn.Parameter]) -> None:
        """Sum every parameter's .grad over the ranks, in place, in one flat buffer per dtype.

        A parameter none of whose ranks has a gradient keeps .grad None, as in one process; one
        that some rank has (its rows reached it) gets zeros on the others before the sum."""
        if not params:
            return
        device = params[0].device
        has_grad = torch.tensor([p.grad is not None for p in params], device=device)
        counts = has_grad.to(torch.float32)
        dist.all_reduce(counts, group=self.group)
        reached = [p for p, count in zip(params, counts.tolist(), strict=True) if count > 0]
        buckets: dict[torch.dtype, list[Tensor]] = {}  # the gradients, by dtype
        for p in reached:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            buckets.setdefault(p.grad.dtype, []).append(p.grad)
        for _, grads in sorted(buckets.items(), key=lambda b: str(b[0])):
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for grad in grads:
                size = grad.numel()
                grad.copy_(flat[offset : offset + size].view_as(grad))
                offset += size
