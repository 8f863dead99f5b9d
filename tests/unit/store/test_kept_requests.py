"""Typed requests kept in the store read back equal, whatever their kind: the restart runs
what the client sent, read back by the service itself. What an annotation cannot tell (a
loss's params type, expert routes' bytes) comes back right too."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.records import OperationRecord
from posttrain.statuses import OperationStatus
from posttrain.store.codec import request_from_json, request_to_json
from posttrain.store.db import connect
from posttrain.store.repo import Repo
from posttrain.types import (
    AdamParams,
    CheckpointRequest,
    CheckpointType,
    CispoParams,
    CustomForwardBackwardRequest,
    ExpertRoutes,
    ForwardBackwardRequest,
    GrpoAggregation,
    GrpoParams,
    LossConfig,
    LossType,
    MuonParams,
    OperationKind,
    OptimStepRequest,
    PpoParams,
    SampleRequest,
    SamplingParams,
    TrainingSample,
    WeightsSyncRequest,
    WeightSyncType,
)

ROUTES = ExpertRoutes(num_tokens=3, num_layers=1, top_k=2, data=bytes(range(12)))
SAMPLE = TrainingSample(
    tokens=(5, 6, 7),
    loss_fn_inputs={"target_tokens": (6.0, 7.0, 8.0), "weights": (0.0, 1.0, 0.5)},
    routed_experts_key="re_1",
    routed_experts=ROUTES,
)
REQUESTS = [
    (
        OperationKind.FORWARD_BACKWARD,
        ForwardBackwardRequest((SAMPLE,), LossConfig(LossType.CROSS_ENTROPY)),
    ),
    (
        OperationKind.FORWARD_BACKWARD,
        ForwardBackwardRequest(
            (SAMPLE, SAMPLE),
            LossConfig(LossType.CISPO, CispoParams(0.1, 3.0)),  # PPO's fields exactly
            forward_only=True,
            return_loss_fn_outputs=True,
        ),
    ),
    (
        OperationKind.FORWARD_BACKWARD,
        ForwardBackwardRequest((SAMPLE,), LossConfig(LossType.PPO, PpoParams(0.7, 1.3))),
    ),
    (
        OperationKind.FORWARD_BACKWARD,
        ForwardBackwardRequest(
            (SAMPLE,),
            LossConfig(LossType.GRPO, GrpoParams(beta=0.1, agg_type=GrpoAggregation.TOKEN_MEAN)),
        ),
    ),
    (
        OperationKind.CUSTOM_FORWARD_BACKWARD,
        CustomForwardBackwardRequest((SAMPLE,), ((0.25, -1.0, 3.0),)),
    ),
    (OperationKind.OPTIM_STEP, OptimStepRequest()),
    (OperationKind.OPTIM_STEP, OptimStepRequest(adam=AdamParams(learning_rate=0.5))),
    (
        OperationKind.OPTIM_STEP,
        OptimStepRequest(muon=MuonParams(newton_schulz_steps=3, adam=AdamParams(eps=1e-6))),
    ),
    (OperationKind.WEIGHTS_SYNC, WeightsSyncRequest(WeightSyncType.PIPELINE)),
    (
        OperationKind.SAMPLE,
        SampleRequest(
            ((1, 2), (3,)),
            num_samples=2,
            sampling_params=SamplingParams(max_tokens=7, seed=3, stop=("\n", "END")),
            topk_prompt_logprobs=2,
        ),
    ),
    (OperationKind.TRAINING_CHECKPOINT, CheckpointRequest(CheckpointType.TRAINING)),
]


@pytest.mark.parametrize(("kind", "request_"), REQUESTS)
def test_every_typed_request_reads_back_equal(kind, request_):
    read = request_from_json(kind, request_to_json(request_))
    assert read == request_
    # Tokens stay ints, inputs floats (as the api parses them), tuples tuples.
    assert repr(read) == repr(request_)


def test_an_unfinished_operation_keeps_its_request_until_it_finishes(tmp_path: Path):
    repo = Repo(connect(tmp_path))
    kind, request = REQUESTS[1]
    op = OperationRecord("op-1", "ts-1", kind, OperationStatus.PENDING, 1.0, 1.0, "k", "f", "user")
    repo.insert_operation(op, request)
    assert repo.unfinished_with_requests() == [(op, request)]
    running = OperationRecord(
        "op-1", "ts-1", kind, OperationStatus.RUNNING, 1.0, 2.0, "k", "f", "user"
    )
    repo.put_operation(running)
    assert repo.unfinished_with_requests() == [(running, request)]
    completed = OperationRecord(
        "op-1", "ts-1", kind, OperationStatus.COMPLETED, 1.0, 3.0, "k", "f", "user"
    )
    repo.put_operations([completed], keep_requests={"op-1"})  # journaled
    assert repo.journal("ts-1", after=None) == [(completed, request)]
    repo.clear_requests("ts-1", through="op-1")
    assert repo.journal("ts-1", after=None) == []
