"""A full-weight session's model sharded over its resource's trainer group with PyTorch's FSDP2
(`fully_shard`; `posttrain serve --trainer-ranks N`).

Units: each decoder layer, an untied input embedding, an untied head, then the root (a wrapper
around the whole model: the final norm, and a tied embedding, which is also the head). Every
parameter becomes a DTensor sharded on dim 0 (even 1/N slices, padded), so each rank holds 1/N
of every matrix, of its gradient and of its AdamW moments and Muon momentum. A layer unit is
all-gathered before its forward and again for its backward, and its gradients are reduce-
scattered (summed: the divide factor is 1, as the losses' own normalisers already are batch-
global) as the backward leaves it; the root stays gathered from its first forward of an
operation to the end of the operation's backward (FSDP2's root rule), and `operation` reshards
everything when the operation ends. With `--shard-parameters off` the layers keep their weights
gathered from forward to backward (reshard_after_forward False). An untied head and a plain
untied embedding are sharded as units but never gathered: their dim-0 slices are vocabulary
rows, so each rank computes the logprobs and looks up the embeddings with its rows where they
lie (parallel/vocab_parallel.py): no rank holds the model's two largest matrices or their
gradients in full, and their gradients need no reduce-scatter. An embedding of a subclass is
gathered as a layer, but not again for its backward, which never reads it.

The trainer never calls the model's own forward: it runs the decoder and then the chunked head
itself (train/trainer.py). So the root wrapper's forward takes the bucket's computation as a
function and calls it: FSDP2's root hooks then run around exactly what one bucket does, and
its pre-backward hook sits on the bucket's logprobs. Every rank runs the same number of bucket
forwards (trainer.aligned_forwards pads the rest), so they meet in the same collectives.

On CUDA a MixedPrecisionPolicy computes in bfloat16 and reduces gradients in float32; the
logprob and loss math are float32 in the trainer whatever the weights' dtype.

The parameters' names do not change (FSDP2 registers its DTensors under the same names), but
the Parameter objects do: the optimizer is built on `named` after sharding. There is no way
back to plain parameters, so the session's end discards the sharded model and the resource
reloads its base weights from the model directory (hosts/full_weight_sessions.py). The model is
sharded in place rather than built on the meta device and filled from rank 0
(set_model_state_dict's broadcast_from_rank0): every rank already holds the resource's
loaded base model, which LoRA sessions share, so a fresh copy would only add a peak.

Checkpoints, exports, persisted state and weights-sync stream full tensors one at a time
(`full_tensors`: each parameter's slices gathered onto rank 0, which writes), so files keep the
one-process formats and a checkpoint from any N resumes on any other (`shard_of` cuts each
rank's slice out of a full tensor every rank read). Gathered per tensor rather than with
get_model_state_dict / get_optimizer_state_dict (full_state_dict, cpu_offload), which hold the
whole state on rank 0's CPU at once: the same values, a smaller peak.

Imports: torch (torch.distributed, fsdp, tensor); engine.parallel.data_parallel and
vocab_parallel; model.lora.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import PreTrainedModel

from posttrain.engine.parallel.data_parallel import DataParallel
from posttrain.engine.parallel.vocab_parallel import (
    vocab_parallel_embedding,
    vocab_parallel_logprobs,
)
from posttrain.model.logit_head import logit_transform
from posttrain.model.lora import LoraLinear

# A nest of dicts with tensors (and plain values) at its leaves: optimizer state, gradients.
NestT = TypeVar("NestT", bound=dict[str, Any])


def local(tensor: Tensor) -> Tensor:
    """This rank's part of a (possibly sharded) tensor: a DTensor's local shard, else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def row_counts(rows: int, world: int) -> list[int]:
    """How many of `rows` each of `world` ranks holds of a tensor sharded on dim 0: torch.chunk's
    split, as FSDP2's, empty slices at the end (ranks past the last chunk hold none)."""
    counts = [len(chunk) for chunk in torch.arange(rows).chunk(world)]
    return counts + [0] * (world - len(counts))


def _plain_embedding(module: nn.Module) -> nn.Embedding | None:
    """`module` if it is a plain lookup of rows (an nn.Embedding itself, without max_norm,
    frequency scaling or sparse gradients), which each rank can do with its own rows; None for
    a subclass (which may scale or otherwise change the lookup) or any other module."""
    if type(module) is not nn.Embedding:
        return None
    is_plain = module.max_norm is None and not module.scale_grad_by_freq and not module.sparse
    return module if is_plain else None


class _Operation(nn.Module):
    """The FSDP2 root: its forward runs the function it is given (one bucket's forward)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, run: Callable[[], Tensor]) -> Tensor:
        return run()


class FsdpShards:
    """One full-weight session's FSDP2-sharded model on this rank, and its collectives."""

    def __init__(
        self,
        group: DataParallel,
        model: PreTrainedModel,
        named: Sequence[tuple[str, nn.Parameter]],
        device: torch.device,
        *,
        reshard_after_forward: bool = True,
    ) -> None:
        """Shard `model` in place; `named`: its trainable parameters by Hugging Face name
        (train/full_weight.trainable_parameters), in that order. Afterwards `self.named`
        holds the sharded parameters under the same names. `reshard_after_forward` False
        (`--shard-parameters off`): each layer stays gathered from its forward to its
        backward, one all-gather per layer and bucket fewer for every layer's weights at the
        peak."""
        self.group = group
        self.device = device
        self.mesh = init_device_mesh(device.type, (group.world,))
        policy = MixedPrecisionPolicy()
        if device.type == "cuda":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        old_names = {id(p): name for name, p in named}
        module_names = {name: old_names[id(p)] for name, p in model.named_parameters()}
        layers: list[nn.Module] = list(cast(nn.ModuleList, model.base_model.layers))
        embedding = model.get_input_embeddings()
        # transformers leaves get_output_embeddings unannotated.
        head: nn.Module | None = model.get_output_embeddings()  # type: ignore[no-untyped-call]
        head_params = {id(p) for p in head.parameters()} if head is not None else set()
        embedding_weight = embedding.get_parameter("weight")
        untied = id(embedding_weight) not in head_params  # the head may be a LoRA wrapper
        # An untied head and a plain untied embedding are units whose forward is never called
        # (it would gather the model's two largest matrices): each rank computes with its
        # vocabulary rows where they lie (head_logprobs, embedding_inputs). An embedding of a
        # subclass (which may scale or otherwise change the lookup) is gathered as a unit of
        # its own, once per bucket forward (alike on every rank). A tied head is the
        # embedding, used at both ends of the forward: it stays in the root, gathered.
        plain = _plain_embedding(embedding)
        self._embedding = plain if untied else None
        self._head = head if untied else None
        self._compute_dtype = policy.param_dtype or embedding_weight.dtype
        self._transform = logit_transform(model.config)  # applied to each slice's logits
        if untied and self._embedding is None:
            layers.append(embedding)
        kept = [m for m in (self._embedding, self._head) if m is not None]
        self._layer_names = [[old_names[id(p)] for p in unit.parameters()] for unit in layers]
        unit_names = [
            *self._layer_names,
            *([old_names[id(p)] for p in m.parameters()] for m in kept),
        ]
        self.root = _Operation(model)
        old = [p for _, p in named]
        self.units: list[FSDPModule] = []
        for layer in layers:
            self.units.append(
                fully_shard(
                    layer,
                    mesh=self.mesh,
                    mp_policy=policy,
                    reshard_after_forward=reshard_after_forward,
                )
            )
        if untied and self._embedding is None:
            # The embedding's backward is a scatter of its output gradient into rows: it never
            # reads the weight, so the backward skips gathering it.
            self.units[-1].set_unshard_in_backward(False)
        for module in kept:
            self.units.append(fully_shard(module, mesh=self.mesh, mp_policy=policy))
        self.units.append(fully_shard(self.root, mesh=self.mesh, mp_policy=policy))
        for unit in self.units:
            # A plain sum, as one process's backward is: divide by 1, with SUM collectives
            # (the default picks NCCL's PREMUL_SUM for a factor, which gloo lacks).
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
            if device.type == "cpu":  # gloo
                unit.set_custom_all_gather(_AllReduceAllGather())
                unit.set_custom_reduce_scatter(_AllReduceReduceScatter())
        by_name = dict(model.named_parameters())
        sharded = {hf: by_name[name] for name, hf in module_names.items()}
        self.named: list[tuple[str, nn.Parameter]] = [(name, sharded[name]) for name, _ in named]
        with torch.no_grad():  # the replaced full tensors may still be referenced elsewhere
            for p in old:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        in_units = {name for names in unit_names for name in names}
        self._root_names = [name for name, _ in self.named if name not in in_units]
        # Each gradient is reduce-scattered by the backward itself
        # (data_parallel.all_reduce_gradients is never asked to sum them).
        self.reduced_in_backward = frozenset(id(p) for _, p in self.named)

    # ------------------------------------------------------------ operations

    def forward(self, run: Callable[[], Tensor]) -> Tensor:
        """`run()` (one bucket's forward) inside the FSDP2 root's forward."""
        output: Tensor = self.root(run)  # through nn.Module.__call__, which runs FSDP2's hooks
        return output

    def embedding_inputs(self, ids: Tensor) -> dict[str, Tensor]:
        """The decoder's inputs for token ids [B, L]: their embeddings looked up on each rank's
        rows of a plain untied embedding (parallel/vocab_parallel.py; a collective, run once
        per bucket on every rank), else the ids for the model's own (gathered) lookup."""
        if self._embedding is None:
            return {"input_ids": ids}
        embedded = vocab_parallel_embedding(
            ids.reshape(-1),
            local(self._embedding.weight),
            vocab_start=self._first_row(self._embedding.weight),
            padding_idx=self._embedding.padding_idx,
            dtype=self._compute_dtype,
            group=self.group.group,
        )
        return {"inputs_embeds": embedded.reshape(*ids.shape, -1)}

    def _first_row(self, weight: Tensor) -> int:
        """The first row of this rank's dim-0 slice."""
        return sum(row_counts(weight.shape[0], self.group.world)[: self.group.rank])

    def head_logprobs(self, hidden: Tensor, targets: Tensor, chunk_tokens: int) -> Tensor | None:
        """float32 logprobs of `targets` ([..., T]) at `hidden` ([..., T, H]) from each rank's
        slice of an untied head (parallel/vocab_parallel.py; a collective, run once per bucket
        on every rank); None when the head is tied (computed in the root, gathered)."""
        if self._head is None:
            return None
        linear = self._head.base if isinstance(self._head, LoraLinear) else self._head
        weight = linear.get_parameter("weight")
        return vocab_parallel_logprobs(
            hidden.reshape(-1, hidden.shape[-1]),
            local(weight),
            targets.reshape(-1),
            shape=targets.shape,
            vocab_start=self._first_row(weight),
            chunk_tokens=chunk_tokens,
            group=self.group.group,
            transform=self._transform,
        )

    @contextmanager
    def operation(self) -> Iterator[None]:
        """A forward(-backward): every unit sharded again when it ends (also when it fails)."""
        try:
            yield
        finally:
            for unit in self.units:
                unit.reshard()

    def operation_bytes(self) -> int:
        """What a forward-backward adds on this rank beyond its own shards and their
        gradients: the root in full from its first forward to the end of the backward, with
        its full gradients until reduce-scattered, and in the backward the largest layer
        gathered with its full gradients of one forward, plus the next layer FSDP2 prefetches
        (its all-gather overlaps the current layer's backward). An untied head and a plain
        untied embedding are never gathered (head_logprobs, embedding_inputs)."""
        full = {name: p.numel() * p.element_size() for name, p in self.named}
        root = sum(full[name] for name in self._root_names)
        layer = max((sum(full[n] for n in names) for names in self._layer_names), default=0)
        return 2 * root + 3 * layer

    # ------------------------------------------------------------ collectives over the group

    def max(self, value: float, device: torch.device | None = None) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group.group)
        return float(tensor)

    def grad_norm(self, named: Sequence[tuple[str, nn.Parameter]]) -> tuple[Tensor, list[bool]]:
        """G of losses.md 12.1 over the sharded gradients: each parameter's norm from the sum
        of its shards' squares, then the 2-norm of those norms as optim.global_grad_norm takes
        it; and which parameters have a gradient (alike on every rank)."""
        squares = torch.zeros(len(named), dtype=torch.float64, device=self.device)
        present = torch.zeros(len(named), dtype=torch.float64, device=self.device)
        for index, (_, p) in enumerate(named):
            if p.grad is not None:
                norm = torch.linalg.vector_norm(local(p.grad), dtype=torch.float32)
                squares[index] = norm.to(torch.float64) ** 2
                present[index] = 1.0
        both = torch.stack([squares, present])
        dist.all_reduce(both, group=self.group.group)
        has = [v > 0 for v in both[1].tolist()]
        norms = both[0].sqrt().to(torch.float32)[torch.tensor(has, device=self.device)]
        total_norm: Tensor = torch.linalg.vector_norm(norms)
        return total_norm, has

    @torch.no_grad()
    def shard_of(self, full: Tensor, like: Tensor) -> Tensor:
        """This rank's DTensor slice of `full` (every rank holds it whole), laid out as
        `like` (a sharded parameter); no communication."""
        if not isinstance(like, DTensor):
            return full.to(like.device)
        return distribute_tensor(
            full.to(device=self.device, dtype=full.dtype),
            like.device_mesh,
            like.placements,
            src_data_rank=None,
        )

    def full_tensors(self) -> Iterator[tuple[str, Tensor | None]]:
        """Every parameter in full on rank 0, one at a time (None on the other ranks; a
        collective): rank 0, which writes, never holds more than one in full."""
        for name, p in self.named:
            yield name, self.on_rank_zero(p)

    @torch.no_grad()
    def on_rank_zero(self, tensor: Tensor) -> Tensor | None:
        """A sharded tensor in full on rank 0, its slices gathered there (each crosses the
        network once; full_tensor() would all-gather it onto every rank); None elsewhere. A
        plain tensor as it is."""
        if not isinstance(tensor, DTensor):
            return tensor.detach()
        counts = row_counts(tensor.shape[0], self.group.world)
        piece = tensor.to_local()
        padded = piece.new_zeros((counts[0], *tensor.shape[1:]))
        padded[: piece.shape[0]] = piece
        keep = self.group.rank == 0
        pieces = [torch.empty_like(padded) for _ in counts] if keep else None
        dist.gather(padded, pieces, dst=0, group=self.group.group)
        if pieces is None:
            return None
        return torch.cat([p[:c] for p, c in zip(pieces, counts, strict=True)])

    def gather_to_rank_zero(self, tensors: NestT) -> NestT | None:
        """A nest of sharded tensors in full on the CPU of rank 0, one tensor at a time (None
        elsewhere). A collective: every rank's nest has the same keys in the same order."""
        keep = self.group.rank == 0

        def walk(value: Any) -> Any:
            if isinstance(value, dict):
                return {key: walk(v) for key, v in value.items()}
            if isinstance(value, Tensor):
                full = self.on_rank_zero(value)
                return full.to("cpu") if keep and full is not None else None
            return value

        merged = cast(NestT, walk(tensors))  # the same nest, each tensor in full on the CPU
        return merged if keep else None

    @torch.no_grad()
    def copy_into(self, saved: dict[str, Tensor]) -> None:
        """Every parameter takes its slice of the full tensor `saved[name]`."""
        for name, p in self.named:
            local(p).copy_(local(self.shard_of(saved[name].to(p.dtype), p)))

    @torch.no_grad()
    def publish(self, trainer: nn.Module, generator: nn.Module | None) -> None:
        """weights-sync into rank 0's generator copy (`generator`; None on the other ranks):
        each parameter gathered there and copied, one at a time. A collective."""
        targets = dict(generator.named_parameters()) if generator is not None else {}
        for name, source in trainer.named_parameters():
            full = self.on_rank_zero(source)
            if generator is not None:
                assert full is not None, "rank 0, which holds the generator copy, gathers"
                targets[name].copy_(full)


# gloo's all_gather_into_tensor and reduce_scatter_tensor took 0.13 and 0.15 s for 50 MB over
# 2 ranks on the 2-core machine, its all_reduce 0.035 s (docs/benchmarks.md, "Trainer ranks"),
# so on gloo FSDP2's two collectives run as all-reduces of the same buffers (FSDP2's
# set_custom_all_gather / set_custom_reduce_scatter).


class _AllReduceAllGather(AllGather):
    """An all-gather as one all-reduce of the output's bits (as integers): each rank's slice
    in its place, zeros elsewhere, so every word has one non-zero contributor and the sum is
    that word exactly."""

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        rank, size = dist.get_rank(group), input_tensor.numel()
        out = output_tensor.view(-1)
        own = out.narrow(0, rank * size, size)
        if own.data_ptr() != input_tensor.data_ptr():  # FSDP2 usually copies it in place
            own.copy_(input_tensor.view(-1))
        out[: rank * size].zero_()
        out[(rank + 1) * size :].zero_()
        words = out.view(torch.int32) if out.nbytes % 4 == 0 else out.view(torch.uint8)
        work: dist.Work | None = dist.all_reduce(words, group=group, async_op=async_op)
        return work


class _AllReduceReduceScatter(ReduceScatter):
    """A reduce-scatter as an all-reduce of the (temporary) input, then this rank's slice."""

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> None:
        dist.all_reduce(input_tensor, op=op, group=group)
        size = output_tensor.numel()
        start = dist.get_rank(group) * size
        output_tensor.view(-1).copy_(input_tensor.view(-1).narrow(0, start, size))
