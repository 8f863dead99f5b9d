"""A forward-backward is checked against the loss table once, at the API edge: the params, the
inputs each sample must send and their values (losses.md 1.2-1.5). Each bad body raises
InvalidRequest naming the field and the sample; each valid one becomes a request.

Two samples of lengths 4 and 2, so an error must name the sample it is about.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import pytest

from posttrain.api.deps import parse
from posttrain.api.schemas.losses import ForwardBackwardIn
from posttrain.errors import InvalidRequest
from posttrain.types import ForwardBackwardRequest

NAN, INF = math.nan, math.inf
TOKENS = [[5, 6, 7, 8], [5, 6]]
Q = [[-0.6, -1.0, -0.9, -2.4], [-0.2, -1.1]]
A = [[1.0, -0.5, 2.0, -1.5], [0.8, -1.0]]
REF = [[-0.4, -1.1, -0.5, -2.2], [-0.9, -1.3]]
ALL = [[1, 1, 1, 1], [1, 1]]
NAN_IN_SAMPLE_1 = [[-0.6, -1.0, -0.9, -2.4], [-0.2, NAN]]

Rows = list[list[float]]


def body(
    loss: dict[str, Any],
    *,
    weights: Rows | None = None,
    mask: Rows | None = None,
    logprobs: Rows | None = Q,
    advantages: Rows | None = A,
    reference: Rows | None = None,
) -> dict[str, Any]:
    sent = {
        "weights": weights,
        "mask": mask,
        "logprobs": logprobs,
        "advantages": advantages,
        "reference_logprobs": reference,
    }
    samples = []
    for index, tokens in enumerate(TOKENS):
        inputs = {"target_tokens": {"data": [t + 1 for t in tokens], "dtype": "int64"}}
        for key, rows in sent.items():
            if rows is not None:
                inputs[key] = {"data": rows[index], "dtype": "float32"}
        samples.append(
            {
                "model_input": {"chunks": [{"encoded_text": {"tokens": tokens}}]},
                "loss_fn_inputs": inputs,
            }
        )
    return {"loss": loss, "samples": samples}


def to_domain(request: dict[str, Any]) -> ForwardBackwardRequest:
    return parse(ForwardBackwardIn, request).to_domain()


CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
IS = {"type": "LOSS_TYPE_IMPORTANCE_SAMPLING"}
PPO = {"type": "LOSS_TYPE_PPO"}
GRPO = {"type": "LOSS_TYPE_GRPO"}


def with_params(loss_type: str, field: str, **params: float) -> dict[str, Any]:
    return {"type": loss_type, field: params}


@pytest.mark.parametrize(
    ("request_body", "param"),
    [
        (
            body(with_params("LOSS_TYPE_PPO", "ppo_params", clip_low_threshold=1.1)),
            "loss.ppo_params.clip_low_threshold",
        ),
        (
            body(
                with_params(
                    "LOSS_TYPE_CISPO", "cispo_params", clip_low_threshold=2, clip_high_threshold=1
                )
            ),
            "loss.cispo_params.clip_high_threshold",
        ),
        (
            body(with_params("LOSS_TYPE_GRPO", "grpo_params", beta=-0.1), reference=REF),
            "loss.grpo_params.beta",
        ),
        (
            body(with_params("LOSS_TYPE_GRPO", "grpo_params", beta=0.1)),
            "samples[0].loss_fn_inputs.reference_logprobs",
        ),
        (body(CE, logprobs=None, advantages=None), "samples[0].loss_fn_inputs.weights"),
        (body(PPO, logprobs=None), "samples[0].loss_fn_inputs.logprobs"),
        (body(GRPO, advantages=None), "samples[0].loss_fn_inputs.advantages"),
        (body(IS, weights=ALL, mask=ALL), "samples[0].loss_fn_inputs.mask"),
        (body(CE, weights=[[1.0] * 4, [1.0, -0.5]]), "samples[1].loss_fn_inputs.weights"),
        (body(CE, weights=[[1.0] * 4, [NAN, 1.0]]), "samples[1].loss_fn_inputs.weights"),
        (body(PPO, mask=[[1, 1, 1, -1], [1, 1]]), "samples[0].loss_fn_inputs.mask"),
        (body(PPO, mask=[[1, INF, 1, 1], [1, 1]]), "samples[0].loss_fn_inputs.mask"),
        (body(PPO, logprobs=NAN_IN_SAMPLE_1), "samples[1].loss_fn_inputs.logprobs"),
        (
            body(
                with_params("LOSS_TYPE_DRO", "dro_params", beta=0.1),
                advantages=[[1.0, INF, 0.0, 0.0], [0.0, 0.0]],
            ),
            "samples[0].loss_fn_inputs.advantages",
        ),
        (body(GRPO, reference=NAN_IN_SAMPLE_1), "samples[1].loss_fn_inputs.reference_logprobs"),
    ],
)
def test_a_bad_forward_backward_names_the_field_and_sample(
    request_body: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequest) as raised:
        to_domain(request_body)
    assert raised.value.param == param


def test_a_negative_weight_names_its_sample() -> None:
    with pytest.raises(InvalidRequest) as raised:
        to_domain(body(CE, weights=[[1.0] * 4, [1.0, -0.5]]))
    assert raised.value.message == "loss_fn_inputs.weights of sample 1 is negative"


@pytest.mark.parametrize(
    "request_body",
    [
        body(CE, weights=[[0.5, 0.0, 3.0, 1.0], [2.0, 0.25]]),
        body(PPO),
        body(
            with_params(
                "LOSS_TYPE_PPO", "ppo_params", clip_low_threshold=0.0, clip_high_threshold=1.0
            )
        ),
        body(
            with_params(
                "LOSS_TYPE_CISPO", "cispo_params", clip_low_threshold=0, clip_high_threshold=0
            )
        ),
        body(with_params("LOSS_TYPE_DRO", "dro_params", beta=0.0)),
        body(with_params("LOSS_TYPE_DPPO", "dppo_params", delta_low=0.0, delta_high=1.0)),
        body(with_params("LOSS_TYPE_GRPO", "grpo_params", beta=0.1), reference=REF),
        body(IS, weights=[[1.0] * 4, [1.0, 0.0]]),
    ],
)
def test_a_valid_forward_backward_becomes_a_request(request_body: dict[str, Any]) -> None:
    request = to_domain(request_body)
    assert [len(s.tokens) for s in request.samples] == [4, 2]


# ---------------------------------------------------------------- routed experts (api.md 5.2)


def seed_routes_body(routed_experts: dict[str, Any], **sample_extra: Any) -> dict[str, Any]:
    inputs = {
        "target_tokens": {"data": [6, 7, 8]},
        "weights": {"data": [1, 1, 1]},
        "routed_experts": routed_experts,
    }
    model_input = {"chunks": [{"encoded_text": {"tokens": [5, 6, 7]}}]}
    sample = {"model_input": model_input, "loss_inputs": inputs, **sample_extra}
    return {"loss": CE, "samples": [sample]}


def test_the_seed_era_routes_buffer_becomes_the_samples_routes() -> None:
    values = list(range(12))  # [3 tokens, 2 layers, top-2], row-major
    data = base64.b64encode(b"".join(v.to_bytes(2, "little") for v in values)).decode()
    (sample,) = to_domain(seed_routes_body({"data": data, "shape": ["3", 2, "2"]})).samples
    routes = sample.routed_experts
    assert (routes.num_tokens, routes.num_layers, routes.top_k) == (3, 2, 2)
    assert [int.from_bytes(routes.data[i : i + 2], "little") for i in range(0, 24, 2)] == values
    assert sample.routed_experts_key is None


def test_a_routed_experts_key_travels_to_the_service() -> None:
    request = body(CE, weights=ALL)
    request["samples"][0]["routed_experts_key"] = "re_abc"
    first, second = to_domain(request).samples
    assert first.routed_experts_key == "re_abc" and first.routed_experts is None
    assert second.routed_experts_key is None


BUFFER = "samples[0].loss_inputs.routed_experts"


@pytest.mark.parametrize(
    ("routed_experts", "extra", "param"),
    [
        ({"data": "AAAA", "shape": [1, 2]}, {}, "samples[0].loss_inputs.routed_experts.shape"),
        (
            {"data": "not base64!", "shape": [1, 1, 1]},
            {},
            "samples[0].loss_inputs.routed_experts.data",
        ),
        ({"data": "AAAA", "shape": [1, 1, 1]}, {}, "samples[0].loss_inputs.routed_experts.data"),
        (
            {"data": "AAA=", "shape": [1, 1, 1]},
            {"routed_experts_key": "re_abc"},
            "samples[0].loss_inputs.routed_experts",
        ),
    ],
)
def test_a_bad_routes_buffer_names_its_field(
    routed_experts: dict[str, Any], extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequest) as raised:
        to_domain(seed_routes_body(routed_experts, **extra))
    assert raised.value.param == param
