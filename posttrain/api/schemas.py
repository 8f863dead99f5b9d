"""Wire request models that mirror the SDK's JSON, and their conversion to domain types.

Requests: pydantic models (errors name the field). int64 fields accept integers or numeric
strings (protobuf JSON mapping); explicit nulls mean "absent" (api.md 0.3). Everything is
normalised here into posttrain.types, once; the service never sees a wire object.

Training requests arrive in the 3.1.1 shape or in a seed-era one (api.md 5: `loss_inputs` with
per-loss inputs blocks, `D_TYPE_*` dtypes, a missing `loss.type`, April `grpo_params` epsilons,
early `loss_fn` strings); both normalise to the same ForwardBackwardRequest or
CustomForwardBackwardRequest (algorithm of api.md 5.8). Checks that need only the body run here
and name the field the client sent, per sample; parameter ranges and input values are checked
by engine/losses.py at submit, limits that need the model by the service.

Imports: types, errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

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
    LossParams,
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
    # Range checked by ResourceService against config.min_inactive_timeout_s (api.md 1.2).
    inactive_timeout: int | None = None
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
#
# Two sample shapes arrive (api.md 5.2): 3.1.1 `loss_fn_inputs`, a map of TensorData, and the
# seed-era `loss_inputs`, a fixed structure with one inputs block per loss. Both become the same
# TrainingSample; every error names the field the client actually sent.


class EncodedTextIn(Wire):
    tokens: list[Int64]


class ChunkIn(Wire):
    encoded_text: EncodedTextIn


class ModelInputIn(Wire):
    chunks: list[ChunkIn]

    def tokens(self) -> tuple[int, ...]:
        return tuple(t for chunk in self.chunks for t in chunk.encoded_text.tokens)


# The dtype each loss_fn_inputs key may carry (api.md 4.4), and its default when none is sent.
KEY_DTYPES = {
    "target_tokens": {"int64"},
    "logprobs": {"float32"},
    "advantages": {"float32"},
    "reference_logprobs": {"float32"},
    "weights": {"int64", "float32"},
    "mask": {"int64", "float32"},
}
DEFAULT_DTYPES = {"target_tokens": "int64"}


def _dtype(name: str | None, key: str, param: str) -> str:
    """3.1.1 `int64`/`float32`, or a seed-era `D_TYPE_*` name in any case (api.md 5.3)."""
    spelling = (name or "unspecified").lower().removeprefix("d_type_")
    if spelling == "unspecified":
        return DEFAULT_DTYPES.get(key, "float32")
    if spelling == "bfloat16":
        return "float32"  # the values are JSON numbers either way
    if spelling not in ("int64", "float32"):
        raise InvalidRequest(f"unknown dtype {name!r}", param=f"{param}.dtype")
    return spelling


class TensorIn(Wire):
    """TensorData (api.md 4.1); seed-era tensors have the same fields."""

    data: list[float | int | str]
    dtype: str | None = None
    shape: list[Int64] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class PolicySegmentIn(Wire):
    version: Int64
    start_token: Int64 | None = None


class PolicyInputsIn(Wire):
    """A seed-era per-loss block: importance_sampling_inputs, ppo_inputs, cispo_inputs,
    dro_inputs or dppo_inputs."""

    advantages: TensorIn | None = None
    logprobs: TensorIn | None = None

    def sent(self, path: str) -> dict[str, tuple[TensorIn, str]]:
        """3.1.1 key -> (tensor, the field path it was sent under)."""
        fields = {"advantages": self.advantages, "logprobs": self.logprobs}
        return {k: (t, f"{path}.{k}") for k, t in fields.items() if t is not None}


class GrpoInputsIn(PolicyInputsIn):
    generator_logprobs: TensorIn | None = None  # April spelling of logprobs
    reference_logprobs: TensorIn | None = None

    def sent(self, path: str) -> dict[str, tuple[TensorIn, str]]:
        out = super().sent(path)
        if self.generator_logprobs is not None:
            if self.logprobs is not None:
                raise InvalidRequest(
                    "send logprobs or generator_logprobs, not both",
                    param=f"{path}.generator_logprobs",
                )
            out["logprobs"] = (self.generator_logprobs, f"{path}.generator_logprobs")
        if self.reference_logprobs is not None:
            out["reference_logprobs"] = (self.reference_logprobs, f"{path}.reference_logprobs")
        return out


# The seed-era inputs block each policy loss reads (api.md 5.2).
INPUTS_BLOCKS = {
    LossType.IMPORTANCE_SAMPLING: "importance_sampling_inputs",
    LossType.PPO: "ppo_inputs",
    LossType.CISPO: "cispo_inputs",
    LossType.DRO: "dro_inputs",
    LossType.DPPO: "dppo_inputs",
    LossType.GRPO: "grpo_inputs",
}


class LossInputsIn(Wire):
    """Seed-era structured inputs (api.md 5.2)."""

    target_tokens: TensorIn | None = None
    weights: TensorIn | None = None
    loss_mask: TensorIn | None = None  # April
    grpo_inputs: GrpoInputsIn | None = None
    importance_sampling_inputs: PolicyInputsIn | None = None
    ppo_inputs: PolicyInputsIn | None = None
    cispo_inputs: PolicyInputsIn | None = None
    dro_inputs: PolicyInputsIn | None = None
    # The seeds name dppo_params but no dppo_inputs; accepted for symmetry (api.md 5.2).
    dppo_inputs: PolicyInputsIn | None = None
    routed_experts: dict[str, Any] | None = None

    def blocks(self) -> dict[LossType, PolicyInputsIn]:
        """The per-loss blocks this sample sent, by the loss each belongs to."""
        named = {
            LossType.IMPORTANCE_SAMPLING: self.importance_sampling_inputs,
            LossType.PPO: self.ppo_inputs,
            LossType.CISPO: self.cispo_inputs,
            LossType.DRO: self.dro_inputs,
            LossType.DPPO: self.dppo_inputs,
            LossType.GRPO: self.grpo_inputs,
        }
        return {loss_type: block for loss_type, block in named.items() if block is not None}

    def sent(self, path: str, loss_type: LossType | None) -> dict[str, tuple[TensorIn, str]]:
        """3.1.1 key -> (tensor, field path) for a request whose loss is `loss_type` (None:
        custom-forward-backward, which reads no inputs block)."""
        if self.routed_experts is not None:
            raise InvalidRequest(
                "routed_experts is only meaningful for mixture-of-experts models",
                param=f"{path}.routed_experts",
            )
        fields = {"target_tokens": self.target_tokens, "weights": self.weights}
        out = {k: (t, f"{path}.{k}") for k, t in fields.items() if t is not None}
        if self.loss_mask is not None:
            # Cross-entropy takes no mask (api.md 4.4); a 0/1 loss_mask means 0/1 weights there.
            key = "weights" if loss_type == LossType.CROSS_ENTROPY else "mask"
            if "weights" in out:
                raise InvalidRequest(
                    "send weights or loss_mask, not both", param=f"{path}.loss_mask"
                )
            out[key] = (self.loss_mask, f"{path}.loss_mask")
        if loss_type is None or loss_type not in INPUTS_BLOCKS:
            return out  # CE and custom-forward-backward read no block; others are ignored
        block_name = INPUTS_BLOCKS[loss_type]
        block = self.blocks().get(loss_type)
        if block is None:
            raise InvalidRequest(
                f"{loss_type.value} reads its inputs from loss_inputs.{block_name}",
                param=f"{path}.{block_name}",
            )
        return {**out, **block.sent(f"{path}.{block_name}")}


class TrainingSampleIn(Wire):
    model_input: ModelInputIn
    loss_fn_inputs: dict[str, TensorIn] | None = None
    loss_inputs: LossInputsIn | None = None  # seed era (api.md 5.2)
    routed_experts_key: str | None = None
    # Seed era: which policy versions produced the tokens. Accepted and ignored (api.md 5.2).
    policy_segments: list[PolicySegmentIn] | None = None

    def sent(self, where: str, loss_type: LossType | None) -> dict[str, tuple[TensorIn, str]]:
        if (self.loss_fn_inputs is None) == (self.loss_inputs is None):
            raise InvalidRequest(
                "a sample needs exactly one of loss_fn_inputs and loss_inputs (seed era)",
                param=f"{where}.loss_fn_inputs",
            )
        if self.loss_inputs is not None:
            return self.loss_inputs.sent(f"{where}.loss_inputs", loss_type)
        assert self.loss_fn_inputs is not None
        return {k: (t, f"{where}.loss_fn_inputs.{k}") for k, t in self.loss_fn_inputs.items()}

    def param_of(self, where: str, key: str, loss_type: LossType | None) -> str:
        """Where `key` belongs in this sample's shape: for errors about a missing input."""
        if self.loss_inputs is None:
            return f"{where}.loss_fn_inputs.{key}"
        if loss_type is None or key in ("target_tokens", "weights"):
            return f"{where}.loss_inputs.{key}"
        return f"{where}.loss_inputs.{INPUTS_BLOCKS[loss_type]}.{key}"


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


def _tensor_values(key: str, tensor: TensorIn, param: str, num_tokens: int) -> tuple[float, ...]:
    """One loss input as numbers, after the checks of api.md 4.1 and 4.2."""
    if tensor.sparse_crow_indices is not None or tensor.sparse_col_indices is not None:
        raise InvalidRequest("sparse tensors are not supported", param=param)
    dtype = _dtype(tensor.dtype, key, param)
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
    if len(tensor.data) != num_tokens:
        raise InvalidRequest(
            f"{key} has {len(tensor.data)} values, model_input has {num_tokens} tokens",
            param=param,
        )
    return _numbers(tensor.data, param, integral=dtype == "int64")


def sample_to_domain(
    sample: TrainingSampleIn, index: int, loss_type: LossType | None
) -> TrainingSample:
    """One sample in either shape -> TrainingSample. `loss_type` picks the seed-era inputs
    block (None for custom-forward-backward)."""
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
    for key, (tensor, param) in sample.sent(where, loss_type).items():
        if key not in LOSS_FN_INPUT_KEYS:
            known = ", ".join(sorted(LOSS_FN_INPUT_KEYS))
            raise InvalidRequest(f"unknown loss_fn_inputs key {key!r}; known: {known}", param=param)
        inputs[key] = _tensor_values(key, tensor, param, len(tokens))
    if "target_tokens" not in inputs:
        raise InvalidRequest(
            "target_tokens is required", param=sample.param_of(where, "target_tokens", None)
        )
    if "weights" in inputs and "mask" in inputs:
        raise InvalidRequest("send weights or mask, not both", param=f"{where}.loss_fn_inputs.mask")
    return TrainingSample(tokens=tokens, loss_fn_inputs=inputs)


# Inputs every sample must send, per loss: the SDK's own table (api.md 4.4). GRPO also needs
# reference_logprobs when beta > 0. engine/losses.py holds the same table for the engine (the
# api layer cannot import it); a unit test keeps the two equal.
_POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")
REQUIRED_INPUTS: dict[LossType, tuple[str, ...]] = {
    LossType.CROSS_ENTROPY: ("target_tokens", "weights"),
    LossType.IMPORTANCE_SAMPLING: _POLICY_INPUTS,
    LossType.PPO: _POLICY_INPUTS,
    LossType.CISPO: _POLICY_INPUTS,
    LossType.DRO: _POLICY_INPUTS,
    LossType.DPPO: _POLICY_INPUTS,
    LossType.GRPO: _POLICY_INPUTS,
}


def check_required_inputs(
    loss: LossConfig, wire: list[TrainingSampleIn], samples: tuple[TrainingSample, ...]
) -> None:
    """Per sample, so the error names the sample that lacks an input (api.md 4.4)."""
    required = REQUIRED_INPUTS[loss.type]
    if isinstance(loss.params, GrpoParams) and loss.params.beta > 0:
        required = (*required, "reference_logprobs")
    for index, (sample_in, sample) in enumerate(zip(wire, samples, strict=True)):
        for key in required:
            if key not in sample.loss_fn_inputs:
                why = " with beta > 0" if key == "reference_logprobs" else ""
                raise InvalidRequest(
                    f"{loss.type.value}{why} requires {key} in every sample",
                    param=sample_in.param_of(f"samples[{index}]", key, loss.type),
                )


# ---------------------------------------------------------------- losses


class CrossEntropyParamsIn(Wire):
    """Has no fields (api.md 1.7.3)."""


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
    # April: relative epsilons, threshold = 1 - clip_low and 1 + clip_high (api.md 5.4).
    clip_low: float | None = None
    clip_high: float | None = None


class LossConfigIn(Wire):
    type: str | None = None  # seed era: may be missing, then inferred (api.md 5.2)
    cross_entropy_params: CrossEntropyParamsIn | None = None
    grpo_params: GrpoParamsIn | None = None
    ppo_params: PpoParamsIn | None = None
    cispo_params: PpoParamsIn | None = None
    dro_params: DroParamsIn | None = None
    dppo_params: DppoParamsIn | None = None

    def params_sent(self) -> dict[LossType, str]:
        """The params objects present, by the loss each belongs to -> its field name."""
        blocks = {
            LossType.CROSS_ENTROPY: ("cross_entropy_params", self.cross_entropy_params),
            LossType.GRPO: ("grpo_params", self.grpo_params),
            LossType.PPO: ("ppo_params", self.ppo_params),
            LossType.CISPO: ("cispo_params", self.cispo_params),
            LossType.DRO: ("dro_params", self.dro_params),
            LossType.DPPO: ("dppo_params", self.dppo_params),
        }
        return {t: name for t, (name, block) in blocks.items() if block is not None}


# The params field of each loss (IMPORTANCE_SAMPLING has none).
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


def parse_loss_type(name: str, param: str) -> LossType:
    """`LOSS_TYPE_*`, or a short name such as `ppo` (losses.md 1.2, api.md 5.4)."""
    spelling = name if name.startswith("LOSS_TYPE_") else f"LOSS_TYPE_{name.upper()}"
    try:
        return LossType(spelling)
    except ValueError:
        known = ", ".join(t.value for t in LossType)
        raise InvalidRequest(f"unknown loss type {name!r}; known: {known}", param=param) from None


def infer_loss_type(loss: LossConfigIn, samples: list[TrainingSampleIn]) -> LossType:
    """loss.type, or when it is missing (seed era, api.md 5.2): the loss of the single params
    object, else of the single inputs block the samples send, else cross-entropy when the
    samples carry only target_tokens and weights."""
    if loss.type is not None:
        return parse_loss_type(loss.type, "loss.type")
    from_params = loss.params_sent()
    if len(from_params) > 1:
        raise InvalidRequest(
            f"loss.type is missing and loss holds several params objects"
            f" ({', '.join(sorted(from_params.values()))}); set loss.type",
            param="loss.type",
        )
    if from_params:
        return next(iter(from_params))
    from_blocks = {t for s in samples if s.loss_inputs is not None for t in s.loss_inputs.blocks()}
    if len(from_blocks) > 1:
        names = ", ".join(sorted(INPUTS_BLOCKS[t] for t in from_blocks))
        raise InvalidRequest(
            f"loss.type is missing and the samples send several inputs blocks ({names});"
            " set loss.type",
            param="loss.type",
        )
    if from_blocks:
        return next(iter(from_blocks))
    for index, sample in enumerate(samples):
        extra = set(sample.loss_fn_inputs or {}) - {"target_tokens", "weights"}
        if extra:
            raise InvalidRequest(
                f"loss.type is missing and samples[{index}] sends {', '.join(sorted(extra))},"
                " which cross-entropy does not read; set loss.type",
                param="loss.type",
            )
    return LossType.CROSS_ENTROPY


def _april_epsilon(given: dict[str, Any], epsilon: str, threshold: str, sign: float) -> None:
    """Replace an April clip epsilon by its absolute threshold 1 + sign * epsilon, in place."""
    if epsilon not in given:
        return
    param = f"loss.grpo_params.{epsilon}"
    if threshold in given:
        raise InvalidRequest(f"send {epsilon} or {threshold}, not both", param=param)
    value = given.pop(epsilon)
    upper = 1.0 if sign < 0 else math.inf  # keeps clip_low_threshold in [0, 1]
    if not (math.isfinite(value) and 0.0 <= value <= upper):
        bound = "in [0, 1]" if sign < 0 else ">= 0"
        raise InvalidRequest(f"{param} must be finite and {bound}, got {value}", param=param)
    given[threshold] = 1.0 + sign * value


_E = TypeVar("_E", GrpoAggregation, GrpoRatioType)


def _grpo_enum(enum: type[_E], value: str | None, default: _E, param: str) -> _E:
    """An enum field of grpo_params; absent or *_UNSPECIFIED means the default."""
    if value is None or value.endswith("_UNSPECIFIED"):
        return default
    try:
        return enum(value)
    except ValueError:
        known = ", ".join(e.value for e in enum)
        raise InvalidRequest(f"unknown value {value!r}; known: {known}", param=param) from None


def _grpo_params(loss: LossConfigIn) -> GrpoParams:
    given = _given(loss.grpo_params)
    _april_epsilon(given, "clip_low", "clip_low_threshold", -1.0)
    _april_epsilon(given, "clip_high", "clip_high_threshold", +1.0)
    agg = given.pop("agg_type", None)
    ratio = given.pop("ratio_type", None)
    return GrpoParams(
        **given,
        agg_type=_grpo_enum(
            GrpoAggregation, agg, GrpoAggregation.FIXED_HORIZON, "loss.grpo_params.agg_type"
        ),
        ratio_type=_grpo_enum(
            GrpoRatioType, ratio, GrpoRatioType.TOKEN, "loss.grpo_params.ratio_type"
        ),
    )


def _dro_params(loss: LossConfigIn) -> DroParams:
    given = _given(loss.dro_params)
    if "beta" not in given:
        raise InvalidRequest(
            "LOSS_TYPE_DRO requires dro_params.beta (no default)", param="loss.dro_params.beta"
        )
    return DroParams(**given)


# Per loss: its domain params from the wire config (defaults where a field is omitted).
_PARAMS_BUILDERS: dict[LossType, Callable[[LossConfigIn], LossParams]] = {
    LossType.CROSS_ENTROPY: lambda loss: None,
    LossType.IMPORTANCE_SAMPLING: lambda loss: None,
    LossType.PPO: lambda loss: PpoParams(**_given(loss.ppo_params)),
    LossType.CISPO: lambda loss: CispoParams(**_given(loss.cispo_params)),
    LossType.DRO: _dro_params,
    LossType.DPPO: lambda loss: DppoParams(**_given(loss.dppo_params)),
    LossType.GRPO: _grpo_params,
}


def loss_to_domain(loss_type: LossType, loss: LossConfigIn) -> LossConfig:
    """The domain loss config; a params object of another loss is a 400 (losses.md 1.2).
    Parameter ranges are checked with the inputs (engine/losses.py) at submit."""
    for other, field_name in loss.params_sent().items():
        if other != loss_type:
            raise InvalidRequest(
                f"{field_name} does not apply to {loss_type.value}", param=f"loss.{field_name}"
            )
    return LossConfig(loss_type, _PARAMS_BUILDERS[loss_type](loss))


def _loss_from_loss_fn(loss_fn: str, config: dict[str, Any] | None) -> LossConfigIn:
    """Early-2026 `loss_fn` + `loss_fn_config` -> a loss config (api.md 5.4)."""
    loss_type = parse_loss_type(loss_fn, "loss_fn")
    body: dict[str, Any] = {"type": loss_type.value}
    if config:
        field_name = PARAMS_FIELD[loss_type]
        if field_name is None:
            raise InvalidRequest(
                f"{loss_type.value} takes no loss_fn_config", param="loss_fn_config"
            )
        body[field_name] = config
    try:
        return LossConfigIn.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        path = ".".join(str(p) for p in ("loss_fn_config", *first["loc"][1:]))
        raise InvalidRequest(f"{path}: {first['msg']}", param=path) from None


class ForwardBackwardIn(Wire):
    loss: LossConfigIn | None = None
    samples: list[TrainingSampleIn] = Field(min_length=1)
    forward_only: bool | None = None
    return_loss_fn_outputs: bool | None = None
    payload_id: str | None = None
    loss_fn: str | None = None  # early 2026, instead of loss (api.md 5.4)
    loss_fn_config: dict[str, Any] | None = None

    def loss_in(self) -> LossConfigIn:
        if self.loss_fn is None:
            if self.loss_fn_config is not None:
                raise InvalidRequest("loss_fn_config needs loss_fn", param="loss_fn_config")
            return self.loss if self.loss is not None else LossConfigIn()
        if self.loss is not None:
            raise InvalidRequest("send loss or loss_fn, not both", param="loss_fn")
        return _loss_from_loss_fn(self.loss_fn, self.loss_fn_config)

    def to_domain(self) -> ForwardBackwardRequest:
        loss_in = self.loss_in()
        loss_type = infer_loss_type(loss_in, self.samples)
        loss = loss_to_domain(loss_type, loss_in)
        samples = tuple(sample_to_domain(s, i, loss_type) for i, s in enumerate(self.samples))
        check_required_inputs(loss, self.samples, samples)
        return ForwardBackwardRequest(
            samples=samples,
            loss=loss,
            forward_only=bool(self.forward_only),
            return_loss_fn_outputs=bool(self.return_loss_fn_outputs),
        )


class GradientIn(Wire):
    data: list[float | int | str]
    dtype: str | None = None  # D_TYPE_* even in 3.1.1; absent means float32


class CustomForwardBackwardIn(Wire):
    samples: list[TrainingSampleIn] = Field(min_length=1)
    gradients: list[GradientIn]
    payload_id: str | None = None

    def to_domain(self) -> CustomForwardBackwardRequest:
        samples = tuple(sample_to_domain(s, i, None) for i, s in enumerate(self.samples))
        if len(self.gradients) != len(samples):
            raise InvalidRequest(
                f"gradients has {len(self.gradients)} entries, samples has {len(samples)}",
                param="gradients",
            )
        gradients = []
        for index, (gradient, sample) in enumerate(zip(self.gradients, samples, strict=True)):
            param = f"gradients[{index}].data"
            dtype = _dtype(gradient.dtype, "gradients", f"gradients[{index}]")
            if len(gradient.data) != len(sample.tokens):
                raise InvalidRequest(
                    f"{param} has {len(gradient.data)} values, samples[{index}] has"
                    f" {len(sample.tokens)} tokens",
                    param=param,
                )
            gradients.append(_numbers(gradient.data, param, integral=dtype == "int64"))
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
