"""Response models of the API's objects (api.md 1.1 to 1.6, 6.1): they document /openapi.json
and render the answers (schemas/reply.py says how), so a response shape is written once. Each
model that answers for a domain record builds itself from it (`of`).
tests/integration/test_openapi_contract.py checks real answers against the served schema;
tests/unit/api/test_replies.py checks them against the JSON the SDK got before.

Imports: api.schemas.reply, types.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar, Final, Literal, Self, cast

from pydantic import Field

from posttrain import types as t
from posttrain.api.schemas.reply import Reply, Timestamp, optional, timestamp
from posttrain.records import CheckpointRecord, ErrorInfo, ResourceRecord, SessionRecord
from posttrain.statuses import ResourceErrorCode, ResourceStatus, SessionErrorCode, SessionStatus
from posttrain.types import CheckpointType

# The SDK 3.1.1 types pin gpu_type to literals (api.md 7.9): a ModelResources may say
# "H100-80GB" or "B200-SXM" or nothing; a supported model's gpu_type and default_gpu_type must
# say "B200-SXM". So gpu_type carries the nearest accepted literal, and `device` (an extra field,
# which the SDK's models keep) carries the real device name.
SUPPORTED_MODELS_GPU_TYPE: Final = "B200-SXM"


def resource_gpu_type(device: str) -> Literal["H100-80GB", "B200-SXM"] | None:
    """The ModelResources gpu_type literal naming `device`, or None where none does."""
    name = device.upper()
    if "B200" in name:
        return "B200-SXM"
    if "H100" in name and "80GB" in name:
        return "H100-80GB"
    return None


# ---------------------------------------------------------------- errors


class ErrorData(Reply):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, ...")
    param: str | None = Field(description="the field, header or parameter at fault")
    code: str | None


class ErrorEnvelope(Reply):
    """Every 4xx and 5xx (api.md 6.1)."""

    error: ErrorData


class ObjectError(Reply):
    code: str
    message: str
    occurred_at: str = Timestamp

    # The enum `code` takes in a subclass: the stored code is its value.
    codes: ClassVar[type[StrEnum] | None] = None

    @classmethod
    def of(cls, error: ErrorInfo) -> Self:
        code = error.code if cls.codes is None else cls.codes(error.code)
        reply = cls.model_construct(
            code=code, message=error.message, occurred_at=timestamp(error.occurred_at)
        )
        return cast(Self, reply)  # Reply.copied says why


# ---------------------------------------------------------------- model resources


class ResourceComputeConfig(Reply):
    num_generator_replicas: int
    device: str = Field(description="the device the engine runs on (posttrain's extra field)")
    gpu_type: Literal["H100-80GB", "B200-SXM"] = optional()


class MuonConfig(Reply):
    scaling_strategy: str


class OptimizerConfig(Reply):
    adam: dict[str, Any] = optional()
    muon: MuonConfig = optional()


class StatusDetails(Reply):
    queue_position: int = optional()


class ResourceError(ObjectError):
    code: ResourceErrorCode
    codes = ResourceErrorCode


class ModelResources(Reply):
    id: str
    base_model: str
    compute_config: ResourceComputeConfig
    created_at: str = Timestamp
    created_by: str
    inactive_timeout: int
    lora_enabled: bool
    optimizer_config: OptimizerConfig
    status: ResourceStatus
    status_details: StatusDetails
    updated_at: str = Timestamp
    expires_at: str = optional(format="date-time")
    error: ResourceError = optional()

    @classmethod
    def of(cls, r: ResourceRecord) -> Self:
        optimizer = (
            OptimizerConfig.model_construct(adam={})
            if r.muon_scaling is None
            else OptimizerConfig.model_construct(
                muon=MuonConfig.model_construct(scaling_strategy=r.muon_scaling)
            )
        )
        # ResourceRecord.gpu_type holds the device name the engine reported at creation.
        compute = ResourceComputeConfig.copied(
            r, device=r.gpu_type, gpu_type=resource_gpu_type(r.gpu_type)
        )
        return cls.copied(
            r,
            compute_config=compute,
            created_at=timestamp(r.created_at),
            optimizer_config=optimizer,
            status_details=StatusDetails.model_construct(),
            updated_at=timestamp(r.updated_at),
            expires_at=None if r.expires_at is None else timestamp(r.expires_at),
            error=None if r.error is None else ResourceError.of(r.error),
        )


class PageMeta(Reply):
    has_more: bool
    limit: int
    next_cursor: str = Field(description="`after` for the next page; empty on the last")


class ModelResourcesList(Reply):
    data: list[ModelResources]
    meta: PageMeta


class EstimateCost(Reply):
    currency: str
    price_per_hour: float


# ---------------------------------------------------------------- sessions


class CheckpointRef(Reply):
    id: str
    created_at: str = Timestamp
    step: int

    @classmethod
    def of(cls, c: t.CheckpointRef) -> Self:
        return cls.copied(c, created_at=timestamp(c.created_at))


class Wandb(Reply):
    entity: str = optional()
    group: str = optional()
    project: str = optional()
    run_id: str = optional()
    run_name: str = optional()
    url: str = optional()


class SessionMetadata(Reply):
    wandb: Wandb = optional()

    @classmethod
    def of(cls, metadata: dict[str, dict[str, str]]) -> Self:
        """Wandb's keys come out in the order declared here; a PATCH that adds an earlier
        key after a later one stores them in arrival order, which the wire no longer keeps."""
        # _fields_set named, so that the checker binds none of the stored values to it.
        groups = {
            group: Wandb.model_construct(_fields_set=None, **fields)
            for group, fields in metadata.items()
        }
        return cast(Self, cls.model_construct(_fields_set=None, **groups))  # Reply.copied: why


class PolicyState(Reply):
    trainer_step: int
    target_weights_version: int
    applied_weights_version: int
    pending_publish: bool


class LoraConfig(Reply):
    rank: int
    alpha: float
    dropout: float
    seed: int
    train_unembed: bool


class SessionError(ObjectError):
    code: SessionErrorCode
    codes = SessionErrorCode


class Session(Reply):
    id: str
    base_model: str
    created_at: str = Timestamp
    updated_at: str = Timestamp
    created_by: str
    inference_checkpoints: list[CheckpointRef]
    training_checkpoints: list[CheckpointRef]
    metadata: SessionMetadata
    model_resources_id: str
    policy_state: PolicyState
    status: SessionStatus
    step: int
    display_name: str = optional()
    lora_config: LoraConfig = optional()
    resume_from_checkpoint_id: str = optional()
    error: SessionError = optional()

    @classmethod
    def of(cls, s: SessionRecord) -> Self:
        return cls.copied(
            s,
            created_at=timestamp(s.created_at),
            updated_at=timestamp(s.updated_at),
            inference_checkpoints=[CheckpointRef.of(c) for c in s.inference_checkpoints],
            training_checkpoints=[CheckpointRef.of(c) for c in s.training_checkpoints],
            metadata=SessionMetadata.of(s.metadata),
            model_resources_id=s.resource_id,
            policy_state=PolicyState.copied(s.policy_state),
            lora_config=None if s.lora_config is None else LoraConfig.copied(s.lora_config),
            error=None if s.error is None else SessionError.of(s.error),
        )


class SessionsList(Reply):
    data: list[Session]
    meta: PageMeta


# ---------------------------------------------------------------- checkpoints


class Checkpoint(Reply):
    id: str
    base_model: str
    created_at: str = Timestamp
    session_id: str
    step: int
    type: CheckpointType
    lora_rank: int = optional()

    @classmethod
    def of(cls, c: CheckpointRecord) -> Self:
        """lora_rank for every LoRA checkpoint (tinker reads it)."""
        return cls.copied(c, created_at=timestamp(c.created_at))


class CheckpointsList(Reply):
    data: list[Checkpoint]
    meta: PageMeta


class CheckpointFile(Reply):
    filename: str
    size: int
    url: str = Field(description="signed; fetched without Authorization")


class CheckpointDownload(Reply):
    data: list[CheckpointFile]


# ---------------------------------------------------------------- supported models


class SamplingDefaults(Reply):
    logprobs: int
    max_tokens: int
    n: int
    temperature: float


class GeneratorConfig(Reply):
    context_length: int
    sampling_defaults: SamplingDefaults


class TrainerLimits(Reply):
    max_batch_size: int
    max_seq_length: int


class LoraTrainerLimits(TrainerLimits):
    max_rank: int


class TrainerConfig(Reply):
    full: TrainerLimits = optional()
    lora: LoraTrainerLimits = optional()


class SupportedComputeConfig(Reply):
    gpu_type: Literal["B200-SXM"]
    device: str
    generator_config: GeneratorConfig = optional()
    trainer_config: TrainerConfig = optional()


class SupportedModel(Reply):
    base_model: str
    default_gpu_type: Literal["B200-SXM"]
    compute_configs: list[SupportedComputeConfig] = optional()


class SupportedModels(Reply):
    data: list[SupportedModel]


# ---------------------------------------------------------------- payloads, identity, health


class UploadUrl(Reply):
    payload_id: str
    upload_url: str


class DownloadUrl(Reply):
    download_url: str


class PayloadStored(Reply):
    payload_id: str
    size: int


class WhoamiUser(Reply):
    id: str


class Whoami(Reply):
    type: Literal["user_jwt"]
    user: WhoamiUser


class Health(Reply):
    status: Literal["ok"]
