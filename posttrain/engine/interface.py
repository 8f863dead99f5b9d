"""The Engine protocol the service depends on, and the limits it reports per base model.

`local.LocalEngine` is the reference implementation; distributed engines implement the same
protocol later. Imports: types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from posttrain.types import (
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoraConfig,
    MuonScaling,
    OptimStepRequest,
    SampleRequest,
    SampleResult,
)


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    context_length: int  # prompt + completion tokens a sample request may span
    max_seq_length: int  # tokens of one training sample (N + 1)
    max_batch_size: int
    max_lora_rank: int


class Engine(Protocol):
    def model_info(self, base_model: str) -> ModelInfo: ...

    def load_resource(
        self, resource_id: str, base_model: str, *, muon_scaling: MuonScaling | None
    ) -> None: ...

    def unload_resource(self, resource_id: str) -> None: ...

    def is_loaded(self, resource_id: str) -> bool: ...

    def create_session(self, resource_id: str, session_id: str, lora: LoraConfig) -> None: ...

    def drop_session(self, resource_id: str, session_id: str) -> None: ...

    def validate_forward_backward(self, request: ForwardBackwardRequest) -> None: ...

    def forward_backward(
        self, resource_id: str, session_id: str, request: ForwardBackwardRequest
    ) -> ForwardBackwardResult: ...

    def custom_forward_backward(
        self, resource_id: str, session_id: str, request: CustomForwardBackwardRequest
    ) -> None: ...

    def optim_step(self, resource_id: str, session_id: str, request: OptimStepRequest) -> None: ...

    def publish(self, resource_id: str, session_id: str) -> None: ...

    def sample(
        self, resource_id: str, session_id: str, request: SampleRequest, *, version: int
    ) -> list[SampleResult]: ...

    def check_tokens(self, base_model: str, tokens: tuple[int, ...], param: str) -> None: ...
