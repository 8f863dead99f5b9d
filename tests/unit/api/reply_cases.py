"""Representative domain records of every response kind, rendered by test_replies.py and
compared with golden_replies.json: the JSON the SDK 3.1.1 got before the reply models rendered
it, kept as literal text (key order, `16` vs `16.0`, `1e-05` included)."""

from __future__ import annotations

from posttrain.records import (
    CheckpointRecord,
    ErrorInfo,
    OperationRecord,
    PolicyState,
    ResourceRecord,
    SessionRecord,
)
from posttrain.statuses import OperationErrorCode, OperationStatus, ResourceStatus, SessionStatus
from posttrain.types import (
    CheckpointOutput,
    CheckpointRef,
    CheckpointType,
    CustomForwardBackwardOutput,
    ForwardBackwardResult,
    LoraConfig,
    MuonScaling,
    OperationKind,
    OptimStepOutput,
    PolicySegment,
    SampledSequence,
    SampleOutput,
    SampleResult,
    StopReason,
    TopkPromptLogprobs,
    WeightsSyncOutput,
)

T0 = 1_700_000_000.125

RESOURCES = {
    "resource_adam_cpu": ResourceRecord(
        "mr-1", "Qwen/Qwen3-0.6B", "alice", T0, T0 + 1, ResourceStatus.PENDING, gpu_type="cpu"
    ),
    "resource_muon_h100_expiring": ResourceRecord(
        "mr-2",
        "Qwen/Qwen3-0.6B",
        "alice",
        T0,
        T0 + 2.5,
        ResourceStatus.READY,
        lora_enabled=False,
        num_generator_replicas=2,
        gpu_type="NVIDIA H100 80GB HBM3",
        inactive_timeout=600,
        muon_scaling=MuonScaling.ORIGINAL,
        expires_at=T0 + 3600,
    ),
    "resource_failed_b200": ResourceRecord(
        "mr-3",
        "m",
        "bob",
        T0,
        T0,
        ResourceStatus.ERROR,
        gpu_type="NVIDIA B200",
        error=ErrorInfo("MODEL_RESOURCES_ERROR_CODE_PROVISIONING_FAILED", "out of memory", T0 + 5),
    ),
}

REF = CheckpointRef("ckpt-1", T0 + 10, 3)

SESSIONS = {
    "session_fresh": SessionRecord("sess-1", "mr-1", "m", "alice", T0, T0, SessionStatus.CREATING),
    "session_lora_wandb_reordered": SessionRecord(
        "sess-2",
        "mr-1",
        "m",
        "alice",
        T0,
        T0 + 7,
        SessionStatus.RUNNING,
        step=4,
        policy_state=PolicyState(4, 2, 1, True),
        display_name="run A",
        # as a PATCH merges it: a later key after an earlier one
        metadata={"wandb": {"project": "p", "entity": "e"}},
        lora_config=LoraConfig(rank=16, alpha=16, dropout=0.05, seed=7, train_unembed=False),
        resume_from_checkpoint_id="ckpt-0",
        training_checkpoints=(REF, CheckpointRef("ckpt-2", T0 + 20, 4)),
        inference_checkpoints=(REF,),
    ),
    "session_failed": SessionRecord(
        "sess-3",
        "mr-1",
        "m",
        "alice",
        T0,
        T0,
        SessionStatus.ERROR,
        lora_config=LoraConfig(alpha=32.5),
        error=ErrorInfo("TRAINING_SESSION_ERROR_CODE_SESSION_FAILED", "worker died", T0 + 1),
    ),
}

CHECKPOINTS = {
    "checkpoint_lora": CheckpointRecord(
        "ckpt-1", "sess-2", "m", "alice", T0, CheckpointType.TRAINING, 3, "/x", lora_rank=8
    ),
    "checkpoint_full": CheckpointRecord(
        "ckpt-9", "sess-2", "m", "alice", T0, CheckpointType.INFERENCE, 0, "/y"
    ),
}


def _op(
    kind: OperationKind,
    status: OperationStatus,
    output: object = None,
    code: OperationErrorCode | None = None,
    message: str | None = None,
) -> OperationRecord:
    return OperationRecord(
        f"op-{kind.value}-{status.value}",
        "sess-2",
        kind,
        status,
        T0,
        T0,
        "key",
        "fp",
        "alice",
        output=output,  # type: ignore[arg-type]
        error_code=code,
        error_message=message,
    )


SEQUENCE = SampledSequence([4, 5, 6], [-0.5, -1e-05, -2.0], StopReason.STOP, 2)
ROUTED = SampledSequence([1], [-0.25], StopReason.LENGTH, 0, routed_experts_key="routes-1")

OPERATIONS = {
    "op_forward_backward": _op(
        OperationKind.FORWARD_BACKWARD,
        OperationStatus.COMPLETED,
        ForwardBackwardResult(1e-05, {"loss:sum": 3.5, "num_tokens": 12}, [[-0.5, -1e-07], []]),
    ),
    "op_forward_backward_no_outputs": _op(
        OperationKind.FORWARD_BACKWARD,
        OperationStatus.COMPLETED,
        ForwardBackwardResult(2, {}),
    ),
    "op_custom_forward_backward": _op(
        OperationKind.CUSTOM_FORWARD_BACKWARD,
        OperationStatus.COMPLETED,
        CustomForwardBackwardOutput(),
    ),
    "op_optim_step": _op(OperationKind.OPTIM_STEP, OperationStatus.COMPLETED, OptimStepOutput(5)),
    "op_weights_sync": _op(
        OperationKind.WEIGHTS_SYNC, OperationStatus.COMPLETED, WeightsSyncOutput(3)
    ),
    "op_sample": _op(
        OperationKind.SAMPLE,
        OperationStatus.COMPLETED,
        SampleOutput(
            (
                SampleResult([SEQUENCE, ROUTED], [PolicySegment(0, 1), PolicySegment(2, 2)]),
                SampleResult(
                    [SEQUENCE],
                    [PolicySegment(0, 2)],
                    prompt_logprobs=[0.0, -3.25],
                    topk_prompt_logprobs=[TopkPromptLogprobs([1, 2], [-0.1, -2])],
                ),
            )
        ),
    ),
    "op_training_checkpoint": _op(
        OperationKind.TRAINING_CHECKPOINT, OperationStatus.COMPLETED, CheckpointOutput(REF)
    ),
    "op_inference_checkpoint": _op(
        OperationKind.INFERENCE_CHECKPOINT, OperationStatus.COMPLETED, CheckpointOutput(REF)
    ),
    "op_pending": _op(OperationKind.SAMPLE, OperationStatus.PENDING),
    "op_running": _op(OperationKind.FORWARD_BACKWARD, OperationStatus.RUNNING),
    "op_failed": _op(
        OperationKind.OPTIM_STEP,
        OperationStatus.FAILED,
        code=OperationErrorCode.INVALID_INPUT,
        message="bad things",
    ),
    "op_failed_no_message": _op(
        OperationKind.SAMPLE, OperationStatus.FAILED, code=OperationErrorCode.INTERNAL_ERROR
    ),
}
