"""Wire normalisation (api.md 5.8): seed-era and 3.1.1 bodies that mean the same thing become
equal domain requests, and bad bodies raise InvalidRequest naming the field the client sent."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from posttrain.api.deps import parse
from posttrain.api.schemas.losses import CustomForwardBackwardIn, ForwardBackwardIn
from posttrain.errors import InvalidRequest
from posttrain.types import (
    CispoParams,
    DppoParams,
    DroParams,
    GrpoAggregation,
    GrpoParams,
    GrpoRatioType,
    LossType,
    PpoParams,
)

TOKENS = [5, 6, 7, 8]
TARGETS = [6, 7, 8, 9]
SAMPLER = [0.0, -0.5, -1.25, -2.0]
ADVANTAGES = [0.0, 1.5, 1.5, -0.5]
REFERENCE = [0.0, -0.75, -1.0, -2.5]
MASK = [0, 1, 1, 1]


def tensor(data: list, dtype: str | None) -> dict[str, Any]:
    return {"data": data} if dtype is None else {"data": data, "dtype": dtype}


def new_sample(**inputs: dict) -> dict[str, Any]:
    """A 3.1.1 sample over TOKENS with the given loss_fn_inputs besides target_tokens."""
    return {
        "model_input": {"chunks": [{"encoded_text": {"tokens": TOKENS}}]},
        "loss_fn_inputs": {"target_tokens": tensor(TARGETS, "int64"), **inputs},
    }


def seed_sample(**loss_inputs: Any) -> dict[str, Any]:
    """A seed-era sample: string token ids, D_TYPE_* names, policy_segments."""
    return {
        "model_input": {"chunks": [{"encoded_text": {"tokens": [str(t) for t in TOKENS]}}]},
        "loss_inputs": {
            "target_tokens": tensor([str(t) for t in TARGETS], "D_TYPE_INT64"),
            **loss_inputs,
        },
        "policy_segments": [{"version": "3"}, {"version": 4, "start_token": "2"}],
    }


def policy_inputs(**extra: dict) -> dict[str, dict]:
    return {
        "logprobs": tensor(SAMPLER, "float32"),
        "advantages": tensor(ADVANTAGES, "float32"),
        **extra,
    }


def seed_block() -> dict[str, dict]:
    return {
        "advantages": tensor([str(a) for a in ADVANTAGES], "D_TYPE_FLOAT32"),
        "logprobs": tensor(SAMPLER, None),
    }


def fb(body: dict[str, Any]):
    return parse(ForwardBackwardIn, body).to_domain()


def rejected(body: dict[str, Any], *, custom: bool = False) -> str:
    """The param named by the InvalidRequest a body raises."""
    with pytest.raises(InvalidRequest) as info:
        if custom:
            parse(CustomForwardBackwardIn, body).to_domain()
        else:
            fb(body)
    assert info.value.param, info.value.message
    return info.value.param


# ---------------------------------------------------------------- equal domain requests

SEED_BLOCKS = {
    LossType.IMPORTANCE_SAMPLING: ("importance_sampling_inputs", None, None),
    LossType.PPO: ("ppo_inputs", "ppo_params", PpoParams(0.7, 1.3)),
    LossType.CISPO: ("cispo_inputs", "cispo_params", CispoParams(0.5, 2.0)),
    LossType.DRO: ("dro_inputs", "dro_params", DroParams(0.25)),
    LossType.DPPO: ("dppo_inputs", "dppo_params", DppoParams(0.1, 0.2)),
}


@pytest.mark.parametrize("loss_type", list(SEED_BLOCKS))
def test_seed_inputs_block_equals_loss_fn_inputs(loss_type):
    block, params_field, params = SEED_BLOCKS[loss_type]
    loss: dict[str, Any] = {"type": loss_type.value}
    if params_field is not None:
        loss[params_field] = vars(params)
    new = fb({"loss": loss, "samples": [new_sample(**policy_inputs())]})
    seed = fb({"loss": loss, "samples": [seed_sample(**{block: seed_block()})]})
    assert seed == new
    assert new.loss.params == params


def test_seed_example_with_every_block_reads_the_one_matching_loss_type():
    other = {"advantages": tensor([9.0] * 4, None), "logprobs": tensor([-9.0] * 4, None)}
    blocks = {name: other for name, _, _ in SEED_BLOCKS.values()}
    blocks["ppo_inputs"] = seed_block()
    blocks["grpo_inputs"] = {**other, "reference_logprobs": tensor([0.0] * 4, None)}
    loss = {"type": "LOSS_TYPE_PPO"}
    seed = fb({"loss": loss, "samples": [seed_sample(**blocks)]})
    assert seed == fb({"loss": loss, "samples": [new_sample(**policy_inputs())]})


def test_seed_grpo_with_reference_logprobs_equals_3_1_1():
    loss = {
        "type": "LOSS_TYPE_GRPO",
        "grpo_params": {
            "clip_low_threshold": 0.9,
            "clip_high_threshold": 1.1,
            "beta": 0.05,
            "agg_type": "GRPO_LOSS_AGGREGATION_TYPE_TOKEN_MEAN",
            "ratio_type": "GRPO_LOSS_RATIO_TYPE_SEQUENCE",
        },
    }
    new_inputs = policy_inputs(
        reference_logprobs=tensor(REFERENCE, "float32"), weights=tensor([0.0, 1, 2, 1], "float32")
    )
    seed_inputs = {
        "weights": tensor([0, 1, 2, 1], "D_TYPE_FLOAT32"),
        "grpo_inputs": {**seed_block(), "reference_logprobs": tensor(REFERENCE, "d_type_float32")},
    }
    new = fb({"loss": loss, "samples": [new_sample(**new_inputs)] * 2})
    seed = fb({"loss": loss, "samples": [seed_sample(**seed_inputs)] * 2})
    assert seed == new
    assert new.loss.params == GrpoParams(
        0.9, 1.1, 0.05, GrpoAggregation.TOKEN_MEAN, GrpoRatioType.SEQUENCE
    )


def test_april_grpo_epsilons_loss_mask_and_generator_logprobs_become_thresholds_and_mask():
    april = {
        "loss": {"grpo_params": {"clip_low": 0.1, "clip_high": 0.3, "beta": 0.0}},
        "samples": [
            seed_sample(
                loss_mask=tensor(MASK, "D_TYPE_INT64"),
                grpo_inputs={
                    "advantages": tensor(ADVANTAGES, "D_TYPE_FLOAT32"),
                    "generator_logprobs": tensor(SAMPLER, "D_TYPE_FLOAT32"),
                },
            )
        ],
    }
    new = {
        "loss": {
            "type": "LOSS_TYPE_GRPO",
            "grpo_params": {"clip_low_threshold": 1 - 0.1, "clip_high_threshold": 1 + 0.3},
        },
        "samples": [new_sample(**policy_inputs(mask=tensor(MASK, "int64")))],
    }
    assert fb(april) == fb(new)
    assert fb(april).loss.params == GrpoParams(0.9, 1.3)


def test_april_grpo_defaults_are_epsilons_0_2_0_28_beta_0_fixed_horizon():
    samples = [seed_sample(grpo_inputs=seed_block())]
    request = fb({"loss": {}, "samples": samples})
    assert request.loss.type == LossType.GRPO
    assert request.loss.params == GrpoParams(
        1 - 0.2, 1 + 0.28, 0.0, GrpoAggregation.FIXED_HORIZON, GrpoRatioType.TOKEN
    )


def test_seed_cross_entropy_with_string_tokens_and_no_loss_type():
    seed = {
        "loss": {},
        "samples": [seed_sample(weights=tensor(["0", "1", "0.5", "1"], "D_TYPE_FLOAT32"))],
    }
    new = {
        "loss": {"type": "LOSS_TYPE_CROSS_ENTROPY"},
        "samples": [new_sample(weights=tensor([0, 1, 0.5, 1], "float32"))],
    }
    assert fb(seed) == fb(new)
    assert fb(seed).loss.params is None


def test_april_loss_mask_is_cross_entropy_weights():
    seed = {
        "loss": {"type": "LOSS_TYPE_CROSS_ENTROPY"},
        "samples": [seed_sample(loss_mask=tensor(MASK, "D_TYPE_INT64"))],
    }
    new = {
        "loss": {"type": "LOSS_TYPE_CROSS_ENTROPY"},
        "samples": [new_sample(weights=tensor(MASK, "int64"))],
    }
    assert fb(seed) == fb(new)


@pytest.mark.parametrize(
    ("loss_fn", "config", "loss"),
    [
        ("cross_entropy", None, {"type": "LOSS_TYPE_CROSS_ENTROPY"}),
        ("importance_sampling", {}, {"type": "LOSS_TYPE_IMPORTANCE_SAMPLING"}),
        (
            "ppo",
            {"clip_low_threshold": 0.5},
            {"type": "LOSS_TYPE_PPO", "ppo_params": {"clip_low_threshold": 0.5}},
        ),
        ("dro", {"beta": 0.1}, {"type": "LOSS_TYPE_DRO", "dro_params": {"beta": 0.1}}),
        ("grpo", {"beta": 0.0}, {"type": "LOSS_TYPE_GRPO", "grpo_params": {"beta": 0.0}}),
        ("dppo", None, {"type": "LOSS_TYPE_DPPO"}),
        ("cispo", None, {"type": "LOSS_TYPE_CISPO"}),
    ],
)
def test_early_loss_fn_and_loss_fn_config_equal_the_loss_config(loss_fn, config, loss):
    inputs = {"weights": tensor([1.0] * 4, "float32")}
    if loss_fn != "cross_entropy":
        inputs = policy_inputs()
    body: dict[str, Any] = {"loss_fn": loss_fn, "samples": [new_sample(**inputs)]}
    if config is not None:
        body["loss_fn_config"] = config
    assert fb(body) == fb({"loss": loss, "samples": [new_sample(**inputs)]})


def test_short_loss_type_names_and_dtype_spellings_are_accepted():
    short = {
        "loss": {"type": "ppo"},
        "samples": [
            new_sample(
                logprobs=tensor(SAMPLER, "D_TYPE_BFLOAT16"),
                advantages=tensor(ADVANTAGES, "FLOAT32"),
                mask=tensor(MASK, "d_type_int64"),
            )
        ],
    }
    canonical = {
        "loss": {"type": "LOSS_TYPE_PPO"},
        "samples": [new_sample(**policy_inputs(mask=tensor(MASK, "int64")))],
    }
    assert fb(short) == fb(canonical)


def test_seed_custom_forward_backward_equals_3_1_1():
    gradients = [-1.0, -0.5, 0.0, -2.0]
    new = {
        "samples": [new_sample(weights=tensor([0.0] * 4, "float32"))],
        "gradients": [{"data": gradients}],
    }
    seed = {
        "samples": [seed_sample(weights=tensor(["0"] * 4, "D_TYPE_FLOAT32"))],
        "gradients": [{"data": [str(g) for g in gradients], "dtype": "D_TYPE_FLOAT32"}],
    }
    first = parse(CustomForwardBackwardIn, new).to_domain()
    assert parse(CustomForwardBackwardIn, seed).to_domain() == first
    assert first.gradients == (tuple(gradients),)


# ---------------------------------------------------------------- errors name the field

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
PPO = {"type": "LOSS_TYPE_PPO"}


def grpo_beta(beta: float) -> dict[str, Any]:
    return {"type": "LOSS_TYPE_GRPO", "grpo_params": {"beta": beta}}


def good_and(bad: dict[str, Any]) -> list[dict[str, Any]]:
    """Two samples: a valid PPO one first, so errors must name samples[1]."""
    return [new_sample(**policy_inputs()), bad]


BAD = {
    "missing advantages in the second sample": (
        {"loss": PPO, "samples": good_and(new_sample(logprobs=tensor(SAMPLER, "float32")))},
        "samples[1].loss_fn_inputs.advantages",
    ),
    "missing seed logprobs in the second sample": (
        {
            "loss": PPO,
            "samples": [
                seed_sample(ppo_inputs=seed_block()),
                seed_sample(ppo_inputs={"advantages": tensor(ADVANTAGES, None)}),
            ],
        },
        "samples[1].loss_inputs.ppo_inputs.logprobs",
    ),
    "cross-entropy without weights": (
        {"loss": CE, "samples": [new_sample(weights=tensor([1] * 4, "int64")), new_sample()]},
        "samples[1].loss_fn_inputs.weights",
    ),
    "grpo beta > 0 without reference_logprobs in the second sample": (
        {
            "loss": grpo_beta(0.1),
            "samples": [
                new_sample(**policy_inputs(reference_logprobs=tensor(REFERENCE, "float32"))),
                new_sample(**policy_inputs()),
            ],
        },
        "samples[1].loss_fn_inputs.reference_logprobs",
    ),
    "weights and mask together": (
        {
            "loss": PPO,
            "samples": good_and(
                new_sample(**policy_inputs(weights=tensor(MASK, "int64"), mask=tensor(MASK, None)))
            ),
        },
        "samples[1].loss_fn_inputs.mask",
    ),
    "weights and loss_mask together": (
        {
            "loss": PPO,
            "samples": [
                seed_sample(
                    weights=tensor(MASK, None),
                    loss_mask=tensor(MASK, None),
                    ppo_inputs=seed_block(),
                )
            ],
        },
        "samples[0].loss_inputs.loss_mask",
    ),
    "params of another loss": (
        {"loss": {"type": "LOSS_TYPE_PPO", "cispo_params": {}}, "samples": good_and(new_sample())},
        "loss.cispo_params",
    ),
    "dro without beta": (
        {"loss": {"type": "LOSS_TYPE_DRO", "dro_params": {}}, "samples": [new_sample()]},
        "loss.dro_params.beta",
    ),
    "dro without dro_params": (
        {"loss": {"type": "LOSS_TYPE_DRO"}, "samples": [new_sample()]},
        "loss.dro_params.beta",
    ),
    "length disagreeing with the model input": (
        {
            "loss": PPO,
            "samples": good_and(new_sample(**policy_inputs(mask=tensor([1, 1, 1], "int64")))),
        },
        "samples[1].loss_fn_inputs.mask",
    ),
    "seed length disagreeing with the model input": (
        {
            "loss": PPO,
            "samples": [seed_sample(ppo_inputs={**seed_block(), "logprobs": tensor([0.0], None)})],
        },
        "samples[0].loss_inputs.ppo_inputs.logprobs",
    ),
    "unknown loss_fn_inputs key": (
        {
            "loss": PPO,
            "samples": good_and(new_sample(**policy_inputs(advantage=tensor([0] * 4, None)))),
        },
        "samples[1].loss_fn_inputs.advantage",
    ),
    "unknown loss_inputs field": (
        {"loss": PPO, "samples": [seed_sample(ppo_inputs=seed_block(), mask=tensor(MASK, None))]},
        "samples[0].loss_inputs.mask",
    ),
    "unknown dtype": (
        {"loss": PPO, "samples": [new_sample(**policy_inputs(mask=tensor(MASK, "D_TYPE_INT8")))]},
        "samples[0].loss_fn_inputs.mask.dtype",
    ),
    "non-numeric string data": (
        {
            "loss": PPO,
            "samples": [
                seed_sample(ppo_inputs={**seed_block(), "advantages": tensor(["a"] * 4, None)})
            ],
        },
        "samples[0].loss_inputs.ppo_inputs.advantages",
    ),
    "string nan data": (
        {"loss": CE, "samples": [new_sample(weights=tensor(["nan", 1, 1, 1], None))]},
        "samples[0].loss_fn_inputs.weights",
    ),
    "both sample shapes": (
        {"loss": CE, "samples": [{**new_sample(), "loss_inputs": {}}]},
        "samples[0].loss_fn_inputs",
    ),
    "no inputs at all": (
        {"loss": CE, "samples": [{"model_input": new_sample()["model_input"]}]},
        "samples[0].loss_fn_inputs",
    ),
    "loss type without its seed block": (
        {"loss": PPO, "samples": [seed_sample(grpo_inputs=seed_block())]},
        "samples[0].loss_inputs.ppo_inputs",
    ),
    "inference from several blocks": (
        {"loss": {}, "samples": [seed_sample(ppo_inputs=seed_block(), dro_inputs=seed_block())]},
        "loss.type",
    ),
    "inference from several params": (
        {"loss": {"ppo_params": {}, "grpo_params": {}}, "samples": [new_sample()]},
        "loss.type",
    ),
    "inference with policy keys but no type": (
        {"samples": [new_sample(**policy_inputs())]},
        "loss.type",
    ),
    "unspecified loss type": (
        {"loss": {"type": "LOSS_TYPE_UNSPECIFIED"}, "samples": [new_sample()]},
        "loss.type",
    ),
    "loss and loss_fn together": (
        {"loss": CE, "loss_fn": "cross_entropy", "samples": [new_sample()]},
        "loss_fn",
    ),
    "unknown loss_fn": ({"loss_fn": "magic", "samples": [new_sample()]}, "loss_fn"),
    "loss_fn_config for a loss without params": (
        {
            "loss_fn": "importance_sampling",
            "loss_fn_config": {"beta": 1},
            "samples": [new_sample()],
        },
        "loss_fn_config",
    ),
    "unknown loss_fn_config key": (
        {"loss_fn": "ppo", "loss_fn_config": {"clip": 1}, "samples": [new_sample()]},
        "loss_fn_config.clip",
    ),
    "april clip_low out of range": (
        {
            "loss": {"grpo_params": {"clip_low": 1.5}},
            "samples": [seed_sample(grpo_inputs=seed_block())],
        },
        "loss.grpo_params.clip_low",
    ),
    "april clip_high negative": (
        {
            "loss": {"grpo_params": {"clip_high": -0.1}},
            "samples": [seed_sample(grpo_inputs=seed_block())],
        },
        "loss.grpo_params.clip_high",
    ),
    "april epsilon and threshold together": (
        {
            "loss": {"grpo_params": {"clip_low": 0.2, "clip_low_threshold": 0.8}},
            "samples": [seed_sample(grpo_inputs=seed_block())],
        },
        "loss.grpo_params.clip_low",
    ),
    "unknown agg_type": (
        {
            "loss": {"type": "LOSS_TYPE_GRPO", "grpo_params": {"agg_type": "MEAN"}},
            "samples": [new_sample(**policy_inputs())],
        },
        "loss.grpo_params.agg_type",
    ),
    "logprobs and generator_logprobs together": (
        {
            "loss": {"type": "LOSS_TYPE_GRPO"},
            "samples": [
                seed_sample(
                    grpo_inputs={**seed_block(), "generator_logprobs": tensor(SAMPLER, None)}
                )
            ],
        },
        "samples[0].loss_inputs.grpo_inputs.generator_logprobs",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_forward_backward_body_names_the_field(case):
    body, param = BAD[case]
    assert rejected(copy.deepcopy(body)) == param


def test_bad_custom_forward_backward_bodies_name_the_field():
    sample = new_sample()
    assert rejected({"samples": [sample], "gradients": []}, custom=True) == "gradients"
    assert (
        rejected({"samples": [sample], "gradients": [{"data": [0.0] * 3}]}, custom=True)
        == "gradients[0].data"
    )
    assert (
        rejected(
            {"samples": [sample], "gradients": [{"data": [0.0] * 4, "dtype": "D_TYPE_X"}]},
            custom=True,
        )
        == "gradients[0].dtype"
    )
    seed_without_targets = {"model_input": sample["model_input"], "loss_inputs": {}}
    assert (
        rejected({"samples": [seed_without_targets], "gradients": [{"data": [0] * 4}]}, custom=True)
        == "samples[0].loss_inputs.target_tokens"
    )


# ---------------------------------------------------------------- the C fast paths (issue 11)


def test_token_lists_in_every_accepted_form_give_the_same_request():
    """Plain JSON integers take the whole-list check; strings and integral floats the per-item
    conversion; both give the same domain request."""
    weights = {"weights": tensor([0.0, 1.0, 1.0, 1.0], "float32")}
    plain = fb({"samples": [new_sample(**weights)], "loss": {"type": "LOSS_TYPE_CROSS_ENTROPY"}})
    mixed = new_sample(**weights)
    mixed["model_input"]["chunks"][0]["encoded_text"]["tokens"] = ["5", 6.0, 7, " 8"]
    other = fb({"samples": [mixed], "loss": {"type": "LOSS_TYPE_CROSS_ENTROPY"}})
    assert other == plain
    assert plain.samples[0].tokens == tuple(TOKENS)


@pytest.mark.parametrize("bad", [True, 6.5, "six", None])
def test_a_bad_token_is_refused_naming_the_field_and_its_index(bad):
    sample = new_sample(weights=tensor([1.0] * 4, "float32"))
    sample["model_input"]["chunks"][0]["encoded_text"]["tokens"] = [5, bad, 7, 8]
    with pytest.raises(InvalidRequest) as info:
        fb({"samples": [sample], "loss": {"type": "LOSS_TYPE_CROSS_ENTROPY"}})
    param = info.value.param or ""
    assert param.startswith("samples[0].model_input.chunks[0].encoded_text.tokens")
    # The index of the bad token, in the message or (pydantic's own check) in the param.
    assert "[1]: expected an integer" in info.value.message or param.endswith("tokens[1]")


@pytest.mark.parametrize(
    ("values", "problem"),
    [([1.0, float("inf"), 0.0, 1.0], "not finite"), ([1.0, "x", 0.0, 1.0], "not a number")],
)
def test_bad_numbers_take_the_loop_that_names_the_index(values, problem):
    with pytest.raises(InvalidRequest) as info:
        fb(
            {
                "samples": [new_sample(weights=tensor(values, "float32"))],
                "loss": {"type": "LOSS_TYPE_CROSS_ENTROPY"},
            }
        )
    assert f"[1] is {problem}" in info.value.message
