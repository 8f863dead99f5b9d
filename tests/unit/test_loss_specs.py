"""The loss table (posttrain/loss_specs.py): it agrees with the loss functions and the wire
models, and its params checks name the offending field (losses.md 1.2, 1.5)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from posttrain.api.schemas.losses import LossConfigIn
from posttrain.api.schemas.samples import LossInputsIn
from posttrain.engine.train.losses import LOSSES
from posttrain.errors import InvalidRequest
from posttrain.loss_specs import (
    INPUT_SPECS,
    LOSS_FN_INPUT_KEYS,
    LOSS_SPECS,
    check_params,
    params_from_fields,
    required_inputs,
)
from posttrain.types import (
    CispoParams,
    DppoParams,
    DroParams,
    GrpoParams,
    LossConfig,
    LossType,
    PpoParams,
)

NAN, INF = math.nan, math.inf


def test_every_loss_has_one_spec_naming_its_function() -> None:
    assert set(LOSS_SPECS) == set(LOSSES) == set(LossType)
    for loss_type, spec in LOSS_SPECS.items():
        assert LOSSES[loss_type].__name__ == spec.function
        # The short name of the early `loss_fn` field is the function's name (api.md 5.4).
        assert loss_type.value == f"LOSS_TYPE_{spec.function.upper()}"


def test_the_wire_names_are_fields_of_the_wire_models() -> None:
    for spec in LOSS_SPECS.values():
        if spec.params_field is not None:
            assert spec.params_field in LossConfigIn.model_fields
        if spec.inputs_block is not None:
            assert spec.inputs_block in LossInputsIn.model_fields
        assert set(spec.required_inputs) <= LOSS_FN_INPUT_KEYS


def test_every_bound_names_a_field_of_its_params_type() -> None:
    for spec in LOSS_SPECS.values():
        if spec.params_type is None:
            assert spec.bounds == ()
            continue
        names = {f.name for f in dataclasses.fields(spec.params_type)}
        for bound in spec.bounds:
            assert bound.field in names
            assert not isinstance(bound.low, str) or bound.low in names


def test_input_specs_cover_the_keys_and_only_weights_and_mask_are_non_negative() -> None:
    assert LOSS_FN_INPUT_KEYS == {
        "target_tokens",
        "weights",
        "mask",
        "logprobs",
        "advantages",
        "reference_logprobs",
    }
    assert {k for k, spec in INPUT_SPECS.items() if spec.is_non_negative} == {"weights", "mask"}
    assert INPUT_SPECS["target_tokens"].dtypes == {"int64"}
    assert INPUT_SPECS["weights"].dtypes == {"int64", "float32"}


def test_grpo_with_beta_also_requires_reference_logprobs() -> None:
    assert list(required_inputs(LossConfig(LossType.GRPO, GrpoParams(beta=0.1)))) == [
        "target_tokens",
        "logprobs",
        "advantages",
        "reference_logprobs",
    ]
    assert "reference_logprobs" not in required_inputs(LossConfig(LossType.GRPO, GrpoParams()))
    assert "reference_logprobs" not in required_inputs(LossConfig(LossType.GRPO))


def test_params_from_fields_fills_defaults_and_requires_dro_beta() -> None:
    assert params_from_fields(LossType.PPO, {"clip_low_threshold": 0.7}) == PpoParams(0.7, 1.2)
    assert params_from_fields(LossType.IMPORTANCE_SAMPLING, {}) is None
    assert params_from_fields(LossType.DRO, {"beta": 0.5}) == DroParams(0.5)
    with pytest.raises(InvalidRequest) as raised:
        params_from_fields(LossType.DRO, {})
    assert raised.value.param == "loss.dro_params.beta"
    assert raised.value.message == "LOSS_TYPE_DRO requires dro_params.beta (no default)"


@pytest.mark.parametrize(
    ("config", "param"),
    [
        (LossConfig(LossType.PPO, PpoParams(-0.1, 1.2)), "loss.ppo_params.clip_low_threshold"),
        (LossConfig(LossType.PPO, PpoParams(1.1, 1.2)), "loss.ppo_params.clip_low_threshold"),
        (LossConfig(LossType.PPO, PpoParams(NAN, 1.2)), "loss.ppo_params.clip_low_threshold"),
        (LossConfig(LossType.PPO, PpoParams(0.8, 0.9)), "loss.ppo_params.clip_high_threshold"),
        (LossConfig(LossType.GRPO, GrpoParams(1.5, 2.0)), "loss.grpo_params.clip_low_threshold"),
        (LossConfig(LossType.GRPO, GrpoParams(0.8, 0.95)), "loss.grpo_params.clip_high_threshold"),
        (LossConfig(LossType.GRPO, GrpoParams(beta=-0.1)), "loss.grpo_params.beta"),
        (LossConfig(LossType.GRPO, GrpoParams(beta=NAN)), "loss.grpo_params.beta"),
        (
            LossConfig(LossType.CISPO, CispoParams(-0.5, 4.0)),
            "loss.cispo_params.clip_low_threshold",
        ),
        (
            LossConfig(LossType.CISPO, CispoParams(2.0, 1.0)),
            "loss.cispo_params.clip_high_threshold",
        ),
        (LossConfig(LossType.DRO, DroParams(beta=-1.0)), "loss.dro_params.beta"),
        (LossConfig(LossType.DRO, DroParams(beta=INF)), "loss.dro_params.beta"),
        (LossConfig(LossType.DRO, None), "loss.dro_params.beta"),
        (LossConfig(LossType.DPPO, DppoParams(1.5, 0.15)), "loss.dppo_params.delta_low"),
        (LossConfig(LossType.DPPO, DppoParams(0.15, -0.1)), "loss.dppo_params.delta_high"),
        (LossConfig(LossType.PPO, CispoParams()), "loss.ppo_params"),
        (LossConfig(LossType.IMPORTANCE_SAMPLING, PpoParams()), "loss"),
    ],
)
def test_check_params_names_the_offending_field(config: LossConfig, param: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        check_params(config)
    assert raised.value.param == param


def test_check_params_messages_name_the_bound() -> None:
    with pytest.raises(InvalidRequest) as raised:
        check_params(LossConfig(LossType.PPO, PpoParams(1.1, 1.2)))
    assert raised.value.message == (
        "loss.ppo_params.clip_low_threshold must be finite and in [0.0, 1.0], got 1.1"
    )
    with pytest.raises(InvalidRequest) as raised:
        check_params(LossConfig(LossType.CISPO, CispoParams(2.0, 1.0)))
    assert raised.value.message == (
        "loss.cispo_params.clip_high_threshold must be finite and >= 2.0, got 1.0"
    )


@pytest.mark.parametrize(
    "config",
    [
        LossConfig(LossType.CROSS_ENTROPY),
        LossConfig(LossType.PPO),
        LossConfig(LossType.PPO, PpoParams(0.0, 1.0)),
        LossConfig(LossType.CISPO, CispoParams(0.0, 0.0)),
        LossConfig(LossType.DRO, DroParams(beta=0.0)),
        LossConfig(LossType.DPPO, DppoParams(0.0, 1.0)),
        LossConfig(LossType.GRPO, GrpoParams(beta=0.1)),
    ],
)
def test_check_params_accepts_the_edges_of_each_range(config: LossConfig) -> None:
    check_params(config)
