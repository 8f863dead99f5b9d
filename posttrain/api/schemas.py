"""Wire request models that mirror the SDK's JSON, and their conversion to domain types.

Requests: pydantic models (errors name the field). int64 fields accept integers or numeric
strings (protobuf JSON mapping); explicit nulls mean "absent" (api.md 0.3). Everything is
normalised here into posttrain.types, once; the service never sees a wire object.

Imports: types, errors.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from posttrain.errors import InvalidRequest
from posttrain.types import (
    LOSS_FN_INPUT_KEYS,
    AdamParams,
    CispoParams,
    CustomForwardBackwardRequest,
    DppoParams,
    DroParams,
    ForwardBackwardRequest,
    GrpoAggregation,
    GrpoParams,
    GrpoRatioType,
    LoraConfig,
    LossConfig,
    LossType,
    MuonParams,
    MuonScaling,
    OptimStepRequest,
    PpoParams,
    SampleRequest,
    SamplingParams,
    TrainingSample,
    WeightsSyncRequest,
    WeightSyncType,
)


def _int64(value: Any) -> Any:
    """int64 arrives as a JSON integer or a numeric string."""
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    if isinstance(value, str):
        text = value.strip()
        if not text.lstrip("-").isdigit():
            raise ValueError(f"expected an integer, got {value!r}")
        return int(text)
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)
    return value


Int64 = Annotated[int, BeforeValidator(_int64)]


class Wire(BaseModel):
    """Request objects reject unknown fields, so a typo is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")


class Lenient(BaseModel):
    """Objects whose unknown fields are ignored (api.md 5.5 for optim-step)."""

    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------- resources and sessions


class ComputeConfigIn(Wire):
    gpu_type: str | None = None
    num_generator_replicas: int | None = Field(None, ge=0)


class MuonConfigIn(Wire):
    scaling_strategy: str | None = None


class OptimizerConfigIn(Wire):
    adam: dict | None = None
    muon: MuonConfigIn | None = None


class ResourceCreateIn(Wire):
    base_model: str
    base_weights_ref: str | None = None
    compute_config: ComputeConfigIn | None = None
    inactive_timeout: int | None = Field(None, ge=300, le=86400)
    lora_enabled: bool | None = None
    optimizer_config: OptimizerConfigIn | None = None

    def muon_scaling(self) -> MuonScaling | None:
        config = self.optimizer_config
        if config is None or config.muon is None:
            return None
        if config.adam is not None:
            raise InvalidRequest(
                "optimizer_config sets both adam and muon; choose one",
                param="optimizer_config",
            )
        strategy = config.muon.scaling_strategy or "MUON_SCALING_STRATEGY_UNSPECIFIED"
        spellings = {
            "MUON_SCALING_STRATEGY_UNSPECIFIED": MuonScaling.MATCH_ADAM,
            "MUON_SCALING_STRATEGY_MATCH_ADAM": MuonScaling.MATCH_ADAM,
            "MUON_SCALING_STRATEGY_MATCH_ADAMW": MuonScaling.MATCH_ADAM,
            "MUON_SCALING_STRATEGY_ORIGINAL": MuonScaling.ORIGINAL,
        }
        if strategy not in spellings:
            raise InvalidRequest(
                f"unknown scaling_strategy {strategy!r}",
                param="optimizer_config.muon.scaling_strategy",
            )
        return spellings[strategy]


class ExtendExpiryIn(Wire):
    seconds: int = Field(ge=60, le=86400)


class LoraConfigIn(Wire):
    rank: int | None = Field(None, ge=1)
    alpha: float | None = Field(None, gt=0)
    dropout: float | None = Field(None, ge=0, lt=1)
    seed: Int64 | None = None
    train_unembed: bool | None = None

    def to_domain(self, default_seed: int) -> LoraConfig:
        defaults = LoraConfig()
        rank = self.rank if self.rank is not None else defaults.rank
        return LoraConfig(
            rank=rank,
            alpha=self.alpha if self.alpha is not None else defaults.alpha,
            dropout=self.dropout if self.dropout is not None else defaults.dropout,
            seed=self.seed if self.seed is not None else default_seed,
            train_unembed=self.train_unembed if self.train_unembed is not None else True,
        )


class WandbIn(Wire):
    entity: str | None = None
    group: str | None = None
    project: str | None = None
    run_id: str | None = None
    run_name: str | None = None
    url: str | None = None


class MetadataIn(Wire):
    wandb: WandbIn | None = None

    def to_domain(self) -> dict[str, dict[str, str]]:
        if self.wandb is None:
            return {}
        return {"wandb": self.wandb.model_dump(exclude_none=True)}


class SessionCreateIn(Wire):
    model_resources_id: str
    display_name: str | None = None
    load_optimizer: bool | None = None
    lora_config: LoraConfigIn | None = None
    metadata: MetadataIn | None = None
    resume_from_checkpoint_id: str | None = None


class SessionUpdateIn(Wire):
    display_name: str | None = None
    metadata: MetadataIn | None = None


# ---------------------------------------------------------------- training samples


class EncodedTextIn(Wire):
    tokens: list[Int64]


class ChunkIn(Wire):
    encoded_text: EncodedTextIn


class ModelInputIn(Wire):
    chunks: list[ChunkIn]

    def tokens(self) -> tuple[int, ...]:
        return tuple(t for chunk in self.chunks for t in chunk.encoded_text.tokens)


DTYPE_NAMES = {
    "int64": "int64",
    "float32": "float32",
    "D_TYPE_INT64": "int64",
    "D_TYPE_FLOAT32": "float32",
    "D_TYPE_BFLOAT16": "float32",
    "d_type_int64": "int64",
    "d_type_float32": "float32",
}
KEY_DTYPES = {
    "target_tokens": {"int64"},
    "logprobs": {"float32"},
    "advantages": {"float32"},
    "reference_logprobs": {"float32"},
    "weights": {"int64", "float32"},
    "mask": {"int64", "float32"},
}
DEFAULT_DTYPES = {"target_tokens": "int64"}


class TensorIn(Wire):
    data: list[float | int | str]
    dtype: str | None = None
    shape: list[Int64] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class TrainingSampleIn(Wire):
    model_input: ModelInputIn
    loss_fn_inputs: dict[str, TensorIn]
    routed_experts_key: str | None = None


def _numbers(values: list[float | int | str], param: str, *, integral: bool) -> tuple[float, ...]:
    out: list[float] = []
    for index, value in enumerate(values):
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise InvalidRequest(f"{param}[{index}] is not a number", param=param) from None
        else:
            number = float(value)
        if not math.isfinite(number):
            raise InvalidRequest(f"{param}[{index}] is not finite", param=param)
        if integral and not number.is_integer():
            raise InvalidRequest(f"{param}[{index}] = {value} is not an integer", param=param)
        out.append(number)
    return tuple(out)


def sample_to_domain(sample: TrainingSampleIn, index: int) -> TrainingSample:
    tokens = sample.model_input.tokens()
    where = f"samples[{index}]"
    if not tokens:
        raise InvalidRequest(f"{where}.model_input has no tokens", param=f"{where}.model_input")
    if sample.routed_experts_key is not None:
        raise InvalidRequest(
            "routed_experts_key is only meaningful for mixture-of-experts models",
            param=f"{where}.routed_experts_key",
        )
    inputs: dict[str, tuple[float, ...]] = {}
    for key, tensor in sample.loss_fn_inputs.items():
        param = f"{where}.loss_fn_inputs.{key}"
        if key not in LOSS_FN_INPUT_KEYS:
            known = ", ".join(sorted(LOSS_FN_INPUT_KEYS))
            raise InvalidRequest(f"unknown loss_fn_inputs key {key!r}; known: {known}", param=param)
        if tensor.sparse_crow_indices is not None or tensor.sparse_col_indices is not None:
            raise InvalidRequest("sparse tensors are not supported", param=param)
        dtype = DTYPE_NAMES.get(tensor.dtype or "", None)
        if tensor.dtype in (None, "D_TYPE_UNSPECIFIED"):
            dtype = DEFAULT_DTYPES.get(key, "float32")
        if dtype is None:
            raise InvalidRequest(f"unknown dtype {tensor.dtype!r}", param=f"{param}.dtype")
        if dtype not in KEY_DTYPES[key]:
            raise InvalidRequest(
                f"{key} must be {' or '.join(sorted(KEY_DTYPES[key]))}, got {dtype}",
                param=f"{param}.dtype",
            )
        if tensor.shape is not None and tensor.shape != [len(tensor.data)]:
            raise InvalidRequest(
                f"shape {tensor.shape} must be [{len(tensor.data)}] (1-D only)",
                param=f"{param}.shape",
            )
        if len(tensor.data) != len(tokens):
            raise InvalidRequest(
                f"{key} has {len(tensor.data)} values, model_input has {len(tokens)} tokens",
                param=param,
            )
        inputs[key] = _numbers(tensor.data, param, integral=dtype == "int64")
    if "target_tokens" not in inputs:
        raise InvalidRequest(
            "loss_fn_inputs must contain target_tokens", param=f"{where}.loss_fn_inputs"
        )
    if "weights" in inputs and "mask" in inputs:
        raise InvalidRequest("send weights or mask, not both", param=f"{where}.loss_fn_inputs.mask")
    return TrainingSample(tokens=tokens, loss_fn_inputs=inputs)


# ---------------------------------------------------------------- losses


class PpoParamsIn(Wire):
    clip_low_threshold: float | None = None
    clip_high_threshold: float | None = None


class DroParamsIn(Wire):
    beta: float | None = None


class DppoParamsIn(Wire):
    delta_low: float | None = None
    delta_high: float | None = None


class GrpoParamsIn(Wire):
    clip_low_threshold: float | None = None
    clip_high_threshold: float | None = None
    beta: float | None = None
    agg_type: str | None = None
    ratio_type: str | None = None


class LossConfigIn(Wire):
    type: str
    cross_entropy_params: dict | None = None
    grpo_params: GrpoParamsIn | None = None
    ppo_params: PpoParamsIn | None = None
    cispo_params: PpoParamsIn | None = None
    dro_params: DroParamsIn | None = None
    dppo_params: DppoParamsIn | None = None


PARAMS_FIELD = {
    LossType.CROSS_ENTROPY: "cross_entropy_params",
    LossType.IMPORTANCE_SAMPLING: None,
    LossType.PPO: "ppo_params",
    LossType.CISPO: "cispo_params",
    LossType.DRO: "dro_params",
    LossType.DPPO: "dppo_params",
    LossType.GRPO: "grpo_params",
}


def _given(model: BaseModel | None) -> dict[str, Any]:
    return {} if model is None else model.model_dump(exclude_none=True)


def loss_to_domain(loss: LossConfigIn) -> LossConfig:
    try:
        loss_type = LossType(loss.type)
    except ValueError:
        known = ", ".join(t.value for t in LossType)
        raise InvalidRequest(
            f"unknown loss type {loss.type!r}; known: {known}", param="loss.type"
        ) from None
    own = PARAMS_FIELD[loss_type]
    for field_name in set(PARAMS_FIELD.values()) - {None, own}:
        if getattr(loss, field_name) is not None:  # type: ignore[arg-type]
            raise InvalidRequest(
                f"{field_name} does not apply to {loss_type.value}", param=f"loss.{field_name}"
            )
    if loss_type == LossType.PPO:
        return LossConfig(loss_type, PpoParams(**_given(loss.ppo_params)))
    if loss_type == LossType.CISPO:
        return LossConfig(loss_type, CispoParams(**_given(loss.cispo_params)))
    if loss_type == LossType.DRO:
        given = _given(loss.dro_params)
        if "beta" not in given:
            raise InvalidRequest(
                "LOSS_TYPE_DRO requires dro_params.beta (no default)", param="loss.dro_params.beta"
            )
        return LossConfig(loss_type, DroParams(**given))
    if loss_type == LossType.DPPO:
        return LossConfig(loss_type, DppoParams(**_given(loss.dppo_params)))
    if loss_type == LossType.GRPO:
        given = _given(loss.grpo_params)
        agg = given.pop("agg_type", "GRPO_LOSS_AGGREGATION_TYPE_UNSPECIFIED")
        ratio = given.pop("ratio_type", "GRPO_LOSS_RATIO_TYPE_UNSPECIFIED")
        try:
            agg_type = (
                GrpoAggregation.FIXED_HORIZON
                if agg == "GRPO_LOSS_AGGREGATION_TYPE_UNSPECIFIED"
                else GrpoAggregation(agg)
            )
            ratio_type = (
                GrpoRatioType.TOKEN
                if ratio == "GRPO_LOSS_RATIO_TYPE_UNSPECIFIED"
                else GrpoRatioType(ratio)
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="loss.grpo_params") from None
        return LossConfig(loss_type, GrpoParams(**given, agg_type=agg_type, ratio_type=ratio_type))
    return LossConfig(loss_type, None)


class ForwardBackwardIn(Wire):
    loss: LossConfigIn
    samples: list[TrainingSampleIn] = Field(min_length=1)
    forward_only: bool | None = None
    return_loss_fn_outputs: bool | None = None
    payload_id: str | None = None

    def to_domain(self) -> ForwardBackwardRequest:
        return ForwardBackwardRequest(
            samples=tuple(sample_to_domain(s, i) for i, s in enumerate(self.samples)),
            loss=loss_to_domain(self.loss),
            forward_only=bool(self.forward_only),
            return_loss_fn_outputs=bool(self.return_loss_fn_outputs),
        )


class GradientIn(Wire):
    data: list[float | int | str]
    dtype: str | None = None


class CustomForwardBackwardIn(Wire):
    samples: list[TrainingSampleIn] = Field(min_length=1)
    gradients: list[GradientIn]
    payload_id: str | None = None

    def to_domain(self) -> CustomForwardBackwardRequest:
        samples = tuple(sample_to_domain(s, i) for i, s in enumerate(self.samples))
        if len(self.gradients) != len(samples):
            raise InvalidRequest(
                f"gradients has {len(self.gradients)} entries, samples has {len(samples)}",
                param="gradients",
            )
        gradients = []
        for index, (gradient, sample) in enumerate(zip(self.gradients, samples, strict=True)):
            param = f"gradients[{index}].data"
            if len(gradient.data) != len(sample.tokens):
                raise InvalidRequest(
                    f"{param} has {len(gradient.data)} values, samples[{index}] has"
                    f" {len(sample.tokens)} tokens",
                    param=param,
                )
            gradients.append(_numbers(gradient.data, param, integral=False))
        return CustomForwardBackwardRequest(samples=samples, gradients=tuple(gradients))


# ---------------------------------------------------------------- optim-step


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
            folded = _given(self.adamw_params)
            if self.learning_rate is not None:
                folded["learning_rate"] = self.learning_rate
            folded.update(_given(adam))
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
    topk_prompt_logprobs: int | None = Field(None, ge=0, le=20)
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
        given = _given(self.sampling_params)
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
