"""LoRA on the fused 3-D expert weights of a mixture-of-experts layer, with per-row adapters.

transformers stores a layer's experts as `gate_up_proj [E, 2I, H]` (gate rows, then up rows)
and `down_proj [E, H, I]` (Qwen3-MoE and the other `@use_experts_implementation` classes).
Each projection gets one low-rank pair per expert:

    gate_up_e(x) = x @ (W_e + s B_e A_e)^T    A: [E, R, in], B: [E, out, R], s = alpha / rank

applied batched (grouped matmuls over experts) to the tokens routed to expert e, and only for
tokens whose batch row the caller routed to that adapter (model/lora.py). The router is not
touched: which experts a token uses and their gate weights come from the frozen base router.

Only the layout above is wrapped (concatenated gate-up, not transposed, no biases); other
expert layouts stay frozen base weights (`wrappable`).

Legend: N = tokens of the batch (rows times positions), E = experts, R = rank.

Imports: torch, transformers.integrations.moe (its grouped linear).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers.integrations.moe import _grouped_linear

PROJECTIONS = ("gate_up_proj", "down_proj")


class ExpertAdapter(Protocol):
    """What the experts' forward reads of an adapter (model.lora.AdapterWeights)."""

    lora_A: nn.Parameter  # [E, R, in]
    lora_B: nn.Parameter  # [E, out, R]
    scale: float
    dropout: float


class ExpertProjection:
    """The adapters of one 3-D expert parameter; LoraModel sees it as one target layer."""

    def __init__(self, weight: nn.Parameter) -> None:
        self.weight = weight  # [E, out, in], frozen
        self.adapters: dict[str, ExpertAdapter] = {}  # adapter key -> model.lora.AdapterWeights
        self.routing: list[tuple[str, Tensor | None]] = []

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def adapts(self) -> bool:
        return any(key in self.adapters for key, _ in self.routing)


def wrappable(module: nn.Module) -> bool:
    """Whether `module` holds experts in the fused layout this module knows how to adapt."""
    gate_up, down = (getattr(module, name, None) for name in PROJECTIONS)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
        return False
    if gate_up.ndim != 3 or down.ndim != 3:
        return False
    if not isinstance(getattr(module, "act_fn", None), nn.Module):
        return False
    if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
        return False
    if not getattr(module, "is_concatenated", True) or not getattr(module, "has_gate", True):
        return False
    # Exactly these parameters, in this order: the PEFT export nests by it
    # (engine/checkpoint/formats.py).
    if [name for name, _ in module.named_parameters(recurse=False)] != list(PROJECTIONS):
        return False
    experts, two_inter, hidden = gate_up.shape
    return tuple(down.shape) == (experts, hidden, two_inter // 2) and two_inter % 2 == 0


class LoraExperts(nn.Module):
    """A frozen experts module plus adapters; same forward signature as the base experts."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.projections = {
            name: ExpertProjection(base.get_parameter(name)) for name in PROJECTIONS
        }
        # An int the experts module's __init__ set; nn.Module's stubs type an attribute they do
        # not declare as a Tensor or a Module.
        num_experts = vars(base)["num_experts"]
        assert isinstance(num_experts, int), f"{type(base).__name__}.num_experts: {num_experts!r}"
        self.num_experts = num_experts
        # Batch rows of the current forward, recorded by the MoE block's pre-hook: the experts
        # see tokens flattened to [N, H] and per-row routing needs rows back.
        self.batch_rows: int | None = None

    def record_rows(
        self, _module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> None:
        hidden = next(
            (v for v in (*args, *kwargs.values()) if isinstance(v, Tensor)),
            None,
        )
        self.batch_rows = int(hidden.shape[0]) if hidden is not None and hidden.ndim == 3 else None

    def forward(self, hidden_NH: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        slots_N, active = self._token_slots(hidden_NH)
        if not active:
            base_NH: Tensor = self.base(hidden_NH, top_k_index, top_k_weights)
            return base_NH
        base = self.base
        num_tokens, top_k = top_k_index.shape
        # The base computation is transformers' grouped_mm experts forward (its default), op
        # for op, so a fresh adapter (B = 0) gives the base model's numbers exactly. S = token
        # and expert pairs, sorted by expert.
        expert_ids_S, perm_S = torch.sort(top_k_index.reshape(-1))
        token_S = perm_S // top_k
        x_SH = hidden_NH[token_S]
        weights_S = top_k_weights.reshape(-1)[perm_S]
        offsets_E = _offsets(expert_ids_S, self.num_experts)
        slots_S = slots_N[token_S]
        gate_up = _grouped_linear(x_SH, base.get_parameter("gate_up_proj"), offsets_E)
        self._add_deltas(gate_up, x_SH, expert_ids_S, slots_S, active, "gate_up_proj")
        gate, up = gate_up.chunk(2, dim=-1)
        inner = base.get_submodule("act_fn")(gate) * up
        out_SH = _grouped_linear(inner, base.get_parameter("down_proj"), offsets_E)
        self._add_deltas(out_SH, inner, expert_ids_S, slots_S, active, "down_proj")
        weighted_SH = out_SH * weights_S.unsqueeze(-1)
        inverse_S = torch.empty_like(perm_S)
        inverse_S[perm_S] = torch.arange(perm_S.numel(), device=perm_S.device)
        weighted_SH = weighted_SH[inverse_S]
        out_NH = weighted_SH.view(num_tokens, top_k, -1).sum(dim=1)
        return out_NH.to(hidden_NH.dtype)

    def _token_slots(self, hidden_NH: Tensor) -> tuple[Tensor, list[str]]:
        """Per token, the index into `active` of its adapter (-1: base only), and `active`:
        the routed adapter keys this layer has."""
        routing = self.projections["gate_up_proj"].routing
        keys = set(self.projections["gate_up_proj"].adapters)
        num_tokens = hidden_NH.shape[0]
        rows = self.batch_rows or num_tokens
        per_row = num_tokens // rows
        slots_N = torch.full((num_tokens,), -1, dtype=torch.long, device=hidden_NH.device)
        active: list[str] = []
        for key, row_idx in routing:
            if key not in keys:
                continue
            if row_idx is None:
                slots_N.fill_(len(active))
            else:
                positions = torch.arange(per_row, device=hidden_NH.device)
                tokens = (row_idx.to(hidden_NH.device)[:, None] * per_row + positions).flatten()
                slots_N[tokens] = len(active)
            active.append(key)
        return slots_N, active

    def _add_deltas(
        self,
        out: Tensor,
        x: Tensor,
        expert_ids_S: Tensor,
        slots_S: Tensor,
        active: list[str],
        name: str,
    ) -> None:
        """out[i] += s * B_e A_e x[i] for the pairs i of each adapter, batched over experts
        with grouped matmuls; in place: `out` is a fresh grouped-linear output that its
        backward does not read (as in LoraLinear)."""
        adapters = self.projections[name].adapters
        num_experts = self.num_experts
        for slot, key in enumerate(active):
            adapter = adapters[key]
            # Still sorted by expert: a subset of a sorted sequence keeps its order.
            sel = (slots_S == slot).nonzero()[:, 0]
            if sel.numel() == 0:
                continue
            x_sel = x.index_select(0, sel).to(adapter.lora_A.dtype)
            if adapter.dropout > 0 and torch.is_grad_enabled():
                x_sel = F.dropout(x_sel, adapter.dropout)
            offsets = _offsets(expert_ids_S.index_select(0, sel), num_experts)
            lora_A, lora_B = _rank_padded(adapter.lora_A, adapter.lora_B)
            low_rank = _grouped_linear(x_sel, lora_A, offsets)
            delta = _grouped_linear(low_rank, lora_B, offsets)
            out.index_add_(0, sel, delta.to(out.dtype), alpha=adapter.scale)


def _rank_padded(lora_A: Tensor, lora_B: Tensor) -> tuple[Tensor, Tensor]:
    """A [E, R, in] and B [E, out, R] with R padded by zeros to a multiple of 16 bytes.

    grouped_mm needs every stride a multiple of 16 bytes, and the rank is the inner dimension
    of B and of the low-rank activations: a float32 rank that is not a multiple of 4 would
    fail. The zero rows of A and columns of B add exact zeros, and their gradients are sliced
    away by the pad's backward."""
    pad = -lora_A.shape[-2] % (16 // lora_A.element_size())
    if pad == 0:
        return lora_A, lora_B
    return F.pad(lora_A, (0, 0, 0, pad)), F.pad(lora_B, (0, pad))


def _offsets(sorted_expert_ids: Tensor, num_experts: int) -> Tensor:
    """End offset of each expert's group, as transformers' grouped_mm forward computes it."""
    # histc: float on CPU, int on CUDA (transformers' note on deterministic algorithms).
    device_type = sorted_expert_ids.device.type
    ids = sorted_expert_ids.float() if device_type in ("cpu", "mps") else sorted_expert_ids.int()
    counts = torch.histc(ids, bins=num_experts, min=0, max=num_experts - 1)
    return torch.cumsum(counts, dim=0, dtype=torch.int32)
