"""What the store keeps of each API object: model resources, sessions, operations and
checkpoints as the service reads and writes them, with their lifecycle status.

Apart from types.py (what requests and results carry) because these are the store's and the
service's shapes, not the wire's: a record names the object's owner, times and status.
Imports: statuses, types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.statuses import OperationErrorCode, OperationStatus, ResourceStatus, SessionStatus
from posttrain.types import (
    CheckpointRef,
    CheckpointType,
    LoraConfig,
    MuonScaling,
    OperationKind,
    OperationOutput,
)


@dataclass(frozen=True)
class ErrorInfo:
    code: str
    message: str
    occurred_at: float


@dataclass(frozen=True)
class ResourceRecord:
    id: str
    base_model: str
    created_by: str
    created_at: float
    updated_at: float
    status: ResourceStatus
    lora_enabled: bool = True
    num_generator_replicas: int = 1
    gpu_type: str = ""
    inactive_timeout: int = 3600
    # None: Adam; otherwise the Muon scaling strategy.
    muon_scaling: MuonScaling | None = None
    expires_at: float | None = None
    error: ErrorInfo | None = None


@dataclass(frozen=True)
class PolicyState:
    trainer_step: int = 0
    target_weights_version: int = 0
    applied_weights_version: int = 0
    pending_publish: bool = False


@dataclass(frozen=True)
class SessionRecord:
    id: str
    resource_id: str
    base_model: str
    created_by: str
    created_at: float
    updated_at: float
    status: SessionStatus
    step: int = 0
    policy_state: PolicyState = field(default_factory=PolicyState)
    display_name: str | None = None
    metadata: dict[str, dict[str, str]] = field(default_factory=dict)
    lora_config: LoraConfig | None = None
    resume_from_checkpoint_id: str | None = None
    training_checkpoints: tuple[CheckpointRef, ...] = ()
    inference_checkpoints: tuple[CheckpointRef, ...] = ()
    error: ErrorInfo | None = None


@dataclass(frozen=True)
class OperationRecord:
    id: str
    session_id: str
    kind: OperationKind
    status: OperationStatus
    created_at: float
    updated_at: float
    idempotency_key: str | None  # None: submitted without one, never deduplicated
    fingerprint: str
    created_by: str
    # The result once COMPLETED (its type follows `kind`, OPERATION_TYPES).
    output: OperationOutput | None = None
    error_code: OperationErrorCode | None = None
    error_message: str | None = None


@dataclass(frozen=True)
class CheckpointRecord:
    id: str
    session_id: str
    base_model: str
    created_by: str
    created_at: float
    type: CheckpointType
    step: int
    path: str
    lora_rank: int | None = None
    # The producing session's effective LoRA config (None for full-weight checkpoints): a
    # resumed session takes the fields its request leaves out from here.
    lora_config: LoraConfig | None = None
