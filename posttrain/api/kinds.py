"""The api layer's half of the operation-kind table: per kind, the wire body it takes, the
reply it answers with, and how the body becomes the kind's typed request.

The typed request and output types are types.OPERATION_TYPES; what the service does with a
kind (scheduling, durability, restart) is service/operations/kinds.py. The routes
(routes/operations.py)
and the OpenAPI document read this table instead of branching on the kind.

Imports: api.schemas, api.deps, config, types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from posttrain.api.deps import parse
from posttrain.api.schemas.losses import CustomForwardBackwardIn, ForwardBackwardIn
from posttrain.api.schemas.outputs import (
    CustomForwardBackwardOperation,
    ForwardBackwardOperation,
    InferenceCheckpointOperation,
    OperationReply,
    OptimStepOperation,
    SampleOperation,
    TrainingCheckpointOperation,
    WeightsSyncOperation,
)
from posttrain.api.schemas.steps import OptimStepIn, SampleIn, WeightsSyncIn
from posttrain.config import SamplerConfig
from posttrain.errors import InvalidRequest
from posttrain.types import (
    CheckpointRequest,
    CheckpointType,
    OperationKind,
    OperationRequest,
)

# (the body as JSON, the server's sampling defaults) -> the typed request
ToRequest = Callable[[dict[str, Any], SamplerConfig], OperationRequest]


@dataclass(frozen=True)
class WireKind:
    reply: type[OperationReply]
    to_request: ToRequest
    body: type[BaseModel] | None = None  # None: the kind takes no body
    # optim-step: `{}` or nothing at all means the defaults.
    is_body_required: bool = True


def _parsed(model: type[Any]) -> ToRequest:
    return lambda body, _: parse(model, body).to_domain()


def _sample(body: dict[str, Any], sampler: SamplerConfig) -> OperationRequest:
    return parse(SampleIn, body).to_domain(
        max_tokens=sampler.max_tokens,
        temperature=sampler.temperature,
        num_samples=sampler.num_samples,
    )


def _checkpoint(kind: OperationKind, checkpoint_type: CheckpointType) -> ToRequest:
    def to_request(body: dict[str, Any], _: SamplerConfig) -> OperationRequest:
        if body:  # these operations take no body (api.md 1.4.7, 1.4.8)
            field = next(iter(body))
            raise InvalidRequest(f"{field}: unknown field; {kind} takes no body", param=field)
        return CheckpointRequest(checkpoint_type)

    return to_request


WIRE_KINDS: dict[OperationKind, WireKind] = {
    OperationKind.FORWARD_BACKWARD: WireKind(
        ForwardBackwardOperation, _parsed(ForwardBackwardIn), ForwardBackwardIn
    ),
    OperationKind.CUSTOM_FORWARD_BACKWARD: WireKind(
        CustomForwardBackwardOperation, _parsed(CustomForwardBackwardIn), CustomForwardBackwardIn
    ),
    OperationKind.OPTIM_STEP: WireKind(
        OptimStepOperation, _parsed(OptimStepIn), OptimStepIn, is_body_required=False
    ),
    OperationKind.WEIGHTS_SYNC: WireKind(
        WeightsSyncOperation, _parsed(WeightsSyncIn), WeightsSyncIn
    ),
    OperationKind.SAMPLE: WireKind(SampleOperation, _sample, SampleIn),
    OperationKind.TRAINING_CHECKPOINT: WireKind(
        TrainingCheckpointOperation,
        _checkpoint(OperationKind.TRAINING_CHECKPOINT, CheckpointType.TRAINING),
    ),
    OperationKind.INFERENCE_CHECKPOINT: WireKind(
        InferenceCheckpointOperation,
        _checkpoint(OperationKind.INFERENCE_CHECKPOINT, CheckpointType.INFERENCE),
    ),
}
