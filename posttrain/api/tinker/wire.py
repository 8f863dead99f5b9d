"""JSON bodies of the Tinker wire protocol as the SDK (tinker 0.38) sends them.

The SDK's own models are strict on its side; here unknown fields are ignored, since every body
carries a `type` discriminator and newer SDKs add optional fields, while every field posttrain
reads is validated with its type and range (a wrong one is a 400 naming it).

Imports: nothing from posttrain.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSession(Body):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None


class SessionRef(Body):
    session_id: str


class LoraIn(Body):
    rank: int = Field(ge=1)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfigIn(Body):
    model_config = ConfigDict(extra="allow")
    type: str = "adamw"


class CreateModel(Body):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraIn | None = None
    optimizer_config: OptimizerConfigIn = Field(default_factory=OptimizerConfigIn)


class ModelRef(Body):
    model_id: str


class AdamIn(Body):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStep(Body):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamIn | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeights(Body):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class SaveWeightsForSampler(Body):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class LoadWeights(Body):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool = False
    optimizer_config: OptimizerConfigIn | None = None


class CreateSamplingSession(Body):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class Chunk(Body):
    """A prompt chunk: encoded_text (`tokens`) or image (`data` base64, as the SDK's
    ImageChunk serializes it, `format`, `expected_tokens`)."""

    model_config = ConfigDict(extra="allow")
    type: str = "encoded_text"
    tokens: list[int] | None = None
    data: str | None = None
    format: str | None = None
    expected_tokens: int | None = None


class Prompt(Body):
    chunks: list[Chunk]


class SamplingParamsIn(Body):
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0, le=1)


class Sample(Body):
    sampling_session_id: str | None = None
    seq_id: int | None = None
    base_model: str | None = None
    model_path: str | None = None
    num_samples: int = Field(1, ge=1)
    prompt: Prompt
    sampling_params: SamplingParamsIn
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(0, ge=0)
    topk_sample_logprobs: int = Field(0, ge=0)
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = Field(0, ge=0)
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


class RetrieveFuture(Body):
    request_id: str
    allow_metadata_only: bool = False


class WeightsInfo(Body):
    tinker_path: str


class Ttl(Body):
    ttl_seconds: int | None = None
