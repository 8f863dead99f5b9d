"""Domain records -> response JSON in the SDK 3.1.1 shapes, every required field written out.

Zero values are always emitted (api.md 0.3): `step: 0`, `pending_publish: false`, `[]`, `{}`.
Imports: types, engine.interface types via service (ModelInfo is a plain value).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi.responses import JSONResponse

from posttrain.types import (
    CheckpointOutput,
    CheckpointRecord,
    CheckpointRef,
    CustomForwardBackwardOutput,
    ErrorInfo,
    ForwardBackwardResult,
    OperationOutput,
    OperationRecord,
    OptimStepOutput,
    ResourceRecord,
    SampledSequence,
    SampleOutput,
    SampleResult,
    SessionRecord,
    WeightsSyncOutput,
)

# The SDK 3.1.1 types pin gpu_type to literals (api.md 7.9): a ModelResources may say
# "H100-80GB" or "B200-SXM" or nothing; a supported model's gpu_type and default_gpu_type must
# say "B200-SXM". So gpu_type carries the nearest accepted literal, and `device` (an extra field,
# which the SDK's models keep) carries the real device name.
SUPPORTED_MODELS_GPU_TYPE = "B200-SXM"


def resource_gpu_type(device: str) -> str | None:
    """The ModelResources gpu_type literal naming `device`, or None where none does."""
    name = device.upper()
    if "B200" in name:
        return "B200-SXM"
    if "H100" in name and "80GB" in name:
        return "H100-80GB"
    return None


def timestamp(epoch_s: float) -> str:
    """RFC 3339 in UTC with a Z suffix."""
    moment = datetime.fromtimestamp(epoch_s, tz=UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _error(error: ErrorInfo) -> dict[str, Any]:
    return {
        "code": error.code,
        "message": error.message,
        "occurred_at": timestamp(error.occurred_at),
    }


def resource_json(r: ResourceRecord) -> dict[str, Any]:
    optimizer: dict[str, Any] = (
        {"adam": {}} if r.muon_scaling is None else {"muon": {"scaling_strategy": r.muon_scaling}}
    )
    # ResourceRecord.gpu_type holds the device name the engine reported at creation.
    compute: dict[str, Any] = {
        "num_generator_replicas": r.num_generator_replicas,
        "device": r.gpu_type,
    }
    if (gpu_type := resource_gpu_type(r.gpu_type)) is not None:
        compute["gpu_type"] = gpu_type
    out: dict[str, Any] = {
        "id": r.id,
        "base_model": r.base_model,
        "compute_config": compute,
        "created_at": timestamp(r.created_at),
        "created_by": r.created_by,
        "inactive_timeout": r.inactive_timeout,
        "lora_enabled": r.lora_enabled,
        "optimizer_config": optimizer,
        "status": r.status.value,
        "status_details": {},
        "updated_at": timestamp(r.updated_at),
    }
    if r.expires_at is not None:
        out["expires_at"] = timestamp(r.expires_at)
    if r.error is not None:
        out["error"] = _error(r.error)
    return out


def _checkpoint_ref(c: CheckpointRef) -> dict[str, Any]:
    return {"id": c.id, "created_at": timestamp(c.created_at), "step": c.step}


def checkpoint_json(c: CheckpointRecord) -> dict[str, Any]:
    """The Checkpoint object (api.md 1.5); lora_rank for every LoRA checkpoint (tinker reads it)."""
    out: dict[str, Any] = {
        "id": c.id,
        "base_model": c.base_model,
        "created_at": timestamp(c.created_at),
        "session_id": c.session_id,
        "step": c.step,
        "type": c.type.value,
    }
    if c.lora_rank is not None:
        out["lora_rank"] = c.lora_rank
    return out


def session_json(s: SessionRecord) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": s.id,
        "base_model": s.base_model,
        "created_at": timestamp(s.created_at),
        "updated_at": timestamp(s.updated_at),
        "created_by": s.created_by,
        "inference_checkpoints": [_checkpoint_ref(c) for c in s.inference_checkpoints],
        "training_checkpoints": [_checkpoint_ref(c) for c in s.training_checkpoints],
        "metadata": s.metadata,
        "model_resources_id": s.resource_id,
        "policy_state": {
            "trainer_step": s.policy_state.trainer_step,
            "target_weights_version": s.policy_state.target_weights_version,
            "applied_weights_version": s.policy_state.applied_weights_version,
            "pending_publish": s.policy_state.pending_publish,
        },
        "status": s.status.value,
        "step": s.step,
    }
    if s.display_name is not None:
        out["display_name"] = s.display_name
    if s.lora_config is not None:
        out["lora_config"] = {
            "rank": s.lora_config.rank,
            "alpha": s.lora_config.alpha,
            "dropout": s.lora_config.dropout,
            "seed": s.lora_config.seed,
            "train_unembed": s.lora_config.train_unembed,
        }
    if s.resume_from_checkpoint_id is not None:
        out["resume_from_checkpoint_id"] = s.resume_from_checkpoint_id
    if s.error is not None:
        out["error"] = _error(s.error)
    return out


def _forward_backward_output(result: ForwardBackwardResult) -> dict[str, Any]:
    return {
        "loss": result.loss,
        "metrics": result.metrics,
        "loss_fn_outputs": [
            {"tensors": {"logprobs": {"data": values, "dtype": "float32"}}}
            for values in result.loss_fn_outputs or []
        ],
    }


def _sequence(sequence: SampledSequence) -> dict[str, Any]:
    item: dict[str, Any] = {
        "tokens": sequence.tokens,
        "logprobs": sequence.logprobs,
        "stop_reason": sequence.stop_reason.value,
        "prompt_cache_hit_tokens": sequence.prompt_cache_hit_tokens,
    }
    if sequence.routed_experts_key is not None:
        item["routed_experts_key"] = sequence.routed_experts_key
    return item


def _sample_result(result: SampleResult) -> dict[str, Any]:
    item: dict[str, Any] = {
        "policy_segments": [
            {"start_token": s.start_token, "version": s.version} for s in result.policy_segments
        ],
        "sequences": [_sequence(s) for s in result.sequences],
    }
    if result.prompt_logprobs is not None:
        item["prompt_logprobs"] = result.prompt_logprobs
    if result.topk_prompt_logprobs is not None:
        item["topk_prompt_logprobs"] = [
            {"token_ids": t.token_ids, "logprobs": t.logprobs} for t in result.topk_prompt_logprobs
        ]
    return item


def output_json(output: OperationOutput) -> dict[str, Any]:
    """An operation's output object (api.md 1.4)."""
    match output:
        case ForwardBackwardResult():
            return _forward_backward_output(output)
        case SampleOutput(results=results):
            return {"results": [_sample_result(r) for r in results]}
        case OptimStepOutput(step=step):
            return {"step": step}
        case WeightsSyncOutput(weights_version=version):
            return {"weights_version": version}
        case CheckpointOutput(checkpoint=c):
            return {
                "checkpoint": {"id": c.id, "created_at": timestamp(c.created_at), "step": c.step}
            }
        case CustomForwardBackwardOutput():
            return {}
    raise AssertionError(f"unknown operation output {output!r}")


def operation_json(op: OperationRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"id": op.id, "status": op.status.value}
    if op.output is not None:
        out["output"] = output_json(op.output)
    if op.error_code is not None:
        out["error"] = {"code": op.error_code.value, "message": op.error_message or ""}
    return out


def page(items: list[dict[str, Any]], *, limit: int, after: str | None) -> dict[str, Any]:
    """Cursor pagination over newest-first items: `after` is the id of the previous page's last."""
    start = 0
    if after:
        ids = [item["id"] for item in items]
        start = ids.index(after) + 1 if after in ids else len(items)
    chunk = items[start : start + limit]
    has_more = start + limit < len(items)
    return {
        "data": chunk,
        "meta": {
            "has_more": has_more,
            "limit": limit,
            "next_cursor": chunk[-1]["id"] if has_more and chunk else "",
        },
    }


def error_response(status: int, kind: str, message: str, param: str | None) -> JSONResponse:
    """The error envelope of every 4xx and 5xx (api.md 6.1)."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(status_code=status, content=body)
