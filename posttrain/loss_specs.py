"""The loss specifications: one table of what each built-in loss takes and allows.

Per loss (LOSS_SPECS): the name of its function in engine/train/losses.LOSSES, its params type, the
wire names of its params object (`loss.<params_field>`) and of its seed-era inputs block
(`loss_inputs.<inputs_block>`), the loss_fn_inputs keys every sample must send, and the allowed
range of each param. Per loss_fn_inputs key (INPUT_SPECS): the dtypes it may carry and whether
its values must be non-negative. The rules are losses.md 1.2 and 1.5 and api.md 4.4.

Two API surfaces (Dialect) share the table: Together's /v1/rl and Tinker's /api/v1
(api/tinker/). A loss or a key that only one of them accepts says so here (LossSpec.dialects,
InputSpec.dialects), and so does a rule that differs between them: Tinker's client-side
forward_backward_custom sends cross-entropy weights -dC/dlogp, which may be negative, so
`weights` is non-negative on the Together surface only (InputSpec.non_negative_in).

The API edge (api/schemas) checks every forward-backward against this table once, at submit,
so a bad request is a 400 naming the field; the engine trusts its typed inputs. Values arrive
here already parsed and finite (api/schemas/samples.parse_numbers), so what is left to check
on them is their sign, one C-level min() per sample and key: a request may carry 100k tokens.

Imports: types, errors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields
from enum import StrEnum
from typing import Any

from posttrain.errors import InvalidRequest
from posttrain.types import (
    CispoParams,
    DppoParams,
    DroParams,
    GrpoParams,
    GspoParams,
    LossConfig,
    LossParams,
    LossType,
    PpoParams,
    TrainingSample,
)


class Dialect(StrEnum):
    TOGETHER = "together"  # /v1/rl (api.md)
    TINKER = "tinker"  # /api/v1 (tinker-wire.md)


_BOTH = frozenset(Dialect)

# The class of a loss's params: one of the LossParams dataclasses.
ParamsType = type[PpoParams | CispoParams | DroParams | DppoParams | GrpoParams | GspoParams]


@dataclass(frozen=True)
class Bound:
    """`field` must be finite and low <= value <= high. A str `low` names another field of the
    same params whose value is the lower bound (CISPO: clip_high >= clip_low threshold)."""

    field: str
    low: float | str
    high: float = math.inf


@dataclass(frozen=True)
class LossSpec:
    function: str  # its function's name in engine/train/losses.LOSSES, also its short wire name
    params_type: ParamsType | None  # None: the loss takes no params (CE, IS)
    params_field: str | None  # wire: loss.<params_field> (CE has an empty one, IS none)
    inputs_block: str | None  # seed era: loss_inputs.<inputs_block> (CE reads none)
    required_inputs: tuple[str, ...]  # in the order a missing one is reported (api.md 4.4)
    bounds: tuple[Bound, ...] = ()  # in the order a broken one is reported
    dialects: frozenset[Dialect] = _BOTH  # the surfaces that accept the loss


@dataclass(frozen=True)
class InputSpec:
    dtypes: frozenset[str]  # the wire dtypes the key may carry (api.md 4.4)
    non_negative_in: frozenset[Dialect] = frozenset()  # surfaces where a value < 0 is a 400
    dialects: frozenset[Dialect] = _BOTH  # the surfaces that accept the key

    @property
    def is_non_negative(self) -> bool:
        """Non-negative on the Together surface (losses.md 1.3)."""
        return Dialect.TOGETHER in self.non_negative_in


_POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")
_RATIO_BOUNDS = (Bound("clip_low_threshold", 0.0, 1.0), Bound("clip_high_threshold", 1.0))

LOSS_SPECS: dict[LossType, LossSpec] = {
    LossType.CROSS_ENTROPY: LossSpec(
        function="cross_entropy",
        params_type=None,
        params_field="cross_entropy_params",
        inputs_block=None,
        required_inputs=("target_tokens", "weights"),
    ),
    LossType.IMPORTANCE_SAMPLING: LossSpec(
        function="importance_sampling",
        params_type=None,
        params_field=None,
        inputs_block="importance_sampling_inputs",
        required_inputs=_POLICY_INPUTS,
    ),
    LossType.PPO: LossSpec(
        function="ppo",
        params_type=PpoParams,
        params_field="ppo_params",
        inputs_block="ppo_inputs",
        required_inputs=_POLICY_INPUTS,
        bounds=_RATIO_BOUNDS,
    ),
    LossType.CISPO: LossSpec(
        function="cispo",
        params_type=CispoParams,
        params_field="cispo_params",
        inputs_block="cispo_inputs",
        required_inputs=_POLICY_INPUTS,
        bounds=(
            Bound("clip_low_threshold", 0.0),
            Bound("clip_high_threshold", "clip_low_threshold"),
        ),
    ),
    LossType.DRO: LossSpec(
        function="dro",
        params_type=DroParams,
        params_field="dro_params",
        inputs_block="dro_inputs",
        required_inputs=_POLICY_INPUTS,
        bounds=(Bound("beta", 0.0),),
    ),
    LossType.DPPO: LossSpec(
        function="dppo",
        params_type=DppoParams,
        params_field="dppo_params",
        # The seeds name dppo_params but no dppo_inputs; accepted for symmetry (api.md 5.2).
        inputs_block="dppo_inputs",
        required_inputs=_POLICY_INPUTS,
        bounds=(Bound("delta_low", 0.0, 1.0), Bound("delta_high", 0.0, 1.0)),
    ),
    LossType.GRPO: LossSpec(
        function="grpo",
        params_type=GrpoParams,
        params_field="grpo_params",
        inputs_block="grpo_inputs",
        required_inputs=_POLICY_INPUTS,
        bounds=(*_RATIO_BOUNDS, Bound("beta", 0.0)),
    ),
    # Tinker's gspo (GSPO-token, summed; engine/train/losses.gspo): no Together wire names.
    LossType.GSPO: LossSpec(
        function="gspo",
        params_type=GspoParams,
        params_field=None,
        inputs_block=None,
        required_inputs=_POLICY_INPUTS,  # + sequence_ratio_mask (required_inputs())
        bounds=_RATIO_BOUNDS,
        dialects=frozenset({Dialect.TINKER}),
    ),
}

_FLOAT = frozenset({"float32"})
_INT_OR_FLOAT = frozenset({"int64", "float32"})
INPUT_SPECS: dict[str, InputSpec] = {
    "target_tokens": InputSpec(frozenset({"int64"})),
    "logprobs": InputSpec(_FLOAT),
    "advantages": InputSpec(_FLOAT),
    "reference_logprobs": InputSpec(_FLOAT),
    # weights and mask are checked in this order; fractional weights are honoured (losses.md 2).
    "weights": InputSpec(_INT_OR_FLOAT, non_negative_in=frozenset({Dialect.TOGETHER})),
    "mask": InputSpec(_INT_OR_FLOAT, non_negative_in=_BOTH),
    # GSPO's sequence-ratio tokens (!= 0), Tinker's key.
    "sequence_ratio_mask": InputSpec(
        _INT_OR_FLOAT,
        non_negative_in=frozenset({Dialect.TINKER}),
        dialects=frozenset({Dialect.TINKER}),
    ),
}


def loss_types(dialect: Dialect) -> tuple[LossType, ...]:
    """The losses a surface accepts, in table order."""
    return tuple(t for t, spec in LOSS_SPECS.items() if dialect in spec.dialects)


def input_keys(dialect: Dialect) -> frozenset[str]:
    """The loss_fn_inputs keys a surface understands."""
    return frozenset(k for k, spec in INPUT_SPECS.items() if dialect in spec.dialects)


# The keys the Together surface understands (api.md 1.7.2).
LOSS_FN_INPUT_KEYS = input_keys(Dialect.TOGETHER)


def required_inputs(config: LossConfig) -> dict[str, str]:
    """The loss_fn_inputs keys every sample must send, in the order a missing one is reported,
    each with the condition that makes it required ("" where the loss always reads it)."""
    required = dict.fromkeys(LOSS_SPECS[config.type].required_inputs, "")
    if isinstance(config.params, GrpoParams) and config.params.beta > 0:
        required["reference_logprobs"] = " with beta > 0"  # the k3 term reads it (losses.md 9.2)
    if config.type == LossType.GSPO:
        required["sequence_ratio_mask"] = ""  # the tokens of the sequence ratio
    return required


def params_from_fields(loss_type: LossType, given: dict[str, Any]) -> LossParams:
    """The loss's params from the fields a request set, defaults for the rest (None for a loss
    without params). A field without a default (DRO's beta) must be set."""
    spec = LOSS_SPECS[loss_type]
    if spec.params_type is None:
        return None
    _require_fields(loss_type, spec, set(given))
    return spec.params_type(**given)


def check_params(config: LossConfig) -> None:
    """Raise InvalidRequest naming the field (`loss.<params_field>.<field>`) unless the params
    fit the loss: the right type, every field without a default set, each within its bound."""
    spec = LOSS_SPECS[config.type]
    if spec.params_type is None:
        if config.params is not None:
            raise InvalidRequest(f"{config.type.value} takes no params", param="loss")
        return
    if config.params is None:  # the defaults, unless a field has none
        _require_fields(config.type, spec, set())
        return
    if not isinstance(config.params, spec.params_type):
        raise InvalidRequest(
            f"{config.type.value} takes {spec.params_field}, not {type(config.params).__name__}",
            param=f"loss.{spec.params_field}",
        )
    for bound in spec.bounds:
        low = getattr(config.params, bound.low) if isinstance(bound.low, str) else bound.low
        _check_range(
            getattr(config.params, bound.field),
            low,
            bound.high,
            f"loss.{spec.params_field}.{bound.field}",
        )


def check_input_values(
    samples: Sequence[TrainingSample],
    dialect: Dialect = Dialect.TOGETHER,
    field: str = "samples",
) -> None:
    """Raise InvalidRequest naming the first sample (`<field>[i]`) whose weights or mask
    holds a negative value where `dialect` forbids it (losses.md 1.3). Values are finite by
    now (parse_numbers)."""
    for key, spec in INPUT_SPECS.items():
        if dialect not in spec.non_negative_in:
            continue
        for index, sample in enumerate(samples):
            values = sample.loss_fn_inputs.get(key)
            if values and min(values) < 0:
                raise InvalidRequest(
                    f"loss_fn_inputs.{key} of sample {index} is negative",
                    param=f"{field}[{index}].loss_fn_inputs.{key}",
                )


def _require_fields(loss_type: LossType, spec: LossSpec, given: set[str]) -> None:
    assert spec.params_type is not None
    for field in fields(spec.params_type):
        if field.default is MISSING and field.name not in given:
            path = f"{spec.params_field}.{field.name}"
            raise InvalidRequest(
                f"{loss_type.value} requires {path} (no default)", param=f"loss.{path}"
            )


def _check_range(value: float, low: float, high: float, param: str) -> None:
    """Raise unless value is finite and low <= value <= high (NaN fails too)."""
    if not (math.isfinite(value) and low <= value <= high):
        bound = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
        raise InvalidRequest(f"{param} must be finite and {bound}, got {value}", param=param)
