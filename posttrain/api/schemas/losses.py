"""Loss configs and the forward-backward bodies (api.md 1.4.1, 1.4.2, 5).

The loss arrives in the 3.1.1 shape or a seed-era one (a missing `loss.type`, April
`grpo_params` epsilons, early `loss_fn` strings); both normalise to the same
ForwardBackwardRequest or CustomForwardBackwardRequest (algorithm of api.md 5.8). Here, once, a
forward-backward is checked against the loss table (posttrain/loss_specs.py): its params, the
inputs each sample must send and their values; the engine trusts the request it gets.

Imports: api.schemas.wire, api.schemas.samples, loss_specs, types, errors.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

from pydantic import ConfigDict, Field, ValidationError

from posttrain.api.schemas.samples import (
    TrainingSampleIn,
    check_required_inputs,
    parse_numbers,
    sample_to_domain,
    wire_dtype,
)
from posttrain.api.schemas.wire import Wire, given_fields
from posttrain.errors import InvalidRequest
from posttrain.loss_specs import (
    LOSS_SPECS,
    Dialect,
    check_input_values,
    check_params,
    loss_types,
    params_from_fields,
)
from posttrain.types import (
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    GrpoAggregation,
    GrpoRatioType,
    LossConfig,
    LossParams,
    LossType,
)


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
        """The params objects present, in field order, by the loss each belongs to -> its
        field name."""
        return {
            _LOSS_OF_PARAMS[name]: name
            for name in type(self).model_fields
            if name in _LOSS_OF_PARAMS and getattr(self, name) is not None
        }


_LOSS_OF_PARAMS = {s.params_field: t for t, s in LOSS_SPECS.items() if s.params_field is not None}


def parse_loss_type(name: str, param: str) -> LossType:
    """`LOSS_TYPE_*`, or a short name such as `ppo` (losses.md 1.2, api.md 5.4)."""
    spelling = name if name.startswith("LOSS_TYPE_") else f"LOSS_TYPE_{name.upper()}"
    known_types = loss_types(Dialect.TOGETHER)  # GSPO is the Tinker surface's only
    if spelling not in known_types:
        known = ", ".join(t.value for t in known_types)
        raise InvalidRequest(f"unknown loss type {name!r}; known: {known}", param=param)
    return LossType(spelling)


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
        names = ", ".join(sorted(str(LOSS_SPECS[t].inputs_block) for t in from_blocks))
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


def _grpo_fields(given: dict[str, Any]) -> dict[str, Any]:
    """grpo_params' wire spellings -> GrpoParams fields: April epsilons become thresholds and
    the enums are parsed (absent or *_UNSPECIFIED: the default)."""
    _april_epsilon(given, "clip_low", "clip_low_threshold", -1.0)
    _april_epsilon(given, "clip_high", "clip_high_threshold", +1.0)
    agg = given.pop("agg_type", None)
    ratio = given.pop("ratio_type", None)
    return {
        **given,
        "agg_type": _grpo_enum(
            GrpoAggregation, agg, GrpoAggregation.FIXED_HORIZON, "loss.grpo_params.agg_type"
        ),
        "ratio_type": _grpo_enum(
            GrpoRatioType, ratio, GrpoRatioType.TOKEN, "loss.grpo_params.ratio_type"
        ),
    }


def _params_to_domain(loss_type: LossType, loss: LossConfigIn) -> LossParams:
    """The loss's domain params from its wire object (defaults where a field is omitted)."""
    field_name = LOSS_SPECS[loss_type].params_field
    given = {} if field_name is None else given_fields(getattr(loss, field_name))
    if loss_type == LossType.GRPO:
        given = _grpo_fields(given)
    return params_from_fields(loss_type, given)


def loss_to_domain(loss_type: LossType, loss: LossConfigIn) -> LossConfig:
    """The domain loss config, its params checked against the loss table; a params object of
    another loss is a 400 (losses.md 1.2)."""
    for other, field_name in loss.params_sent().items():
        if other != loss_type:
            raise InvalidRequest(
                f"{field_name} does not apply to {loss_type.value}", param=f"loss.{field_name}"
            )
    config = LossConfig(loss_type, _params_to_domain(loss_type, loss))
    check_params(config)
    return config


def _loss_from_loss_fn(loss_fn: str, config: dict[str, Any] | None) -> LossConfigIn:
    """Early-2026 `loss_fn` + `loss_fn_config` -> a loss config (api.md 5.4)."""
    loss_type = parse_loss_type(loss_fn, "loss_fn")
    body: dict[str, Any] = {"type": loss_type.value}
    if config:
        field_name = LOSS_SPECS[loss_type].params_field
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
        check_input_values(samples)
        return ForwardBackwardRequest(
            samples=samples,
            loss=loss,
            forward_only=bool(self.forward_only),
            return_loss_fn_outputs=bool(self.return_loss_fn_outputs),
        )


class GradientIn(Wire):
    # Values are checked by parse_numbers, which names the index (as TensorIn's).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=True)

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
            dtype = wire_dtype(gradient.dtype, "gradients", f"gradients[{index}]")
            if len(gradient.data) != len(sample.tokens):
                raise InvalidRequest(
                    f"{param} has {len(gradient.data)} values, samples[{index}] has"
                    f" {len(sample.tokens)} tokens",
                    param=param,
                )
            gradients.append(parse_numbers(gradient.data, param, integral=dtype == "int64"))
        return CustomForwardBackwardRequest(samples=samples, gradients=tuple(gradients))
