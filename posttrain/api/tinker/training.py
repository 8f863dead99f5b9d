"""Tinker training requests -> posttrain domain requests: a forward_backward's datums become
TrainingSamples (the protobuf codec decoded them), its loss name and config a LossConfig, an
optim_step's AdamParams the domain's.

Imports: api.tinker, loss_specs, errors, types.
"""

from __future__ import annotations

import math

from posttrain.api.tinker.codec import WireForwardBackward
from posttrain.api.tinker.losses import tinker_loss
from posttrain.api.tinker.wire import OptimStep
from posttrain.errors import InvalidRequest
from posttrain.loss_specs import LOSS_FN_INPUT_KEYS, required_inputs
from posttrain.types import AdamParams, ForwardBackwardRequest, OptimStepRequest, TrainingSample


def forward_backward_request(
    wire: WireForwardBackward,
) -> tuple[ForwardBackwardRequest, list[tuple[int, ...]]]:
    """The domain request and, per datum, the shape its logprobs output takes (the shape of
    its target_tokens)."""
    if not wire.datums:
        raise InvalidRequest("forward_backward needs at least one datum", param="data")
    loss = tinker_loss(wire.loss_fn, dict(wire.loss_fn_config))
    required = required_inputs(loss)
    samples = []
    shapes = []
    for index, datum in enumerate(wire.datums):
        where = f"data[{index}]"
        if not datum.tokens:
            raise InvalidRequest(f"{where}.model_input has no tokens", param=f"{where}.model_input")
        inputs: dict[str, tuple[float, ...]] = {}
        for key, tensor in datum.inputs.items():
            param = f"{where}.loss_fn_inputs.{key}"
            if key not in LOSS_FN_INPUT_KEYS:
                known = ", ".join(sorted(LOSS_FN_INPUT_KEYS))
                raise InvalidRequest(
                    f"unknown loss_fn_inputs key {key!r}; known: {known}", param=param
                )
            if not tensor.shape or tensor.shape[0] != len(datum.tokens):
                raise InvalidRequest(
                    f"{key} has shape {list(tensor.shape)}; model_input has"
                    f" {len(datum.tokens)} tokens",
                    param=param,
                )
            if len(tensor.shape) != 1:
                raise InvalidRequest(f"{key} must be 1-D", param=param)
            values = tuple(float(v) for v in tensor.values)
            if not all(math.isfinite(v) for v in values):
                raise InvalidRequest(f"{key} holds a value that is not finite", param=param)
            inputs[key] = values
        for key, why in required.items():
            if key not in inputs:
                raise InvalidRequest(
                    f"{wire.loss_fn}{why} requires {key} in every datum",
                    param=f"{where}.loss_fn_inputs.{key}",
                )
        samples.append(TrainingSample(tokens=tuple(datum.tokens), loss_fn_inputs=inputs))
        shapes.append(datum.inputs["target_tokens"].shape)
    request = ForwardBackwardRequest(
        samples=tuple(samples),
        loss=loss,
        forward_only=wire.forward_only,
        return_loss_fn_outputs=True,
    )
    return request, shapes


def optim_step_request(body: OptimStep) -> OptimStepRequest:
    if body.optimizer_params is not None:
        kind = body.optimizer_params.get("type")
        raise InvalidRequest(
            f"optimizer {kind!r} is not served; posttrain's Tinker surface runs AdamW"
            " (send adam_params)",
            param="optimizer_params.type",
        )
    adam = body.adam_params
    if adam is None:
        raise InvalidRequest("adam_params is required", param="adam_params")
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        value = getattr(adam, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidRequest(f"{name} must be finite and >= 0", param=f"adam_params.{name}")
    if not (adam.beta1 < 1 and adam.beta2 < 1):
        raise InvalidRequest("beta1 and beta2 must be below 1", param="adam_params.beta1")
    return OptimStepRequest(
        adam=AdamParams(
            learning_rate=adam.learning_rate,
            beta1=adam.beta1,
            beta2=adam.beta2,
            eps=adam.eps,
            weight_decay=adam.weight_decay,
            grad_clip_norm=adam.grad_clip_norm,
        )
    )
