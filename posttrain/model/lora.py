"""LoRA adapters with per-row adapter selection, so one forward pass can serve many sessions.

Every linear layer of attention and MLP in the decoder layers, whatever the family calls it
(`q_proj`, fused `qkv_proj` / `gate_up_proj`, GPT-NeoX's `query_key_value`, ...), and the
output head for adapters with train_unembed, is wrapped in a LoraLinear that holds any number
of named adapters. Fused 3-D MoE expert weights get one pair per expert (model/lora_experts.py);
embeddings and MoE routers (and the Linears inside a router module) are never adapted. Before a
forward pass the caller routes rows of the batch to adapters with `LoraModel.route`: each
adapter's low-rank delta is added only to its rows. Base weights are shared and frozen.

    y = base(x) + (alpha / rank) * dropout(x) @ A^T @ B^T      A: [r, in], B: [out, r]

B starts at zero, so a fresh adapter equals the base model (step 0 = base policy).
Adapter tensors are float32 whatever the base dtype: they are what the optimizer updates.

Legend: B = batch rows, T = tokens, R = rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers import PreTrainedModel

from posttrain.model.logit_head import output_projection
from posttrain.model.lora_experts import ExpertProjection, LoraExperts, wrappable

# Names of MoE routers: a Linear by that name next to an `experts` module picks experts and
# stays frozen (the router of recent transformers is not a Linear at all).
ROUTER_NAMES = frozenset({"gate", "router"})


@dataclass
class AdapterWeights:
    lora_A: nn.Parameter  # [R, in]
    lora_B: nn.Parameter  # [out, R]
    scale: float
    dropout: float


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    dropout: float
    seed: int
    train_unembed: bool


class LoraLinear(nn.Module):
    """A frozen nn.Linear plus named adapters applied to the rows routed to each."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.adapters: dict[str, AdapterWeights] = {}
        # (adapter key, row indices or None for every row); set only inside LoraModel.route.
        self.routing: list[tuple[str, Tensor | None]] = []
        # In an MoE block that flattens its tokens to [N, H] before this layer (Qwen3-Next's
        # shared expert and its gate): the experts' record of the pass's batch rows, to map
        # routed rows to their tokens.
        self.flat_rows_from: LoraExperts | None = None

    @property
    def weight(self) -> Tensor:
        """The frozen base weight, for the families' code that reads a projection's dtype or
        device through it (DeepSeek-V3.2's indexer, HunYuan's gate, ERGO's decoder layer).
        Their code that computes with a weight directly is a router's (`_is_router`), never
        wrapped, so no adapter is bypassed."""
        return self.base.weight

    def adapts(self) -> bool:
        """Whether the current routing applies any adapter here (else the layer is its base)."""
        return any(key in self.adapters for key, _ in self.routing)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.base(x)
        for key, routed in self.routing:
            adapter = self.adapters.get(key)
            if adapter is None:  # e.g. the head of an adapter without train_unembed
                continue
            rows = routed if routed is None else self._token_rows(x, routed)
            x_rows = x if rows is None else x.index_select(0, rows)
            if x_rows.dtype != adapter.lora_A.dtype:  # a no-op `.to` still costs a dispatch
                x_rows = x_rows.to(adapter.lora_A.dtype)
            # Dropout only in passes that build a graph (forward-backward), so forward_only
            # scoring and sampling see the deterministic adapter.
            if adapter.dropout > 0 and torch.is_grad_enabled():
                x_rows = F.dropout(x_rows, adapter.dropout)
            delta = (x_rows @ adapter.lora_A.t()) @ adapter.lora_B.t()
            if delta.dtype != out.dtype:
                delta = delta.to(out.dtype)
            # In place, with the scale as alpha: `out` is the base linear's fresh output, which
            # its backward does not read, and copying a [rows, out_features] tensor per adapter
            # (the output head's is the vocabulary wide) cost more than the low-rank product.
            if rows is None:
                out.add_(delta, alpha=adapter.scale)
            else:
                out.index_add_(0, rows, delta, alpha=adapter.scale)
        return out

    def _token_rows(self, x: Tensor, rows: Tensor) -> Tensor:
        """`rows` as indices into x's first axis: the rows' tokens where the MoE block around
        this layer flattened them (row-major, as its experts see them)."""
        batch_rows = None if self.flat_rows_from is None else self.flat_rows_from.batch_rows
        if x.ndim != 2 or not batch_rows:
            return rows
        per_row = x.shape[0] // batch_rows
        positions = torch.arange(per_row, device=x.device)
        return (rows.to(x.device)[:, None] * per_row + positions).flatten()


class LoraModel:
    """Owns the LoraLinear wrappers of one base model and the adapters inside them."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        # Target name -> its adapters; an expert projection is named after its parameter
        # (`model.layers.0.mlp.experts.gate_up_proj`).
        self.layers: dict[str, LoraLinear | ExpertProjection] = {}
        head = output_projection(model)
        self.head_name = next((n for n, m in model.named_modules() if m is head), None)
        for name, module in list(model.named_modules()):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            if name != self.head_name and ".layers." not in f".{name}":
                continue
            if isinstance(module, nn.Linear) and not _is_router(model, parent_name, child):
                wrapper = LoraLinear(module)
                setattr(parent, child, wrapper)
                self.layers[name] = wrapper
            elif wrappable(module):
                experts = LoraExperts(module)
                setattr(parent, child, experts)
                parent.register_forward_pre_hook(experts.record_rows, with_kwargs=True)
                for projection_name, projection in experts.projections.items():
                    self.layers[f"{name}.{projection_name}"] = projection
        for block in model.modules():
            block_experts = next((m for m in block.children() if isinstance(m, LoraExperts)), None)
            if block_experts is None:
                continue
            for linear in block.modules():
                if isinstance(linear, LoraLinear):
                    linear.flat_rows_from = block_experts

    def add_adapter(self, key: str, spec: AdapterSpec) -> list[tuple[str, nn.Parameter]]:
        """Create adapter `key` on every target layer; returns its named trainable parameters."""
        assert key not in self.adapter_keys(), f"adapter {key} already exists"
        generator = torch.Generator().manual_seed(spec.seed)
        named: list[tuple[str, nn.Parameter]] = []
        for name, layer in self.layers.items():
            if name == self.head_name and not spec.train_unembed:
                continue
            *experts, out_features, in_features = _weight_shape(layer)
            lora_A = torch.empty(*experts, spec.rank, in_features)
            # Kaiming-uniform A as in PEFT; drawn on CPU from the seed so results do not depend
            # on the device.
            bound = 1.0 / math.sqrt(in_features)
            lora_A.uniform_(-bound, bound, generator=generator)
            lora_B = torch.zeros(*experts, out_features, spec.rank)
            device = _weight(layer).device
            weights = AdapterWeights(
                lora_A=nn.Parameter(lora_A.to(device)),
                lora_B=nn.Parameter(lora_B.to(device)),
                scale=spec.alpha / spec.rank,
                dropout=spec.dropout,
            )
            layer.adapters[key] = weights
            named.append((f"{name}.lora_A", weights.lora_A))
            named.append((f"{name}.lora_B", weights.lora_B))
        return named

    def remove_adapter(self, key: str) -> None:
        for layer in self.layers.values():
            layer.adapters.pop(key, None)

    def adapter_keys(self) -> set[str]:
        return {key for layer in self.layers.values() for key in layer.adapters}

    def adapter_parameters(self, key: str) -> list[tuple[str, nn.Parameter]]:
        named: list[tuple[str, nn.Parameter]] = []
        for name, layer in self.layers.items():
            if (adapter := layer.adapters.get(key)) is not None:
                named.append((f"{name}.lora_A", adapter.lora_A))
                named.append((f"{name}.lora_B", adapter.lora_B))
        return named

    def adapter_state(self, key: str) -> dict[str, Tensor]:
        """Detached copies of adapter `key`, named `<layer>.lora_A` / `<layer>.lora_B`."""
        return {name: p.detach().clone() for name, p in self.adapter_parameters(key)}

    def copy_adapter(self, source: str, target: str) -> None:
        """Make `target` an exact, independent copy of `source` (publishing to a generator)."""
        self.remove_adapter(target)
        for layer in self.layers.values():
            if (adapter := layer.adapters.get(source)) is None:
                continue
            layer.adapters[target] = AdapterWeights(
                lora_A=nn.Parameter(adapter.lora_A.detach().clone(), requires_grad=False),
                lora_B=nn.Parameter(adapter.lora_B.detach().clone(), requires_grad=False),
                scale=adapter.scale,
                dropout=0.0,
            )

    @contextmanager
    def route(self, assignments: list[tuple[str, Tensor | None]]) -> Iterator[None]:
        """Route rows to adapters for the forward (and backward) passes inside the block.

        `assignments` pairs an adapter key with the row indices it applies to (None: all rows).
        Rows not listed run the base model. Blocks nest: the routing in force before is back
        afterwards, so a recomputation in backward (engine/train/logprobs.py) can route its own
        rows."""
        previous = [layer.routing for layer in self.layers.values()]
        for layer in self.layers.values():
            _set_routing(layer, assignments)
        try:
            yield
        finally:
            for layer, routing in zip(self.layers.values(), previous, strict=True):
                _set_routing(layer, routing)


def _set_routing(
    layer: LoraLinear | ExpertProjection, routing: list[tuple[str, Tensor | None]]
) -> None:
    """`layer.routing = routing` without nn.Module.__setattr__: a plain list attribute ends up
    the same, and its checks (parameter, buffer, submodule), run twice per wrapped layer per
    pass, cost about 7% of a small model's decode step."""
    object.__setattr__(layer, "routing", routing)


def _is_router(model: nn.Module, parent_name: str, child: str) -> bool:
    """Whether the Linear `child` of module `parent_name` is (inside) an MoE router: named
    gate / router next to `experts`, or any Linear of a router module so named (HunYuan's
    `gate.wg`, LongCat-Flash's `router.classifier`, whose forward computes with the weight
    itself, ERGO's `gate.linear`, DBRX's `router.layer`)."""
    parent = model.get_submodule(parent_name)
    if child in ROUTER_NAMES and hasattr(parent, "experts"):
        return True
    grandparent_name, _, parent_child = parent_name.rpartition(".")
    return bool(parent_name) and _is_router(model, grandparent_name, parent_child)


def _weight(layer: LoraLinear | ExpertProjection) -> Tensor:
    return layer.base.weight if isinstance(layer, LoraLinear) else layer.weight


def _weight_shape(layer: LoraLinear | ExpertProjection) -> tuple[int, ...]:
    """[out, in] of a Linear, [E, out, in] of an expert projection."""
    return tuple(_weight(layer).shape)
