"""A full-weight session's parameters sharded over its trainer group (ZeRO-3,
`posttrain serve --trainer-ranks N`, N > 1; `--shard-parameters off` turns it off).

Each parameter lives whole on its owner rank (parallel/zero2.py's map, balanced by bytes) and
nowhere else between operations: on the other ranks its tensor keeps its shape but its storage
is resized to 0 bytes. Whole parameters, not flat 1/N slices, because the owner already holds
the whole parameter's gradient and optimizer state (ZeRO-2), so torch's AdamW and the Muon loop
(which orthogonalises whole matrices) step it unchanged and checkpoints keep their formats; the
price is balance to within one parameter instead of one element. Own hooks rather than FSDP2's
`fully_shard` for the same reasons: its Shard(0) DTensors would give every rank slices of every
matrix (Muon would gather each one per step), change the parameters the optimizer, the
checkpoints and the generator copy read, and it has no way back to plain parameters when the
session ends.

The model is cut into units: each decoder layer, and the root (everything else: embeddings,
final norm, head; tied weights once). An operation (a forward-backward or a forward) gathers
the root on entry and frees it on exit. A layer is gathered just before each of its forwards
(one flat broadcast per owner and dtype), freed right after, gathered again when the backward
reaches its output, and freed when the backward reaches its input, so a rank never holds more
than the root and one layer of others' weights. Keeping the layers gathered from forward to
backward would save one broadcast per layer and bucket but hold every layer's weights at the
peak, which is what sharding them is for. When the backward leaves a layer its gradients of
that forward are summed onto their owners (dist.reduce; gloo's reduce_scatter works in torch
2.13 but slices flat buffers, which whole-parameter ownership does not need) and dropped
elsewhere; the root's are summed onto their owners after the backward, as ZeRO-2 does. Refills
go through `.data`, so they do not bump the version counters autograd checks.

The collectives are per layer call, so every rank must call the layers the same number of
times in the same order: the trainer pads a rank with fewer length buckets (or no rows) with
forwards whose logprobs enter times 0 (trainer.aligned_forwards), and torch's autograd engine
runs the backward of the last-created bucket first, layer by layer, alike on every rank.

The generator's copy lives on rank 0 alone (sampling runs there: trainer_group.RANK_ZERO);
weights-sync sends each parameter from its owner into it. Checkpoints, exports and persisted
state gather the full tensors one at a time onto rank 0, which writes the one-process formats;
loading copies each rank's own. When the session ends every rank gathers the whole model again
and the hooks go (engine/train/full_weight.restore_base then puts the base weights back).

Imports: torch (torch.distributed); engine.parallel.zero2.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from posttrain.engine.parallel.zero2 import Sharding


class ParamShards:
    """Which parameters this rank holds, and the hooks that gather and free the others."""

    def __init__(
        self, sharding: Sharding, model: nn.Module, named: Sequence[tuple[str, nn.Parameter]]
    ) -> None:
        self.sharding = sharding
        self.named = list(named)
        by_id = {id(p): (name, p) for name, p in named}
        layers = list(model.base_model.layers)
        self.layers: list[list[tuple[str, nn.Parameter]]] = []
        in_layers: set[int] = set()
        for layer in layers:
            unit = [by_id[id(p)] for p in layer.parameters() if id(p) in by_id]
            self.layers.append(unit)
            in_layers.update(id(p) for _, p in unit)
        self.root = [(n, p) for n, p in named if id(p) not in in_layers]
        # Parameters whose gradients the layer hooks sum onto their owners in the backward.
        self.reduced_in_backward = frozenset(in_layers)
        self._handles: list[Any] = []
        for index, layer in enumerate(layers):
            self._handles.append(
                layer.register_forward_pre_hook(self._pre_forward(index), with_kwargs=True)
            )
            self._handles.append(layer.register_forward_hook(self._post_forward(index)))
        with torch.no_grad():
            for name, p in named:
                if not sharding.owns(name):
                    # A fresh resizable storage (the loaded one may be a file mapping), freed.
                    empty = torch.empty_like(p)
                    empty.untyped_storage().resize_(0)
                    p.data = empty

    # ------------------------------------------------------------ operations

    @contextmanager
    def operation(self) -> Iterator[None]:
        """A forward(-backward) of the session: the root gathered throughout, every layer
        freed after (also when it fails midway)."""
        self._gather(self.root)
        try:
            yield
        finally:
            self._free(self.named)

    def operation_bytes(self) -> int:
        """What a forward-backward adds on this rank beyond its own parameters and their
        gradients (which the memory estimate counts): the root's other parameters, gathered
        throughout, its full gradients until summed onto their owners, and the largest layer
        gathered with its gradients of one forward."""

        def size(unit: Sequence[tuple[str, nn.Parameter]]) -> int:
            return sum(p.numel() * p.element_size() for _, p in unit)

        others = [(n, p) for n, p in self.root if not self.sharding.owns(n)]
        return size(others) + size(self.root) + 2 * max(map(size, self.layers), default=0)

    def owned(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named if self.sharding.owns(n)]

    @torch.no_grad()
    def full_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every parameter in full, one at a time, on every rank (a collective; the owner's
        own tensor, a fresh copy elsewhere): a caller that keeps only some (a checkpoint on
        rank 0) never holds the others."""
        for name, p in self.named:
            owner = self.sharding.owners[name]
            full = p.detach() if owner == self.sharding.group.rank else torch.empty_like(p)
            dist.broadcast(full, src=owner, group=self.sharding.group.group)
            yield name, full

    @torch.no_grad()
    def publish(self, trainer: nn.Module, generator: nn.Module | None) -> None:
        """weights-sync (full_weight.publish) from the shards into rank 0's generator copy
        (`generator`, None on the other ranks): each parameter sent by its owner straight into
        the copy's parameter, one at a time. A collective."""
        names = {id(p): name for name, p in self.named}
        rank = self.sharding.group.rank
        group = self.sharding.group.group
        targets = dict(generator.named_parameters()) if generator is not None else {}
        for name, source in trainer.named_parameters():
            owner = self.sharding.owners[names[id(source)]]
            if rank == 0:
                if owner == 0:
                    targets[name].copy_(source)
                else:
                    dist.recv(targets[name], src=owner, group=group)
            elif owner == rank:
                dist.send(source.detach(), dst=0, group=group)

    def unshard(self) -> None:
        """Every rank holds every parameter again, and the hooks are gone (session end)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._gather(self.named)

    # ------------------------------------------------------------ hooks

    def _pre_forward(self, index: int):
        def after() -> None:
            self._after_layer_backward(index)

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            self._gather(self.layers[index])
            if not torch.is_grad_enabled():
                return args, kwargs
            # The backward reaching the layer's input means its own backward is done.
            if args and isinstance(args[0], Tensor) and args[0].requires_grad:
                args = (_OnBackward.apply(args[0], after), *args[1:])
            elif isinstance(kwargs.get("hidden_states"), Tensor):
                hidden = kwargs["hidden_states"]
                if hidden.requires_grad:
                    kwargs = {**kwargs, "hidden_states": _OnBackward.apply(hidden, after)}
            return args, kwargs

        return hook

    def _post_forward(self, index: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            self._free(self.layers[index])
            if not torch.is_grad_enabled():
                return output
            # Without the hook on its output the backward would find the layer freed.
            if not isinstance(output, Tensor):
                raise TypeError(f"decoder layer {index} returned {type(output).__name__}")
            if output.requires_grad:
                return _OnBackward.apply(output, lambda: self._gather(self.layers[index]))
            return output

        return hook

    def _after_layer_backward(self, index: int) -> None:
        """Sum this layer's gradients of one forward onto their owners, then free it."""
        unit = self.layers[index]
        for p in [p for _, p in unit]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        owners = [self.sharding.owners[n] for n, _ in unit]
        buckets: dict[tuple[int, torch.dtype], list[nn.Parameter]] = {}
        for (_, p), owner in zip(unit, owners, strict=True):
            buckets.setdefault((owner, p.grad.dtype), []).append(p)
        rank = self.sharding.group.rank
        for (owner, _), params in sorted(buckets.items(), key=lambda b: (b[0][0], str(b[0][1]))):
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.reduce(flat, dst=owner, group=self.sharding.group.group)
            if owner != rank:  # the owner holds the sum now
                for p in params:
                    p.grad = None
                continue
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self._free(unit)

    # ------------------------------------------------------------ gather and free

    @torch.no_grad()
    def _gather(self, unit: Sequence[tuple[str, nn.Parameter]]) -> None:
        """Every parameter of `unit` in full on every rank: one broadcast per owner and dtype.
        A collective: every rank gathers the same units in the same order."""
        rank = self.sharding.group.rank
        buckets: dict[tuple[int, torch.dtype], list[nn.Parameter]] = {}
        for name, p in unit:
            buckets.setdefault((self.sharding.owners[name], p.dtype), []).append(p)
        for (owner, _), params in sorted(buckets.items(), key=lambda b: (b[0][0], str(b[0][1]))):
            if owner == rank:
                flat = torch.cat([p.detach().reshape(-1) for p in params])
            else:
                size = sum(p.numel() for p in params)
                flat = torch.empty(size, dtype=params[0].dtype, device=params[0].device)
            dist.broadcast(flat, src=owner, group=self.sharding.group.group)
            if owner == rank:
                continue
            offset = 0
            for p in params:
                storage = p.untyped_storage()
                if storage.nbytes() == 0:
                    storage.resize_(p.numel() * p.element_size())
                # Through .data: the write must not bump the parameter's version counter, which
                # the forward's saved tensors check in the backward.
                p.data.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def _free(self, unit: Sequence[tuple[str, nn.Parameter]]) -> None:
        for name, p in unit:
            if not self.sharding.owns(name):
                p.untyped_storage().resize_(0)


class _OnBackward(torch.autograd.Function):
    """Identity whose backward first calls `then`. On a layer's output it gathers the layer for
    the layer's backward; on the layer's input it runs once the layer's backward is done."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, then: Callable[[], None]) -> Tensor:
        ctx.then = then
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        ctx.then()
        return grad, None
