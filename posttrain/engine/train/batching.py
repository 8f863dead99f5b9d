"""Training samples -> padded tensors, and per-sample outputs back out.

Right padding: sample s occupies positions [0, N_s) of its row; valid_ST marks them. The
padded positions use token 0 and are excluded everywhere by valid_ST.

Legend: S = samples, T = longest sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.engine.train.losses import LossBatch
from posttrain.types import ExpertRoutes, TrainingSample

FLOAT_KEYS = {
    "weights": "weights_ST",
    "mask": "mask_ST",
    "logprobs": "sampler_logprobs_ST",
    "advantages": "advantages_ST",
    "reference_logprobs": "reference_logprobs_ST",
}


@dataclass(frozen=True)
class PackedBatch:
    tokens_ST: Tensor  # int64 model input
    targets_ST: Tensor  # int64 target_tokens
    attention_mask_ST: Tensor  # int64 1 on real positions
    lengths_S: list[int]
    loss_batch: LossBatch
    # Per sample, the expert routes its forward replays (MoE routing replay); None: free.
    routes_S: list[ExpertRoutes | None]


def _pad(rows: list[tuple[float, ...]], width: int, dtype: torch.dtype) -> Tensor:
    out = torch.zeros(len(rows), width, dtype=dtype)
    for index, row in enumerate(rows):
        out[index, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def pack(samples: tuple[TrainingSample, ...], device: torch.device) -> PackedBatch:
    lengths_S = [len(sample.tokens) for sample in samples]
    width = max(lengths_S)
    tokens_ST = _pad([s.tokens for s in samples], width, torch.int64)
    targets_ST = _pad([s.loss_fn_inputs["target_tokens"] for s in samples], width, torch.int64)
    valid_ST = torch.arange(width).unsqueeze(0) < torch.tensor(lengths_S).unsqueeze(1)
    floats: dict[str, Tensor | None] = {}
    for key, field_name in FLOAT_KEYS.items():
        present = [key in s.loss_fn_inputs for s in samples]
        if not any(present):
            floats[field_name] = None
            continue
        # A key sent for some samples only: an omitted weights/mask includes every position
        # (losses.md 1.3); the other keys are required per loss and checked before this.
        fill = 1.0 if key in ("weights", "mask") else 0.0
        rows = [s.loss_fn_inputs.get(key, (fill,) * len(s.tokens)) for s in samples]
        floats[field_name] = _pad(rows, width, torch.float32).to(device)
    loss_batch = LossBatch(valid_ST=valid_ST.to(device), **floats)
    return PackedBatch(
        tokens_ST=tokens_ST.to(device),
        targets_ST=targets_ST.to(device),
        attention_mask_ST=valid_ST.to(device=device, dtype=torch.int64),
        lengths_S=lengths_S,
        loss_batch=loss_batch,
        routes_S=[s.routed_experts for s in samples],
    )


def member_loss_batch(
    merged: PackedBatch, rows: range, samples: tuple[TrainingSample, ...]
) -> LossBatch:
    """The loss inputs of `samples`, rows `rows` of `merged`, exactly as `pack(samples)` would
    give them: cut to their own longest sample, and None for a key none of them sent (in the
    merged batch another member's key would read as this member's fill values)."""
    width = max(len(sample.tokens) for sample in samples)
    whole = merged.loss_batch

    def cut(values_ST: Tensor | None, key: str) -> Tensor | None:
        if values_ST is None or not any(key in s.loss_fn_inputs for s in samples):
            return None
        return values_ST[rows.start : rows.stop, :width]

    floats = {field: cut(getattr(whole, field), key) for key, field in FLOAT_KEYS.items()}
    return LossBatch(valid_ST=whole.valid_ST[rows.start : rows.stop, :width], **floats)


def unpack(values_ST: Tensor, lengths_S: list[int]) -> list[list[float]]:
    """Per-sample lists of the first N_s values of each row."""
    rows = values_ST.detach().float().cpu().tolist()
    return [row[:length] for row, length in zip(rows, lengths_S, strict=True)]
