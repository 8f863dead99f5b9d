"""Wire models of optim-step, weights-sync and sample (api.md 1.4.3 to 1.4.6).

Imports: api.schemas.wire, api.schemas.samples, types, errors.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from posttrain.api.schemas.samples import (
    ModelInputIn,
)
from posttrain.api.schemas.wire import Int64, Lenient, Wire, given_fields
from posttrain.errors import InvalidRequest
from posttrain.types import (
    MAX_TOPK_PROMPT_LOGPROBS,
    AdamParams,
    MuonParams,
    OptimStepRequest,
    SampleRequest,
    SamplingParams,
    WeightsSyncRequest,
    WeightSyncType,
)


class AdamParamsIn(Wire):
    learning_rate: float | None = Field(None, ge=0)
    beta1: float | None = Field(None, ge=0, lt=1)
    beta2: float | None = Field(None, ge=0, lt=1)
    eps: float | None = Field(None, gt=0)
    weight_decay: float | None = Field(None, ge=0)
    grad_clip_norm: float | None = Field(None, ge=0)

    def to_domain(self) -> AdamParams:
        return AdamParams(**self.model_dump(exclude_none=True))


class MuonParamsIn(Wire):
    learning_rate: float | None = Field(None, ge=0)
    momentum: float | None = Field(None, ge=0, lt=1)
    newton_schulz_steps: int | None = Field(None, ge=1)
    weight_decay: float | None = Field(None, ge=0)
    grad_clip_norm: float | None = Field(None, ge=0)
    adam: AdamParamsIn | None = None

    def to_domain(self) -> MuonParams:
        given = self.model_dump(exclude_none=True, exclude={"adam"})
        adam = self.adam.to_domain() if self.adam is not None else None
        return MuonParams(**given, adam=adam)


class AdamwParamsIn(Wire):
    """April-era optim-step fields (api.md 5.5)."""

    beta1: float | None = Field(None, ge=0, lt=1)
    beta2: float | None = Field(None, ge=0, lt=1)
    eps: float | None = Field(None, gt=0)
    weight_decay: float | None = Field(None, ge=0)


class OptimStepIn(Lenient):
    adam_params: AdamParamsIn | None = None
    muon_params: MuonParamsIn | None = None
    learning_rate: float | None = Field(None, ge=0)
    adamw_params: AdamwParamsIn | None = None

    def to_domain(self) -> OptimStepRequest:
        if self.adam_params is not None and self.muon_params is not None:
            raise InvalidRequest("send adam_params or muon_params, not both", param="muon_params")
        adam = self.adam_params
        if self.learning_rate is not None or self.adamw_params is not None:
            # Fold the April shape into adam_params; explicit adam_params fields win.
            folded = given_fields(self.adamw_params)
            if self.learning_rate is not None:
                folded["learning_rate"] = self.learning_rate
            folded.update(given_fields(adam))
            adam = AdamParamsIn(**folded)
        return OptimStepRequest(
            adam=adam.to_domain() if adam is not None else None,
            muon=self.muon_params.to_domain() if self.muon_params is not None else None,
        )


class WeightsSyncIn(Wire):
    weight_sync_type: str

    def to_domain(self) -> WeightsSyncRequest:
        try:
            return WeightsSyncRequest(WeightSyncType(self.weight_sync_type))
        except ValueError:
            known = ", ".join(t.value for t in WeightSyncType)
            raise InvalidRequest(
                f"unknown weight_sync_type {self.weight_sync_type!r}; known: {known}",
                param="weight_sync_type",
            ) from None


# ---------------------------------------------------------------- sample


class SamplingParamsIn(Wire):
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: Int64 | None = None
    stop: list[str] | None = None


class SampleIn(Wire):
    model_inputs: list[ModelInputIn] | None = None
    prompts: list[ModelInputIn] | None = None  # April-era alias (api.md 5.6)
    num_samples: int | None = Field(None, ge=1)
    sampling_params: SamplingParamsIn | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOPK_PROMPT_LOGPROBS)
    return_routed_experts: bool | None = None
    payload_id: str | None = None

    def to_domain(self, *, max_tokens: int, temperature: float, num_samples: int) -> SampleRequest:
        inputs = self.model_inputs if self.model_inputs is not None else self.prompts
        if not inputs:
            raise InvalidRequest("model_inputs must hold at least one prompt", param="model_inputs")
        prompts = tuple(m.tokens() for m in inputs)
        for index, prompt in enumerate(prompts):
            if not prompt:
                raise InvalidRequest(
                    f"model_inputs[{index}] is empty", param=f"model_inputs[{index}]"
                )
        given = given_fields(self.sampling_params)
        given.setdefault("max_tokens", max_tokens)
        given.setdefault("temperature", temperature)
        if given.get("top_k") == 0:
            given["top_k"] = -1  # 0 and -1 both mean disabled (api.md 1.4.6)
        given["stop"] = tuple(given.get("stop", ()))
        if any(s == "" for s in given["stop"]):
            raise InvalidRequest("stop strings must be non-empty", param="sampling_params.stop")
        return SampleRequest(
            prompts=prompts,
            num_samples=self.num_samples or num_samples,
            sampling_params=SamplingParams(**given),
            prompt_logprobs=bool(self.prompt_logprobs),
            topk_prompt_logprobs=self.topk_prompt_logprobs or 0,
            return_routed_experts=bool(self.return_routed_experts),
        )


OperationBody = Literal[
    "forward-backward",
    "custom-forward-backward",
    "optim-step",
    "weights-sync",
    "sample",
    "training-checkpoint",
    "inference-checkpoint",
]
