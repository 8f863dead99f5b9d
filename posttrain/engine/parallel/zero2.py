"""A full-weight session's gradients and optimizer state sharded over the ranks of its
resource's trainer group (ZeRO-2: `--trainer-ranks N` with N > 1).

Each parameter has one owner rank, a pure function of the parameters' names and sizes (the
largest first, each to the rank holding the fewest bytes so far), so every rank computes the
same map without talking. After a backward each gradient is summed onto its owner only
(data_parallel.reduce_gradients) and dropped elsewhere; a rank therefore holds only its own
parameters' gradients, and torch's AdamW and the Muon loop (optim/optimizer.py), which create
state only for parameters with a gradient, hold only their moments and momentum buffers. The
owner steps its parameters, and then broadcasts them, so every rank holds every weight again.

What is sharded: accumulated gradients and optimizer state (about 1/N per rank each, whole
parameters at a time: Muon orthogonalises whole matrices). By default (ZeRO-3,
parallel/zero3.py) so are the parameters themselves, by the same owner map: a parameter
lives on its owner alone, is gathered per layer for the forward and again for the backward, a
layer's gradients are summed onto their owners as the backward leaves it, the generator's copy
is rank 0's alone, and the owner keeps its stepped parameters. With `--shard-parameters off`
(ZeRO-2) the parameters stay replicated (every rank forwards its rows through the whole
model; parallel/data_parallel.py), as do the generator's copy and the full gradients a
backward produces before they are summed onto their owners; the owner then broadcasts what it
stepped.

The clipping norm is exact: the per-parameter norms are summed into one vector in parameter
order (each entry has a single non-zero contributor, so the sum adds only zeros) and reduced
exactly as one process reduces them. Checkpoints gather the shards onto rank 0
(gather_to_rank_zero), which writes them in the single-process formats; loading keeps the
entries a rank owns, so a checkpoint from any N resumes on any other.

Imports: torch (torch.distributed); engine.parallel.data_parallel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from posttrain.engine.parallel.data_parallel import DataParallel


@dataclass(frozen=True)
class Sharding:
    """Which rank owns each parameter of one session, and the collectives over them."""

    group: DataParallel
    owners: dict[str, int]  # parameter name -> owning rank

    @classmethod
    def over(
        cls, group: DataParallel | None, named: Sequence[tuple[str, nn.Parameter]]
    ) -> Sharding | None:
        """The sharding of `named` over `group`; None without a group of two or more ranks."""
        if group is None or group.world < 2:
            return None
        held = [0] * group.world
        owners: dict[str, int] = {}
        sizes = [(p.numel() * p.element_size(), index) for index, (_, p) in enumerate(named)]
        for size, index in sorted(sizes, key=lambda s: (-s[0], s[1])):
            rank = min(range(group.world), key=lambda r: (held[r], r))
            owners[named[index][0]] = rank
            held[rank] += size
        return cls(group, owners)

    def owns(self, name: str) -> bool:
        return self.owners[name] == self.group.rank

    def max(self, value: float, device: torch.device) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group.group)
        return float(tensor)

    def grad_norm(self, named: Sequence[tuple[str, nn.Parameter]]) -> tuple[Tensor, list[bool]]:
        """G of losses.md 12.1 over every rank's gradients, computed as optim.global_grad_norm
        computes it in one process, and which parameters have a gradient on some rank."""
        device = named[0][1].device
        norms = torch.zeros(len(named), device=device)
        present = torch.zeros(len(named), device=device)
        for index, (_, p) in enumerate(named):
            if p.grad is not None:
                norms[index] = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
                present[index] = 1.0
        both = torch.stack([norms, present])
        dist.all_reduce(both, group=self.group.group)
        has = [v > 0 for v in both[1].tolist()]
        total = torch.linalg.vector_norm(both[0][torch.tensor(has, device=device)])
        return total, has

    @torch.no_grad()
    def broadcast(self, params: Sequence[tuple[str, nn.Parameter]]) -> None:
        """Every rank takes each parameter's values from its owner, one flat buffer per owner
        and dtype."""
        buckets: dict[tuple[int, torch.dtype], list[nn.Parameter]] = {}
        for name, p in params:
            buckets.setdefault((self.owners[name], p.dtype), []).append(p)
        for (owner, _), bucket in sorted(buckets.items(), key=lambda b: (b[0][0], str(b[0][1]))):
            flat = torch.cat([p.detach().reshape(-1) for p in bucket])
            dist.broadcast(flat, src=owner, group=self.group.group)
            if owner != self.group.rank:
                offset = 0
                for p in bucket:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()

    def gather_to_rank_zero(self, shard: dict[str, Any]) -> dict[str, Any] | None:
        """The ranks' `shard` dicts (name -> value, or a nest of them) merged on rank 0, with
        every tensor on the CPU; None on the other ranks. A collective: every rank calls it."""
        gathered: list[Any] | None = [None] * self.group.world if self.group.rank == 0 else None
        dist.gather_object(_to_cpu(shard), gathered, dst=0, group=self.group.group)
        if gathered is None:
            return None
        merged: dict[str, Any] = {}
        for part in gathered:
            _merge(merged, part)
        return merged


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().to("cpu")
    if isinstance(value, dict):
        return {key: _to_cpu(v) for key, v in value.items()}
    return value


def _merge(into: dict[str, Any], part: dict[str, Any]) -> None:
    """Disjoint leaves of `part` into `into`; dicts present on several ranks merge."""
    for key, value in part.items():
        if isinstance(value, dict) and not _is_leaf_entry(value):
            _merge(into.setdefault(key, {}), value)
        else:
            assert key not in into, f"two ranks hold {key}"
            into[key] = value


def _is_leaf_entry(value: dict[str, Any]) -> bool:
    """A parameter's own entry ({"exp_avg": ..., ...}) is owned whole by one rank."""
    return any(isinstance(v, Tensor) for v in value.values())
