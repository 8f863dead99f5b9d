"""Response models of operations: the envelope every operation POST and GET answers, with the
output of each kind (api.md 1.4; each kind's in api/kinds.py). Like objects.py they document
/openapi.json and render the answers, built with `model_construct` from the domain output.

A sample output's token and logprob lists go into the models as the engine's plain lists: no
model per token, so rendering a large output costs about what json.dumps of it does.

Imports: api.schemas.objects, api.schemas.reply, types.
"""

from __future__ import annotations

from typing import Any, Literal, Self, cast

from pydantic import Field

from posttrain import types as t
from posttrain.api.schemas.objects import CheckpointRef
from posttrain.api.schemas.reply import Reply, optional
from posttrain.records import OperationRecord
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

    @classmethod
    def of(cls, result: t.ForwardBackwardResult) -> Self:
        reply = cls.model_construct(
            loss=result.loss,
            metrics=result.metrics,
            loss_fn_outputs=[
                LossFnOutput.model_construct(
                    tensors=LossFnTensors.model_construct(
                        logprobs=LogprobsTensor.model_construct(data=values, dtype="float32")
                    )
                )
                for values in result.loss_fn_outputs or []
            ],
        )
        return cast(Self, reply)  # Reply.copied says why


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


class LogprobMismatch(Reply):
    mean: float
    max: float
    tokens: int


class SampleResult(Reply):
    policy_segments: list[PolicySegment]
    sequences: list[SampledSequence]
    # Entry 0 has no previous token: a placeholder 0.0 (api.md 1.4.6).
    prompt_logprobs: list[float] = optional()
    topk_prompt_logprobs: list[TopkLogprobs] = optional()
    # vLLM generators: the trainer's scoring of the sampled tokens, where it scored them.
    logprob_mismatch: LogprobMismatch = optional()

    @classmethod
    def of(cls, result: t.SampleResult) -> Self:
        topk = result.topk_prompt_logprobs
        mismatch = result.logprob_mismatch
        return cls.copied(
            result,
            policy_segments=[PolicySegment.copied(s) for s in result.policy_segments],
            sequences=[SampledSequence.copied(s) for s in result.sequences],
            topk_prompt_logprobs=None if topk is None else [TopkLogprobs.copied(k) for k in topk],
            logprob_mismatch=None if mismatch is None else LogprobMismatch.copied(mismatch),
        )


class SampleOutput(Reply):
    results: list[SampleResult]


class CheckpointResult(Reply):
    checkpoint: CheckpointRef


def output_reply(output: t.OperationOutput) -> Reply:
    """An operation's output object (api.md 1.4)."""
    match output:
        case t.ForwardBackwardResult():
            return ForwardBackwardResult.of(output)
        case t.SampleOutput(results=results):
            return SampleOutput.model_construct(results=[SampleResult.of(r) for r in results])
        case t.OptimStepOutput(step=step):
            return OptimStepResult.model_construct(step=step)
        case t.WeightsSyncOutput(weights_version=version):
            return WeightsSyncResult.model_construct(weights_version=version)
        case t.CheckpointOutput(checkpoint=c):
            return CheckpointResult.model_construct(checkpoint=CheckpointRef.of(c))
        case t.CustomForwardBackwardOutput():
            return CustomForwardBackwardResult.model_construct()
    raise AssertionError(f"unknown operation output {output!r}")


class OperationReply(Reply):
    """Each kind's subclass declares its `output` (api/kinds.py picks the subclass)."""

    id: str
    status: OperationStatus
    output: Reply = optional()  # declared here so that it comes before `error`
    error: OperationError = optional()

    @classmethod
    def of(cls, op: OperationRecord) -> Self:
        fields: dict[str, Any] = {"id": op.id, "status": op.status}
        if op.output is not None:
            fields["output"] = output_reply(op.output)
        if op.error_code is not None:
            fields["error"] = OperationError.model_construct(
                code=op.error_code, message=op.error_message or ""
            )
        return cast(Self, cls.model_construct(**fields))  # Reply.copied says why


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
