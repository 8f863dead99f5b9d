"""Training samples -> padded tensors, and per-sample outputs back out.

Right padding: sample s occupies positions [0, N_s) of its row; valid_ST marks them. The
padded positions use token 0 and are excluded everywhere by valid_ST.

Two position axes: the model's (tokens_ST, lengths_S, N_s tokens) and the loss's (targets_ST,
the loss inputs, the logprobs; loss_lengths_S, N_s * K_s). A sample of K_s targets per position
(TrainingSample.targets_per_position, top-k distillation) has loss position j at model position
j // K_s (`at_targets`); with K = 1 everywhere the two axes are one.

Legend: S = samples, T = longest sample (on the axis the tensor lives on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.engine.train.losses import LossBatch
from posttrain.types import ExpertRoutes, ImageInput, TrainingSample

FLOAT_KEYS = {
    "weights": "weights_ST",
    "mask": "mask_ST",
    "logprobs": "sampler_logprobs_ST",
    "advantages": "advantages_ST",
    "reference_logprobs": "reference_logprobs_ST",
    "sequence_ratio_mask": "sequence_ratio_mask_ST",
}


@dataclass(frozen=True)
class PackedBatch:
    tokens_ST: Tensor  # int64 model input
    targets_ST: Tensor  # int64 target_tokens, on the loss axis
    attention_mask_ST: Tensor  # int64 1 on real positions
    lengths_S: list[int]  # model positions
    loss_batch: LossBatch  # on the loss axis
    # Per sample, the expert routes its forward replays (MoE routing replay); None: free.
    routes_S: list[ExpertRoutes | None]
    # Per sample, its targets per position K_s (1 unless a top-k cross-entropy).
    targets_per_position_S: list[int]
    # Per sample, its images in offset order (placeholders already in tokens_ST).
    images_S: list[tuple[ImageInput, ...]]

    @property
    def loss_lengths_S(self) -> list[int]:
        return [n * k for n, k in zip(self.lengths_S, self.targets_per_position_S, strict=True)]


def at_targets(packed: PackedBatch, rows: list[int], width: int, hidden_BLH: Tensor) -> Tensor:
    """[B, width, H]: the hidden state of rows `rows` (model axis) at each of their first
    `width` loss positions, j -> j // K_s (padding: the row's last position), so the head
    gives each of a position's K targets its logprob. `hidden_BLH` itself when K = 1 for all."""
    per_row = [packed.targets_per_position_S[row] for row in rows]
    if all(k == 1 for k in per_row):
        return hidden_BLH
    device = hidden_BLH.device
    columns_1W = torch.arange(width, device=device).unsqueeze(0)
    k_B1 = torch.tensor(per_row, device=device).unsqueeze(1)
    last_B1 = torch.tensor([packed.lengths_S[row] - 1 for row in rows], device=device)
    positions_BW = torch.minimum(columns_1W // k_B1, last_B1.unsqueeze(1))
    return hidden_BLH.gather(1, positions_BW.unsqueeze(-1).expand(-1, -1, hidden_BLH.shape[-1]))


def _pad(rows: list[tuple[float, ...]], width: int, dtype: torch.dtype) -> Tensor:
    out = torch.zeros(len(rows), width, dtype=dtype)
    for index, row in enumerate(rows):
        out[index, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def pack(samples: tuple[TrainingSample, ...], device: torch.device) -> PackedBatch:
    lengths_S = [len(sample.tokens) for sample in samples]
    loss_lengths_S = [sample.loss_length for sample in samples]
    tokens_ST = _pad([s.tokens for s in samples], max(lengths_S), torch.int64)
    width = max(loss_lengths_S)
    targets_ST = _pad([s.loss_fn_inputs["target_tokens"] for s in samples], width, torch.int64)
    valid_ST = torch.arange(width).unsqueeze(0) < torch.tensor(loss_lengths_S).unsqueeze(1)
    model_valid_ST = torch.arange(tokens_ST.shape[1]).unsqueeze(0) < torch.tensor(
        lengths_S
    ).unsqueeze(1)
    floats: dict[str, Tensor | None] = {}
    for key, field_name in FLOAT_KEYS.items():
        present = [key in s.loss_fn_inputs for s in samples]
        if not any(present):
            floats[field_name] = None
            continue
        # A key sent for some samples only: an omitted weights/mask includes every position
        # (losses.md 1.3); the other keys are required per loss and checked before this.
        fill = 1.0 if key in ("weights", "mask") else 0.0
        rows = [s.loss_fn_inputs.get(key, (fill,) * s.loss_length) for s in samples]
        floats[field_name] = _pad(rows, width, torch.float32).to(device)
    loss_batch = LossBatch(valid_ST=valid_ST.to(device), **floats)
    return PackedBatch(
        tokens_ST=tokens_ST.to(device),
        targets_ST=targets_ST.to(device),
        attention_mask_ST=model_valid_ST.to(device=device, dtype=torch.int64),
        lengths_S=lengths_S,
        loss_batch=loss_batch,
        routes_S=[s.routed_experts for s in samples],
        targets_per_position_S=[s.targets_per_position for s in samples],
        images_S=[s.images for s in samples],
    )


def member_loss_batch(
    merged: PackedBatch, rows: range, samples: tuple[TrainingSample, ...]
) -> LossBatch:
    """The loss inputs of `samples`, rows `rows` of `merged`, exactly as `pack(samples)` would
    give them: cut to their own longest sample, and None for a key none of them sent (in the
    merged batch another member's key would read as this member's fill values)."""
    width = max(sample.loss_length for sample in samples)
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
