"""Muon's step over FSDP2 shards (parallel/fsdp.py): Newton-Schulz of whole matrices, the work
spread over the ranks.

Muon orthogonalises whole matrices, but each rank holds a dim-0 slice of every one. Each
matrix gets one rank that orthogonalises it, a pure function of the shapes (the costliest
first, each to the rank with the least Newton-Schulz work so far, the lower rank on a tie),
so every rank computes the same plan without talking. Then, for each matrix in order, its
slices are gathered onto that rank (dist.gather: each slice crosses the network once); each
rank runs Newton-Schulz on its own matrices, all at once; and each result goes back as slices
(dist.scatter). A rank therefore does about 1/N of the work and holds, at the peak, its own
matrices in full, not the model's; the values are one process's, bit for bit (the same
float32 Newton-Schulz of the same whole matrix).

Imports: torch (torch.distributed); types, engine (optim.muon; parallel: data_parallel, and
fsdp for the shard layout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from posttrain.engine.optim.muon import apply_update_, nesterov_, num_row_blocks, orthogonalised
from posttrain.engine.parallel.data_parallel import DataParallel
from posttrain.engine.parallel.fsdp import local, row_counts
from posttrain.types import MuonParams, MuonScaling


@dataclass(frozen=True)
class Matrix:
    """One Muon parameter's update on this rank: its slice (rows of dim 0) and whole shape."""

    update: Tensor  # this rank's rows of dim 0 (possibly none)
    shape: tuple[int, ...]
    num_blocks: int


def plan(matrices: Sequence[Matrix], world: int) -> list[int]:
    """The rank that orthogonalises each matrix, balancing the Newton-Schulz flops (each
    step about 2 min(R, C)^2 max(R, C) per matrix, times the matrices a tensor stacks)."""
    load = [0.0] * world
    ranks = [0] * len(matrices)

    def cost(m: Matrix) -> float:
        rows, cols = m.shape[-2] // m.num_blocks, m.shape[-1]
        stacked = m.num_blocks * math.prod(m.shape[:-2])
        return stacked * min(rows, cols) ** 2 * max(rows, cols)

    for index in sorted(range(len(matrices)), key=lambda i: (-cost(matrices[i]), i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        ranks[index] = rank
        load[rank] += cost(matrices[index])
    return ranks


def orthogonalise(
    matrices: Sequence[Matrix], num_ns_steps: int, rank: int, world: int
) -> list[Tensor]:
    """This rank's slice (float32) of NS of each whole matrix. A collective: every rank passes
    the same matrices (its own slices) in the same order."""
    owners = plan(matrices, world)
    whole: dict[int, Tensor] = {}
    for index, matrix in enumerate(matrices):
        counts = row_counts(matrix.shape[0], world)
        padded = _padded(matrix.update, counts[0], matrix.shape)
        owner = owners[index]
        pieces = [torch.empty_like(padded) for _ in range(world)] if owner == rank else None
        dist.gather(padded, pieces, dst=owner)
        if pieces is not None:
            whole[index] = torch.cat([p[:c] for p, c in zip(pieces, counts, strict=True)])
    done = {
        index: orthogonalised(update, matrices[index].num_blocks, num_ns_steps)
        for index, update in whole.items()
    }
    results = []
    for index, matrix in enumerate(matrices):
        counts = row_counts(matrix.shape[0], world)
        owner = owners[index]
        out = torch.empty(
            (counts[0], *matrix.shape[1:]), dtype=torch.float32, device=matrix.update.device
        )
        chunks = None
        if owner == rank:
            ortho = done.pop(index)
            starts = [sum(counts[:r]) for r in range(world)]
            chunks = [
                _padded(ortho[s : s + c], counts[0], matrix.shape)
                for s, c in zip(starts, counts, strict=True)
            ]
        dist.scatter(out, chunks, src=owner)
        results.append(out[: counts[rank]])
    return results


def _padded(rows: Tensor, length: int, shape: tuple[int, ...]) -> Tensor:
    """`rows` (some rows of a tensor of `shape`) padded with zeros to `length` rows, float32."""
    padded = torch.zeros((length, *shape[1:]), dtype=torch.float32, device=rows.device)
    padded[: rows.shape[0]] = rows
    return padded


@torch.no_grad()
def step_(
    stepped: Sequence[tuple[str, nn.Parameter, Tensor]],
    buffers: dict[str, Tensor],
    muon: MuonParams,
    scaling: MuonScaling,
    group: DataParallel,
) -> None:
    """One Muon step of the sharded parameters with a gradient (`stepped`: name, parameter,
    gradient; losses.md 12.3): the momentum entry by entry on each slice (`buffers`, by name,
    created as DTensors like the gradient), Newton-Schulz of the whole matrices spread over the
    ranks, the update slice by slice. The values of optim.muon.muon_update_ in one process. A
    collective."""
    matrices = []
    for name, p, grad in stepped:
        if name not in buffers:
            buffers[name] = torch.zeros_like(grad)
        update = nesterov_(local(grad), local(buffers[name]), muon.momentum)
        matrices.append(Matrix(update, tuple(p.shape), num_row_blocks(name)))
    orthos = orthogonalise(matrices, muon.newton_schulz_steps, group.rank, group.world)
    for (name, p, _), ortho in zip(stepped, orthos, strict=True):
        apply_update_(
            local(p),
            ortho,
            learning_rate=muon.learning_rate,
            weight_decay=muon.weight_decay,
            scaling=scaling,
            num_blocks=num_row_blocks(name),
            shape=tuple(p.shape),
        )
