"""A shared forward-backward packs its members' samples once: each member's loss inputs, cut
from the merged batch, equal what packing that member alone gives."""

from __future__ import annotations

import dataclasses

import torch

from posttrain.engine.train.batching import member_loss_batch, pack
from posttrain.types import TrainingSample


def sample(n: int, **inputs: tuple[float, ...]) -> TrainingSample:
    return TrainingSample(
        tokens=tuple(range(1, n + 1)),
        loss_fn_inputs={"target_tokens": tuple(range(2, n + 2)), **inputs},
    )


def test_each_member_reads_exactly_its_own_packing():
    members = [
        # weights on one of two samples (the other's fill is 1.0), no mask
        (sample(3, weights=(0.0, 1.0, 2.0)), sample(5)),
        # a mask and policy inputs, shorter than the merged width
        (sample(2, mask=(1.0, 0.0), logprobs=(-1.0, -2.0), advantages=(0.5, -0.5)),),
        # the longest member: reference logprobs only
        (sample(7, reference_logprobs=tuple(-0.1 * t for t in range(7))),),
    ]
    merged = pack(tuple(s for m in members for s in m), torch.device("cpu"))
    first = 0
    for samples in members:
        rows = range(first, first + len(samples))
        first = rows.stop
        got = member_loss_batch(merged, rows, samples)
        alone = pack(samples, torch.device("cpu")).loss_batch
        for field in dataclasses.fields(alone):
            want, have = getattr(alone, field.name), getattr(got, field.name)
            if want is None:
                # another member's key must not appear as this member's fill values
                assert have is None, field.name
            else:
                assert have is not None and torch.equal(want, have), field.name
