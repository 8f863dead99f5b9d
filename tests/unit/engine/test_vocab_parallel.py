"""Logprobs from a head sharded by vocabulary rows (engine/parallel/vocab_parallel.py, what an
untied head of an FSDP2-sharded full-weight session computes on each rank) equal one process's
log-softmax of the whole head (bare, and soft-capped as Gemma's), and their gradients equal
autograd's: each rank's slice of the head's gradient and each rank's hidden states' gradient,
within 1e-5 relative. The embedding looked up on the ranks' rows equals nn.Embedding's exactly,
its gradient (none into the padding row) within 1e-5. Real gloo groups of 2 and 3 processes;
uneven vocabulary slices (37 rows), ranks with different token counts and one with none, chunks
smaller than the group's tokens, targets on every slice's first and last row."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port

from posttrain.engine.parallel.vocab_parallel import (
    vocab_parallel_embedding,
    vocab_parallel_logprobs,
)

VOCAB, HIDDEN, CHUNK, PADDING = 37, 8, 4, 13
REL = 1e-5


def _softcap(logits: torch.Tensor) -> torch.Tensor:
    """Gemma 2/3's final soft-capping (model/logit_head.py), an elementwise post-processing."""
    return torch.tanh(logits / 2.0) * 2.0


TRANSFORMS = {"bare": None, "softcap": _softcap}


def _case(tokens: list[int]):
    """The full head, every rank's hidden states, targets and upstream gradients."""
    generator = torch.Generator().manual_seed(7)
    weight_VH = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64).float()
    bounds = [0, 12, 13, 18, 19, 24, 25, VOCAB - 1]  # every 2- and 3-way slice's ends
    hidden, targets, grads = [], [], []
    for count in tokens:
        hidden.append(torch.randn(count, HIDDEN, generator=generator))
        picked = torch.randint(0, VOCAB, (count,), generator=generator)
        picked[: min(count, len(bounds))] = torch.tensor(bounds[: min(count, len(bounds))])
        targets.append(picked)
        grads.append(torch.randn(count, generator=generator))
    embedding_grads = [torch.randn(count, HIDDEN, generator=generator) for count in tokens]
    return weight_VH, hidden, targets, grads, embedding_grads


def _rank(rank: int, world: int, port: int, tokens: list[int], out: str, transform: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        weight_VH, hidden, targets, grads, embedding_grads = _case(tokens)
        rows = [len(c) for c in torch.arange(VOCAB).chunk(world)]
        start = sum(rows[:rank])
        local_VH = weight_VH[start : start + rows[rank]].clone().requires_grad_(True)
        hidden_NH = hidden[rank].clone().requires_grad_(True)
        logprobs_N = vocab_parallel_logprobs(
            hidden_NH,
            local_VH,
            targets[rank],
            shape=targets[rank].shape,
            vocab_start=start,
            chunk_tokens=CHUNK,
            group=dist.group.WORLD,
            transform=TRANSFORMS[transform],
        )
        (logprobs_N * grads[rank]).sum().backward()
        table_VH = weight_VH[start : start + rows[rank]].clone().requires_grad_(True)
        embedded_NH = vocab_parallel_embedding(
            targets[rank],
            table_VH,
            vocab_start=start,
            padding_idx=PADDING,
            dtype=torch.float32,
            group=dist.group.WORLD,
        )
        (embedded_NH * embedding_grads[rank]).sum().backward()
        torch.save(
            {
                "logprobs": logprobs_N.detach(),
                "hidden": hidden_NH.grad,
                "weight": local_VH.grad,
                "start": start,
                "embedded": embedded_NH.detach(),
                "table": table_VH.grad,
            },
            f"{out}/{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("tokens", [[5, 9], [6, 0, 11]], ids=["2-ranks", "3-ranks-one-empty"])
def test_each_ranks_vocabulary_slice_gives_one_processs_logprobs_embeddings_and_gradients(
    tmp_path, tokens, transform
):
    world = len(tokens)
    mp.start_processes(
        _rank,
        args=(world, free_port(), tokens, str(tmp_path), transform),
        nprocs=world,
        start_method="spawn",
    )
    weight_VH, hidden, targets, grads, embedding_grads = _case(tokens)
    weight_VH.requires_grad_(True)
    whole = torch.cat(hidden).requires_grad_(True)
    logits = whole @ weight_VH.T
    expected = torch.log_softmax(logits if transform == "bare" else _softcap(logits), dim=-1)
    expected = expected.gather(-1, torch.cat(targets)[:, None]).squeeze(-1)
    (expected * torch.cat(grads)).sum().backward()
    results = [torch.load(tmp_path / f"{rank}.pt") for rank in range(world)]

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.shape == want.shape
        assert (got - want).norm() <= REL * want.norm() + 1e-7, (got - want).abs().max()

    close(torch.cat([r["logprobs"] for r in results]), expected.detach())
    close(torch.cat([r["hidden"] for r in results]), whole.grad)
    # Each rank's gradient is its own rows of the full gradient: together, the whole of it.
    assert [r["start"] for r in results] == sorted(r["start"] for r in results)
    close(torch.cat([r["weight"] for r in results]), weight_VH.grad)

    embedding = torch.nn.Embedding(VOCAB, HIDDEN, padding_idx=PADDING)
    with torch.no_grad():
        embedding.weight.copy_(weight_VH)
    ids = torch.cat(targets)
    assert (ids == PADDING).any()  # the padding row is looked up, and takes no gradient
    embedded = embedding(ids)
    (embedded * torch.cat(embedding_grads)).sum().backward()
    assert torch.equal(torch.cat([r["embedded"] for r in results]), embedded.detach())
    close(torch.cat([r["table"] for r in results]), embedding.weight.grad)
