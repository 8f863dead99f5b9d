"""Log-probabilities of target tokens under an output head whose rows (the vocabulary) are sharded
over a trainer group, and the input embedding likewise (vocab_parallel_embedding, at the end),
each rank computing with its own FSDP2 slice where it lies: the head is never gathered (the
vocabulary-parallel cross-entropy of Megatron-LM; torchtitan's loss parallel does the same with
DTensor for tensor parallelism).

Each rank takes the union of the group's tokens of one bucket (hidden states and targets
all-gathered: [U, H], small beside the head's [V, H]) and computes the logits of its
vocabulary slice for all of them, in chunks of `chunk_tokens`. The log-softmax is assembled
from per-token values reduced over the ranks: the maximum, the sum of exponentials, and the
target's logit (from the one rank whose slice holds it). The backward recomputes each chunk's
logits (as the checkpointed head of one process does) and forms

- the slice's gradient locally: the sum over the union's tokens of g (onehot - softmax) times
  the hidden state, which is exactly this rank's slice of the full gradient (no reduce-scatter);
- the hidden states' gradient as a partial sum over the slice, all-reduced once.

Against gathering the head as FSDP2 gathers a unit: no [V, H] weight or gradient in full on any
rank (the largest matrix of most models), and per bucket collectives of [U, H] and [U] values
instead of an all-gather and a reduce-scatter of [V, H]. Every rank must call it the same
number of times (the trainer's aligned bucket schedule pads buckets), and the chunks are taken
over the union, so the ranks' collectives meet. Logprob math is float32 whatever the weights'
dtype, as in train/logprobs.py.

The input embedding is the same slicing read the other way: each rank looks up the group's ids
in its rows, zeros elsewhere, and an all-reduce of [U, H] sums them exactly; the backward adds
the group's output gradients into its own rows. So neither end of the model is gathered.

Legend: N = this rank's tokens, U = the group's tokens, C = tokens of a chunk, V = this rank's
vocabulary rows, H = hidden size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


def vocab_parallel_logprobs(
    hidden_NH: Tensor,
    weight_VH: Tensor,
    targets_N: Tensor,
    *,
    shape: torch.Size,
    vocab_start: int,
    chunk_tokens: int,
    group: dist.ProcessGroup | None,
    transform: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """float32 logprob of targets_N[n] at hidden_NH[n] under the full head, of which
    `weight_VH` (differentiable: its gradient is this rank's slice of the head's) holds rows
    vocab_start .. vocab_start + V - 1, laid out in `shape` (not a view: FSDP2's root hooks
    its output, and a view would lose the hook to an in-place op). `transform`: the family's
    logit post-processing (model/logit_head.py: scaling, soft-capping), elementwise, so it
    applies to each slice's logits alike. A collective over `group`."""
    # Function.apply is unannotated in torch; it returns what forward returns.
    logprobs = _VocabParallelLogprobs.apply(  # type: ignore[no-untyped-call]
        hidden_NH, weight_VH, targets_N, shape, vocab_start, chunk_tokens, group, transform
    )
    return cast(Tensor, logprobs)


def _logits(
    hidden_CH: Tensor, weight_VH: Tensor, transform: Callable[[Tensor], Tensor] | None
) -> Tensor:
    """float32 [C, V] logits of a slice, post-processed as the family's head does, in the
    order model/logit_head.py's TransformedHead applies it (then the float32 cast, as
    train/logprobs.py's log-softmax)."""
    logits_CV = F.linear(hidden_CH, weight_VH)
    return (logits_CV if transform is None else transform(logits_CV)).float()


def _counts(rows_N: Tensor, group: dist.ProcessGroup | None) -> list[int]:
    """Every rank's number of rows (tokens) in this call, rank 0's first."""
    count = torch.tensor([rows_N.shape[0]], dtype=torch.int64, device=rows_N.device)
    counts = [torch.empty_like(count) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, count, group=group)
    return [int(c) for c in counts]


def _all_rows(tensor_N: Tensor, counts: list[int], group: dist.ProcessGroup | None) -> Tensor:
    """Every rank's rows, rank 0's first (each padded to the most rows for gloo's all-gather,
    then trimmed)."""
    most = max(counts)
    padded = tensor_N.new_zeros((most, *tensor_N.shape[1:]))
    padded[: tensor_N.shape[0]] = tensor_N
    pieces = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([piece[:count] for piece, count in zip(pieces, counts, strict=True)])


def _local_targets(targets_U: Tensor, start: int, rows: int) -> tuple[Tensor, Tensor]:
    """Each target's column in this slice (0 where outside it) and whether it is inside."""
    local_U = targets_U - start
    inside_U = (local_U >= 0) & (local_U < rows)
    return torch.where(inside_U, local_U, 0), inside_U


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden_NH: Tensor,
        weight_VH: Tensor,
        targets_N: Tensor,
        shape: torch.Size,
        vocab_start: int,
        chunk_tokens: int,
        group: dist.ProcessGroup | None,
        transform: Callable[[Tensor], Tensor] | None,
    ) -> Tensor:
        rank, counts = dist.get_rank(group), _counts(hidden_NH, group)
        hidden_UH = _all_rows(hidden_NH.detach(), counts, group)
        targets_U = _all_rows(targets_N.to(torch.int64), counts, group)
        columns_U, inside_U = _local_targets(targets_U, vocab_start, weight_VH.shape[0])
        weight = weight_VH.detach().to(hidden_UH.dtype)
        lse_U = torch.empty(targets_U.shape, dtype=torch.float32, device=hidden_UH.device)
        target_U = torch.empty_like(lse_U)
        for start in range(0, hidden_UH.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, hidden_UH.shape[0])
            logits_CV = _logits(hidden_UH[start:end], weight, transform)
            most_C = logits_CV.max(dim=-1).values
            dist.all_reduce(most_C, op=dist.ReduceOp.MAX, group=group)
            picked_C = logits_CV.gather(-1, columns_U[start:end, None]).squeeze(-1)
            logits_CV.sub_(most_C[:, None]).exp_()
            sums_2C = torch.stack(
                [logits_CV.sum(dim=-1), torch.where(inside_U[start:end], picked_C, 0.0)]
            )
            dist.all_reduce(sums_2C, group=group)
            lse_U[start:end] = most_C + sums_2C[0].log()
            target_U[start:end] = sums_2C[1]
        ctx.save_for_backward(hidden_UH, weight_VH, columns_U, inside_U, lse_U)
        ctx.counts, ctx.rank, ctx.chunk_tokens, ctx.group = counts, rank, chunk_tokens, group
        ctx.transform = transform
        mine, end = sum(counts[:rank]), sum(counts[: rank + 1])
        logprobs = torch.empty(shape, dtype=torch.float32, device=hidden_UH.device)
        torch.sub(target_U[mine:end], lse_U[mine:end], out=logprobs.view(-1))
        return logprobs

    @staticmethod
    def backward(ctx: Any, grad_N: Tensor) -> tuple[Tensor | None, ...]:
        hidden_UH, weight_VH, columns_U, inside_U, lse_U = ctx.saved_tensors
        counts, rank, group = ctx.counts, ctx.rank, ctx.group
        grad_U = _all_rows(grad_N.reshape(-1).float().contiguous(), counts, group)
        weight = weight_VH.detach().to(hidden_UH.dtype)
        grad_weight_VH = torch.zeros_like(weight_VH, dtype=torch.float32)
        grad_hidden_UH = torch.zeros(hidden_UH.shape, dtype=torch.float32, device=hidden_UH.device)
        rows_C = torch.arange(min(ctx.chunk_tokens, hidden_UH.shape[0]), device=hidden_UH.device)
        for start in range(0, hidden_UH.shape[0], ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, hidden_UH.shape[0])
            hidden_CH, g_C = hidden_UH[start:end], grad_U[start:end]
            with torch.enable_grad():  # the chunk recomputed, for the projection's backward
                weight_leaf = weight.detach().requires_grad_(True)
                hidden_leaf = hidden_CH.detach().requires_grad_(True)
                logits_CV = _logits(hidden_leaf, weight_leaf, ctx.transform)
            # d logprob / d logits = onehot(target) - softmax, times g: formed in the logits'
            # own storage (no backward reads the projection's or a scaling's output).
            grad_CV = logits_CV.detach().sub_(lse_U[start:end, None]).exp_().mul_(-g_C[:, None])
            rows = rows_C[: end - start]
            inside = inside_U[start:end]
            grad_CV[rows[inside], columns_U[start:end][inside]] += g_C[inside]
            grad_w, grad_h = torch.autograd.grad(logits_CV, (weight_leaf, hidden_leaf), grad_CV)
            grad_weight_VH += grad_w.float()
            grad_hidden_UH[start:end] = grad_h.float()
        dist.all_reduce(grad_hidden_UH, group=group)
        mine = sum(counts[:rank])
        grad_hidden_NH = grad_hidden_UH[mine : mine + counts[rank]].to(hidden_UH.dtype)
        grad_weight_VH = grad_weight_VH.to(weight_VH.dtype)
        return grad_hidden_NH, grad_weight_VH, None, None, None, None, None, None


def vocab_parallel_embedding(
    ids_N: Tensor,
    weight_VH: Tensor,
    *,
    vocab_start: int,
    padding_idx: int | None,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None,
) -> Tensor:
    """[N, H] in `dtype`: the embedding rows of ids_N, of which `weight_VH` (differentiable: its
    gradient is this rank's slice of the embedding's) holds rows vocab_start .. + V - 1. Each
    rank looks up the group's ids that fall in its rows (zeros elsewhere) and one all-reduce
    sums them, exactly (one non-zero term per value); the backward adds the group's output
    gradients into this rank's rows, none into `padding_idx` (as nn.Embedding). A collective
    over `group`."""
    # Function.apply is unannotated in torch; it returns what forward returns.
    embedded = _VocabParallelEmbedding.apply(  # type: ignore[no-untyped-call]
        ids_N, weight_VH, vocab_start, padding_idx, dtype, group
    )
    return cast(Tensor, embedded)


class _VocabParallelEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        ids_N: Tensor,
        weight_VH: Tensor,
        vocab_start: int,
        padding_idx: int | None,
        dtype: torch.dtype,
        group: dist.ProcessGroup | None,
    ) -> Tensor:
        rank, counts = dist.get_rank(group), _counts(ids_N, group)
        ids_U = _all_rows(ids_N.to(torch.int64), counts, group)
        rows_U, inside_U = _local_targets(ids_U, vocab_start, weight_VH.shape[0])
        found_UH = weight_VH.detach()[rows_U].to(dtype)
        embedded_UH = torch.where(inside_U[:, None], found_UH, 0.0)
        dist.all_reduce(embedded_UH, group=group)
        if padding_idx is not None:
            inside_U &= ids_U != padding_idx
        ctx.save_for_backward(rows_U, inside_U)
        ctx.counts, ctx.rank, ctx.group, ctx.shape = counts, rank, group, weight_VH.shape
        ctx.weight_dtype = weight_VH.dtype
        mine, end = sum(counts[:rank]), sum(counts[: rank + 1])
        return embedded_UH[mine:end].clone()  # this rank's rows, not a view of the union's

    @staticmethod
    def backward(ctx: Any, grad_NH: Tensor) -> tuple[Tensor | None, ...]:
        rows_U, inside_U = ctx.saved_tensors
        grad_UH = _all_rows(grad_NH.float().contiguous(), ctx.counts, ctx.group)
        grad_weight_VH = grad_UH.new_zeros(ctx.shape)
        grad_weight_VH.index_add_(0, rows_U[inside_U], grad_UH[inside_U])
        return None, grad_weight_VH.to(ctx.weight_dtype), None, None, None, None
