"""Optimizer of one session: global-norm clipping, then AdamW or Muon (losses.md 11.3, 12).

One SessionOptimizer owns the optimizer state of one session's trainable parameters. Its family
is fixed when it is built: AdamW (12.2) for an Adam model resource, or Muon (12.3) with a nested
AdamW group for the parameters Muon does not own. Step hyperparameters come with each
optim-step; omitted fields take their defaults every step, never the previous step's values
(12.2, 13.18). The gradients are whatever forward-backward calls accumulated in `.grad` since the
last step (11.3).

It does not own the parameters (the model does), does not count steps (the session does: an
optim-step without gradients still increments it, 11.3) and never publishes weights
(weights-sync does). The Newton-Schulz and Muon update math lives in optim/muon.py.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from posttrain.engine.optim import adam_shards, muon_shards
from posttrain.engine.optim.muon import (
    is_muon_param,
    lr_scale,
    muon_update_,
    num_row_blocks,
)
from posttrain.engine.optim.step_settings import StepSettings, resolve_step_settings
from posttrain.engine.parallel.fsdp import FsdpShards, local
from posttrain.errors import InvalidRequest, NonFiniteLoss
from posttrain.types import AdamParams, MuonParams, MuonScaling, OptimStepRequest

# Added to the global norm before dividing, as torch.nn.utils.clip_grad_norm_ does (12.1).
CLIP_EPS = 1e-6

# state_dict() layout. Keyed by parameter name, so a checkpoint does not depend on the order
# of named_params; only tensors and numbers inside, so torch.save/torch.load(weights_only=True)
# round-trip it.
ADAM_STATE = "adam"  # {name: {"step": Tensor, "exp_avg": Tensor, "exp_avg_sq": Tensor}}
MUON_STATE = "muon"  # {name: {"momentum_buffer": Tensor}}
OptimizerState = dict[str, dict[str, dict[str, Tensor]]]


def global_grad_norm(grads: list[Tensor]) -> Tensor:
    """G of losses.md 12.1: the 2-norm over all gradients together, as a float32 scalar.

    Norms are taken in float32 so bfloat16 gradients do not lose the sum of squares.
    """
    device = grads[0].device
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32).to(device) for g in grads]
    total_norm: Tensor = torch.linalg.vector_norm(torch.stack(norms))
    return total_norm


# Far below float32's 3.4e38, so the rounding of the bound's own arithmetic never matters.
OVERFLOW_FREE_BOUND = 1e30


def clip_grads_(grads: list[Tensor], max_norm: float, total_norm: Tensor) -> None:
    """Scale every gradient in place by min(1, max_norm / (G + 1e-6)) (losses.md 12.1)."""
    coef = torch.clamp(max_norm / (total_norm + CLIP_EPS), max=1.0)
    for g in grads:
        local(g).mul_(coef.to(g.device))


class SessionOptimizer:
    """Clipping plus AdamW, or plus Muon and a nested AdamW, over named parameters.

    Args:
        named_params: the session's trainable parameters, as (name, parameter) pairs.
        muon_scaling: None for an AdamW model resource; a scaling strategy for a Muon one.
            Under Muon, parameters are split by muon.is_muon_param (12.3).

    Under AdamW, tensors with ndim >= 2 are decayed and 1-D ones are not (12.2). Parameters
    whose `.grad` is None at a step are untouched: no decay, no moment or momentum update.

    With a `sharding` (FSDP2, parallel/fsdp.py) the parameters, gradients and state are
    DTensors of which this rank holds a slice each: AdamW steps their local slices
    (optim/adam_shards.py), Muon orthogonalises whole matrices spread over the ranks
    (optim/muon_shards.py), clipping takes the exact global norm; a step is then a
    collective (every rank of the group calls it), as are full_state_dict and full_gradients.
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        *,
        muon_scaling: MuonScaling | None = None,
        sharding: FsdpShards | None = None,
    ) -> None:
        self.named_params = named_params
        self.muon_scaling = muon_scaling
        self.sharding = sharding
        is_muon = [
            muon_scaling is not None and is_muon_param(name, p.ndim) for name, p in named_params
        ]
        self._muon_named = [pair for pair, m in zip(named_params, is_muon, strict=True) if m]
        self._adam_named = [pair for pair, m in zip(named_params, is_muon, strict=True) if not m]
        self._momentum_buffers: dict[str, Tensor] = {}
        # Overflow bounds (_overflow_free): the largest weight magnitude and the largest
        # gradient norm a moment may hold; None until measured.
        self._weight_bound: float | None = None
        self._grad_bound = 0.0
        # torch.optim.AdamW is exactly 12.2's update; it refuses an empty parameter list, which a
        # Muon session training only LoRA factors of hidden layers has.
        self._adamw: torch.optim.AdamW | None = None
        decayed = [p for _, p in self._adam_named if p.ndim >= 2]
        undecayed = [p for _, p in self._adam_named if p.ndim < 2]
        groups = [{"params": decayed, "decay": True}, {"params": undecayed, "decay": False}]
        groups = [g for g in groups if g["params"]]
        if groups:
            # foreach=False: the single-tensor path on every device, the one the tests compare with.
            self._adamw = torch.optim.AdamW(groups, foreach=False)

    @property
    def muon_param_names(self) -> list[str]:
        """Names of the parameters Muon updates (empty under AdamW)."""
        return [name for name, _ in self._muon_named]

    def has_gradients(self) -> bool:
        """True if any parameter has an accumulated gradient since the last step."""
        return any(p.grad is not None for _, p in self.named_params)

    def step(self, request: OptimStepRequest) -> None:
        """Clip, update and zero the gradients (losses.md 11.3, 12).

        Without any accumulated gradient this is a no-op on parameters and state.

        Raises:
            InvalidRequest: the request carries the other optimizer family's parameters.
            NonFiniteLoss: the global gradient norm is NaN or infinite, or the step would make
                a weight or optimizer moment non-finite. Nothing is touched: parameters,
                optimizer state and the gradients stay as they were, so the caller decides
                whether to discard the accumulated gradients (zero_grad) or not.
        """
        settings = resolve_step_settings(request, self.muon_scaling)
        grads = [p.grad for _, p in self.named_params if p.grad is not None]
        if self.sharding is not None:  # every rank sees the same norm and takes the same path
            total_norm, has = self.sharding.grad_norm(self.named_params)
            if not any(has):
                return
        elif not grads:
            return
        else:
            total_norm = global_grad_norm(grads)
        if not math.isfinite(float(total_norm)):
            raise NonFiniteLoss("gradient norm is not finite; optim-step discarded")
        clip = settings.grad_clip_norm
        norm = min(float(total_norm), clip) if clip > 0 else float(total_norm)  # after clipping
        # A finite gradient can still overflow the weights (a learning rate of 1e308). When
        # the bounds below cannot rule that out, the step runs on a copy-backed path: if any
        # weight or moment then is non-finite, everything is put back from the copy.
        safe, weight_bound = self._overflow_free(settings, norm)
        if safe:
            if clip > 0:
                clip_grads_(grads, clip, total_norm)
            self._update(settings)
            self._weight_bound = weight_bound
            self._grad_bound = max(self._grad_bound, norm)
            self.zero_grad()
            return
        stepped = [
            (p, p.detach().clone(), p.grad.clone())
            for _, p in self.named_params
            if p.grad is not None
        ]
        before = self.state_dict()
        try:
            if clip > 0:
                clip_grads_(grads, clip, total_norm)
            self._update(settings)
            finite = self._all_finite([p for p, _, _ in stepped])
        except RuntimeError as exc:
            if "overflow" not in str(exc):  # torch refuses a step size past float's range
                self._put_back(stepped, before)
                raise
            finite = False
        if self.sharding is not None:
            (finite,) = self.sharding.group.all_true([finite], self.named_params[0][1].device)
        if not finite:
            self._put_back(stepped, before)
            raise NonFiniteLoss(
                "the step would make weights or optimizer state non-finite (learning rate too"
                " large?); weights, optimizer state and gradients are unchanged"
            )
        self._measure_bounds()
        self.zero_grad()

    def _update(self, settings: StepSettings) -> None:
        if settings.muon is not None:
            self._muon_step(settings.muon)
        if self._adamw is not None:
            self._adam_step(settings.adam)

    def _overflow_free(self, settings: StepSettings, grad_norm: float) -> tuple[bool, float]:
        """Whether this step provably leaves every weight and moment finite, and a bound on
        the weights' magnitude after it. From bounds kept across steps, no pass over the
        tensors: a moment is a convex combination of past gradients, so |m| <= G, the largest
        (clipped) gradient norm seen; an AdamW update is at most lr / (1 - beta1) * G / eps
        per entry (torch's bias corrections only shrink it); a Muon update at most
        lr * s(R, C) * 4 (Newton-Schulz output entries are under its spectral norm, about 1);
        decay multiplies by |1 - lr * weight_decay|. Sane steps are many orders of magnitude
        below the limit, so only absurd settings take the copy-backed path."""
        if self._weight_bound is None:
            self._measure_bounds()
        assert self._weight_bound is not None
        gradient = max(self._grad_bound, grad_norm)
        grow, add = 1.0, 0.0
        if self._adam_named:  # not self._adamw: a rank may own none, and the ranks must agree
            adam = settings.adam
            if adam.eps <= 0 or adam.beta1 >= 1:
                return False, math.inf
            grow = abs(1 - adam.learning_rate * adam.weight_decay)
            add = adam.learning_rate / (1 - adam.beta1) * gradient / adam.eps
        scaling = self.muon_scaling  # not None when there are Muon parameters
        if settings.muon is not None and scaling is not None and self._muon_named:
            muon = settings.muon
            scale = max(lr_scale(p.shape[-2], p.shape[-1], scaling) for _, p in self._muon_named)
            grow = max(grow, abs(1 - muon.learning_rate * muon.weight_decay))
            add = max(add, muon.learning_rate * scale * 4.0)
        # Parameters without a gradient keep their weights: the bound never shrinks.
        bound = max(self._weight_bound, grow * self._weight_bound + add)
        return bound < OVERFLOW_FREE_BOUND and gradient < OVERFLOW_FREE_BOUND, bound

    def _measure_bounds(self) -> None:
        """The bounds from the tensors themselves: at the first step, after a state load, and
        after a copy-backed step (one pass over weights and moments)."""
        weights = [
            local(p).detach().abs().max()
            for _, p in self.named_params
            if local(p).numel()  # a rank may hold no rows of a small tensor
        ]
        self._weight_bound = float(torch.stack(weights).max()) if weights else 0.0
        if self.sharding is not None:  # each rank holds its own slices
            device = self.named_params[0][1].device
            self._weight_bound = self.sharding.max(self._weight_bound, device)
        moments = [local(t) for t in self._moment_tensors() if local(t).numel()]
        self._grad_bound = (
            float(torch.stack([t.abs().max() for t in moments]).max()) if moments else 0.0
        )
        if self.sharding is not None:  # each rank holds its own moments
            self._grad_bound = self.sharding.max(self._grad_bound, self.named_params[0][1].device)

    def _moment_tensors(self) -> list[Tensor]:
        tensors = list(self._momentum_buffers.values())
        if self._adamw is not None:
            for entry in self._adamw.state.values():
                tensors += [entry[k] for k in ("exp_avg",) if k in entry]
        return tensors

    def _put_back(
        self, stepped: Sequence[tuple[Tensor, Tensor, Tensor]], state: OptimizerState
    ) -> None:
        with torch.no_grad():
            for p, weights, grad in stepped:
                p.copy_(weights)
                p.grad = grad
        self._restore_state(state)

    def _all_finite(self, params: list[Tensor]) -> bool:
        """Whether every parameter and optimizer moment is finite. One sum per tensor: 20x
        cheaper than isfinite().all() on a CPU, and a sum is non-finite exactly when an entry
        is, unless the sum itself overflows, which takes entries near 1e32 (weights that large
        are broken anyway)."""
        tensors = list(params) + list(self._momentum_buffers.values())
        if self._adamw is not None:
            tensors += [t for entry in self._adamw.state.values() for t in entry.values()]
        sums = [local(t).sum() for t in tensors if t.is_floating_point() and local(t).numel()]
        return not sums or bool(torch.stack(sums).isfinite().all())

    def _restore_state(self, state: OptimizerState) -> None:
        """Back to `state` (a state_dict()), including parameters that had no state then."""
        if self._adamw is not None:
            self._adamw.state = defaultdict(dict)
        self._momentum_buffers = {}
        self.load_state_dict(state)

    def _muon_step(self, muon: MuonParams) -> None:
        assert self.muon_scaling is not None, "Muon step on an AdamW optimizer"
        if self.sharding is not None:
            stepped = [(n, p, p.grad) for n, p in self._muon_named if p.grad is not None]
            group = self.sharding.group
            muon_shards.step_(stepped, self._momentum_buffers, muon, self.muon_scaling, group)
            return
        for name, p in self._muon_named:
            if p.grad is None:
                continue
            buffer = self._momentum_buffers.get(name)
            if buffer is None:
                # In the gradient's dtype, like AdamW's moments and torch.optim.Muon's buffer.
                buffer = self._momentum_buffers[name] = torch.zeros_like(p.grad)
            muon_update_(
                p,
                p.grad,
                buffer,
                learning_rate=muon.learning_rate,
                momentum=muon.momentum,
                weight_decay=muon.weight_decay,
                num_ns_steps=muon.newton_schulz_steps,
                scaling=self.muon_scaling,
                num_blocks=num_row_blocks(name),
            )

    def _adam_step(self, adam: AdamParams) -> None:
        assert self._adamw is not None, "AdamW step without AdamW parameters"
        # Set every field every step: torch keeps group values, we want them non-sticky (12.2).
        for group in self._adamw.param_groups:
            group["lr"] = adam.learning_rate
            group["betas"] = (adam.beta1, adam.beta2)
            group["eps"] = adam.eps
            group["weight_decay"] = adam.weight_decay if group["decay"] else 0.0
        if self.sharding is None:
            self._adamw.step()
        else:  # the same update on each rank's plain slices, without DTensor dispatch
            adam_shards.step_local_slices(self._adamw)

    def zero_grad(self) -> None:
        for _, p in self.named_params:
            p.grad = None

    def has_state(self) -> bool:
        """True once a step created moments or momentum buffers (memory/estimate.py)."""
        adam = self._adamw is not None and any(self._adamw.state.values())
        return adam or bool(self._momentum_buffers)

    def full_state_dict(self) -> OptimizerState | None:
        """state_dict() of every parameter: sharded, gathered onto rank 0 (None elsewhere; a
        collective), for checkpoints in the single-process layout."""
        if self.sharding is None:
            return self.state_dict()
        return self.sharding.gather_to_rank_zero(self.state_dict())

    def full_gradients(self) -> dict[str, Tensor] | None:
        """Every accumulated gradient by name; sharded, gathered as full_state_dict is."""
        grads = {name: p.grad for name, p in self.named_params if p.grad is not None}
        return grads if self.sharding is None else self.sharding.gather_to_rank_zero(grads)

    def state_dict(self) -> OptimizerState:
        """A copy of the optimizer state, keyed by parameter name (layout: ADAM_STATE,
        MUON_STATE). Parameters that never had a gradient have no entry; sharded, the tensors
        are this rank's DTensor slices."""
        adam_state: dict[str, dict[str, Tensor]] = {}
        if self._adamw is not None:
            for name, p in self._adam_named:
                if self._adamw.state.get(p):
                    adam_state[name] = {k: v.clone() for k, v in self._adamw.state[p].items()}
        muon_state = {
            name: {"momentum_buffer": buffer.clone()}
            for name, buffer in self._momentum_buffers.items()
        }
        return {ADAM_STATE: adam_state, MUON_STATE: muon_state}

    def load_state_dict(self, state: OptimizerState) -> None:
        """Replace the optimizer state with a copy of `state` (full tensors, as state_dict() of
        one process); sharded, each rank keeps its slices (so a checkpoint from any number of
        ranks loads).

        Tensors keep their saved dtype so a resumed session continues bit-exactly; they move to
        their parameter's device, except AdamW's `step`, which torch keeps on the CPU.

        Raises:
            InvalidRequest: the state names a parameter this optimizer does not hold in that
                group, or a tensor's shape differs from its parameter's.
        """
        self._weight_bound = None  # re-measured from the loaded moments at the next step
        adam_params = dict(self._adam_named)
        muon_params = dict(self._muon_named)
        _check_state(state[ADAM_STATE], adam_params, "AdamW", ("exp_avg", "exp_avg_sq"))
        _check_state(state[MUON_STATE], muon_params, "Muon", ("momentum_buffer",))
        if self._adamw is not None:
            self._adamw.state = defaultdict(dict)
            for name, entry in state[ADAM_STATE].items():
                p = adam_params[name]
                self._adamw.state[p] = {
                    k: v.to("cpu", copy=True) if k == "step" else self._placed(v, p)
                    for k, v in entry.items()
                }
        self._momentum_buffers = {
            name: self._placed(entry["momentum_buffer"], muon_params[name])
            for name, entry in state[MUON_STATE].items()
        }

    def _placed(self, value: Tensor, p: nn.Parameter) -> Tensor:
        """A copy of a saved state tensor laid out as parameter `p`: on its device, and with
        FSDP2 shards (parallel/fsdp.py) this rank's slice of it."""
        if self.sharding is not None:
            return self.sharding.shard_of(value.to(p.device, copy=True), p)
        return value.to(p.device, copy=True)

    def load_gradients(self, saved: dict[str, Tensor]) -> None:
        """Accumulated gradients from full tensors by name (persisted live state): each
        parameter takes its own (its slice, with FSDP2 shards); one missing from `saved` has
        none."""
        for name, p in self.named_params:
            if name not in saved:
                p.grad = None
                continue
            p.grad = self._placed(saved[name].to(dtype=p.dtype), p)


def _check_state(
    group_state: dict[str, dict[str, Tensor]],
    params: dict[str, nn.Parameter],
    group: str,
    shaped_keys: tuple[str, ...],
) -> None:
    """Reject optimizer state saved for other parameters (another model, LoRA rank or family)."""
    for name, entry in group_state.items():
        if name not in params:
            raise InvalidRequest(f"optimizer state has {group} state for unknown parameter {name}")
        for key in shaped_keys:
            if entry[key].shape != params[name].shape:
                raise InvalidRequest(
                    f"optimizer state {key} of {name} has shape {tuple(entry[key].shape)}, "
                    f"the parameter has {tuple(params[name].shape)}"
                )
