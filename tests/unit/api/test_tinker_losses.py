"""The Tinker surface's losses (api/tinker/losses.py) and the per-surface rules of the loss
table (loss_specs.Dialect): names, loss_fn_config keys and defaults, the datum checks, metric
names the SDK can split, and the Together surface left as it was."""

from __future__ import annotations

import pytest

from posttrain.api.schemas.losses import ForwardBackwardIn, parse_loss_type
from posttrain.api.tinker.losses import (
    check_tinker_inputs,
    logprobs_shape,
    tinker_loss,
    tinker_metric_name,
    tinker_metrics,
)
from posttrain.errors import InvalidRequest
from posttrain.loss_specs import LOSS_FN_INPUT_KEYS, Dialect, check_input_values, loss_types
from posttrain.types import (
    CispoParams,
    DroParams,
    ForwardBackwardRequest,
    GspoParams,
    LossConfig,
    LossType,
    PpoParams,
    TrainingSample,
)


def test_each_tinker_loss_maps_with_tinkers_defaults():
    assert tinker_loss("cross_entropy", None) == LossConfig(LossType.CROSS_ENTROPY)
    assert tinker_loss("importance_sampling", {}) == LossConfig(LossType.IMPORTANCE_SAMPLING)
    assert tinker_loss("ppo", None) == LossConfig(LossType.PPO, PpoParams(0.8, 1.2))
    assert tinker_loss("cispo", None) == LossConfig(LossType.CISPO, CispoParams(0.0, 4.0))
    assert tinker_loss("gspo", None) == LossConfig(LossType.GSPO, GspoParams(0.8, 1.2))
    assert tinker_loss("dro", {"beta": 0.05}) == LossConfig(LossType.DRO, DroParams(0.05))
    assert tinker_loss("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}) == (
        LossConfig(LossType.PPO, PpoParams(0.9, 1.1))
    )
    assert tinker_loss("gspo", {"clip_high_threshold": 1.0004}).params == GspoParams(0.8, 1.0004)


@pytest.mark.parametrize(
    ("loss_fn", "config", "param", "says"),
    [
        ("stable_reinforce", None, "loss_fn", "importance_sampling, ppo, cispo, dro, gspo"),
        ("custom", {"loss_id": "x"}, "loss_fn", "forward_backward_custom"),
        ("grpo", None, "loss_fn", "unknown loss_fn 'grpo'"),
        ("ppo", {"clip_ratio": 0.2}, "loss_fn_config.clip_ratio", "'clip_ratio'"),
        ("cross_entropy", {"beta": 1.0}, "loss_fn_config.beta", "takes no keys"),
        ("ppo", {"clip_low_threshold": "0.8"}, "loss_fn_config.clip_low_threshold", "number"),
        ("ppo", {"clip_high_threshold": 0.9}, "loss_fn_config.clip_high_threshold", ">= 1.0"),
        ("cispo", {"clip_low_threshold": 5.0}, "loss_fn_config.clip_high_threshold", ">= 5.0"),
        ("gspo", {"clip_low_threshold": 1.5}, "loss_fn_config.clip_low_threshold", "[0.0, 1.0]"),
        ("dro", None, "loss_fn_config.beta", "no default"),
        ("dro", {"beta": -1.0}, "loss_fn_config.beta", ">= 0.0"),
    ],
)
def test_bad_loss_fn_or_config_names_the_field(loss_fn, config, param, says):
    with pytest.raises(InvalidRequest) as caught:
        tinker_loss(loss_fn, config)
    assert caught.value.param == param
    assert says in str(caught.value)


def datum(n: int = 3, k: int = 1, **inputs: tuple[float, ...]) -> TrainingSample:
    base = {"target_tokens": (1.0,) * (n * k), "weights": (1.0,) * (n * k)}
    return TrainingSample(tuple(range(5, 5 + n)), {**base, **inputs}, targets_per_position=k)


def request(loss: LossConfig, *samples: TrainingSample) -> ForwardBackwardRequest:
    return ForwardBackwardRequest(samples, loss, report_all_logprobs=True)


CE = LossConfig(LossType.CROSS_ENTROPY)


def test_negative_cross_entropy_weights_pass_on_tinker_and_fail_on_together():
    sample = datum(weights=(-0.5, 0.0, 2.0))
    check_tinker_inputs(request(CE, sample))  # forward_backward_custom's -dC/dlogp
    check_input_values((sample,), Dialect.TINKER)
    with pytest.raises(InvalidRequest) as caught:
        check_input_values((sample,))  # the Together surface, unchanged
    assert caught.value.param == "samples[0].loss_fn_inputs.weights"


def test_datum_checks_name_the_datum_and_key():
    gspo = tinker_loss("gspo", None)
    policy = {"logprobs": (0.0,) * 3, "advantages": (1.0,) * 3}
    cases = [
        (request(CE, datum(), datum(weights=(1.0,))), "data[1].loss_fn_inputs.weights"),
        (request(CE, datum(k=2, weights=(1.0,) * 3)), "data[0].loss_fn_inputs.weights"),
        (request(gspo, datum(**policy)), "data[0].loss_fn_inputs.sequence_ratio_mask"),
        (request(gspo, datum(k=2, **policy)), "data[0].loss_fn_inputs.target_tokens"),
        (request(CE, datum(other=(1.0,) * 3)), "data[0].loss_fn_inputs.other"),
        (request(CE, datum(mask=(1.0, -1.0, 1.0))), "data[0].loss_fn_inputs.mask"),
        (
            request(gspo, datum(**policy, sequence_ratio_mask=(0.0, -1.0, 1.0))),
            "data[0].loss_fn_inputs.sequence_ratio_mask",
        ),
    ]
    for bad, param in cases:
        with pytest.raises(InvalidRequest) as caught:
            check_tinker_inputs(bad)
        assert caught.value.param == param
    check_tinker_inputs(request(CE, datum(k=4)))
    check_tinker_inputs(request(gspo, datum(**policy, sequence_ratio_mask=(0.0, 1.0, 1.0))))
    assert logprobs_shape(datum(k=4)) == [3, 4] and logprobs_shape(datum()) == [3]


def test_every_metric_the_engine_emits_gets_one_colon():
    emitted = {  # engine/train/losses.py, every name any loss reports
        "loss:sum": "loss:sum",
        "valid_tokens:sum": "valid_tokens:sum",
        "loss/ratio/mean": "loss/ratio:mean",
        "loss/kl_policy/mean": "loss/kl_policy:mean",
        "loss/sampler_mismatch/mean": "loss/sampler_mismatch:mean",
        "loss/clip/high_fraction": "loss/clip/high_fraction:mean",
        "loss/clip/low_fraction": "loss/clip/low_fraction:mean",
        "loss/clip/clipped_ratio/mean": "loss/clip/clipped_ratio:mean",
        "loss/kl_ref/mean": "loss/kl_ref:mean",
        "loss": "loss:sum",
        "tokens/sum": "tokens:sum",
        "a:b:c": "a/b/c:mean",
    }
    for name, want in emitted.items():
        assert tinker_metric_name(name) == want
        assert len(want.split(":")) == 2
    assert tinker_metrics(2.5, {"loss/ratio/mean": 1.0}) == {
        "loss/ratio:mean": 1.0,
        "loss:sum": 2.5,
    }
    assert tinker_metrics(2.5, {"loss:sum": 3.0}) == {"loss:sum": 3.0}


def test_the_together_surface_keeps_its_losses_and_keys():
    assert LossType.GSPO not in loss_types(Dialect.TOGETHER)
    assert set(loss_types(Dialect.TINKER)) >= {LossType.GSPO, LossType.CROSS_ENTROPY}
    assert "sequence_ratio_mask" not in LOSS_FN_INPUT_KEYS
    for name in ("gspo", "LOSS_TYPE_GSPO"):
        with pytest.raises(InvalidRequest) as caught:
            parse_loss_type(name, "loss.type")
        assert "GSPO" not in str(caught.value).split("known:")[1]
    body = {
        "loss_fn": "gspo",
        "samples": [
            {
                "model_input": {"chunks": [{"encoded_text": {"tokens": [1, 2]}}]},
                "loss_fn_inputs": {"target_tokens": {"data": [2, 3], "dtype": "int64"}},
            }
        ],
    }
    with pytest.raises(InvalidRequest) as caught:
        ForwardBackwardIn.model_validate(body).to_domain()
    assert caught.value.param == "loss_fn"
