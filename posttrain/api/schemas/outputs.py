"""Response models of operations: the envelope every operation POST and GET answers, with the
output of each kind (api.md 1.4; each kind's in api/kinds.py), as responses.output_json writes
them. Like objects.py they
document /openapi.json and are checked against real answers by the contract tests.

Imports: api.schemas.objects, types.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from posttrain.api.schemas.objects import CheckpointRef, Reply, optional
from posttrain.statuses import OperationErrorCode, OperationStatus
from posttrain.types import StopReason


class OperationError(Reply):
    code: OperationErrorCode
    message: str


class LogprobsTensor(Reply):
    data: list[float]
    dtype: Literal["float32"]


class LossFnTensors(Reply):
    logprobs: LogprobsTensor


class LossFnOutput(Reply):
    tensors: LossFnTensors


class ForwardBackwardResult(Reply):
    loss: float
    metrics: dict[str, float]
    loss_fn_outputs: list[LossFnOutput] = Field(
        description="one per sample, in request order; [] unless asked for"
    )


class CustomForwardBackwardResult(Reply):
    """Has no fields, and is still written as {} (api.md 1.4.3)."""


class OptimStepResult(Reply):
    step: int


class WeightsSyncResult(Reply):
    weights_version: int


class PolicySegment(Reply):
    start_token: int
    version: int


class SampledSequence(Reply):
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    prompt_cache_hit_tokens: int
    routed_experts_key: str = optional()


class TopkLogprobs(Reply):
    token_ids: list[int]
    logprobs: list[float]


class SampleResult(Reply):
    policy_segments: list[PolicySegment]
    sequences: list[SampledSequence]
    # Entry 0 has no previous token: a placeholder 0.0 (api.md 1.4.6).
    prompt_logprobs: list[float] = optional()
    topk_prompt_logprobs: list[TopkLogprobs] = optional()


class SampleOutput(Reply):
    results: list[SampleResult]


class CheckpointResult(Reply):
    checkpoint: CheckpointRef


class OperationReply(Reply):
    id: str
    status: OperationStatus
    error: OperationError = optional()


class ForwardBackwardOperation(OperationReply):
    output: ForwardBackwardResult = optional()


class CustomForwardBackwardOperation(OperationReply):
    output: CustomForwardBackwardResult = optional()


class OptimStepOperation(OperationReply):
    output: OptimStepResult = optional()


class WeightsSyncOperation(OperationReply):
    output: WeightsSyncResult = optional()


class SampleOperation(OperationReply):
    output: SampleOutput = optional()


class TrainingCheckpointOperation(OperationReply):
    output: CheckpointResult = optional()


class InferenceCheckpointOperation(OperationReply):
    output: CheckpointResult = optional()
