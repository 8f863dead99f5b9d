"""Response models of the API's objects, as responses.py writes them (api.md 1.1 to 1.6, 6.1).

They document /openapi.json; the routes still build their JSON in responses.py, and
tests/integration/test_openapi_contract.py checks real answers against the served schema, so a
field added there without being added here fails a test. Fields the server always writes are
required; those it writes only sometimes are optional and never null. Extra fields are allowed,
as the SDK's own models allow them (api.md 0.3).

Imports: types.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from posttrain.statuses import ResourceErrorCode, ResourceStatus, SessionErrorCode, SessionStatus
from posttrain.types import CheckpointType

# RFC 3339 in UTC (responses.timestamp).
Timestamp = Field(json_schema_extra={"format": "date-time"})


class Reply(BaseModel):
    """A response object: what the server writes, extras allowed."""

    model_config = ConfigDict(extra="allow")


def optional(**schema: Any) -> Any:
    """A field the server writes only sometimes, and never as null: not required, its schema
    its plain type (without the `default: null` that None would write), plus `schema`."""

    def written(generated: dict[str, Any]) -> None:
        generated.pop("default", None)
        generated.update(schema)

    return Field(default=None, json_schema_extra=written)


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


# ---------------------------------------------------------------- model resources


class ResourceComputeConfig(Reply):
    num_generator_replicas: int
    device: str = Field(description="the device the engine runs on (posttrain's extra field)")
    gpu_type: Literal["H100-80GB", "B200-SXM"] = optional()


class MuonConfig(Reply):
    scaling_strategy: str


class OptimizerConfig(Reply):
    adam: dict = optional()
    muon: MuonConfig = optional()


class StatusDetails(Reply):
    queue_position: int = optional()


class ResourceError(ObjectError):
    code: ResourceErrorCode  # type: ignore[assignment]


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


class Wandb(Reply):
    entity: str = optional()
    group: str = optional()
    project: str = optional()
    run_id: str = optional()
    run_name: str = optional()
    url: str = optional()


class SessionMetadata(Reply):
    wandb: Wandb = optional()


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
    code: SessionErrorCode  # type: ignore[assignment]


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
