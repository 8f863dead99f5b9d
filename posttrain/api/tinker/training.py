"""Tinker training requests -> posttrain domain requests: a forward_backward's datums become
TrainingSamples (the protobuf codec decoded them), its loss name and config a LossConfig, an
optim_step's AdamParams the domain's.

Imports: api.tinker, loss_specs, errors, types.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

from posttrain.api.tinker.codec import WireDatum, WireForwardBackward
from posttrain.api.tinker.losses import check_tinker_inputs, logprobs_shape, tinker_loss
from posttrain.api.tinker.wire import OptimStep
from posttrain.errors import InvalidRequest
from posttrain.types import (
    AdamParams,
    ForwardBackwardRequest,
    ImageInput,
    OptimStepRequest,
    TrainingSample,
)


def forward_backward_request(
    wire: WireForwardBackward,
) -> tuple[ForwardBackwardRequest, list[list[int]]]:
    """The domain request and, per datum, the shape its logprobs output takes (its
    target_tokens' shape: [N], or [N, K] for top-k cross-entropy)."""
    if not wire.model_id:
        raise InvalidRequest("model_id is required", param="model_id")
    if not wire.datums:
        raise InvalidRequest("forward_backward needs at least one datum", param="data")
    loss = tinker_loss(wire.loss_fn, dict(wire.loss_fn_config))
    samples = tuple(_sample(index, datum) for index, datum in enumerate(wire.datums))
    request = ForwardBackwardRequest(
        samples=samples,
        loss=loss,
        forward_only=wire.forward_only,
        return_loss_fn_outputs=True,  # the SDK reads per-datum logprobs of every call
        report_all_logprobs=True,  # at every position: forward_backward_custom's forward
    )
    check_tinker_inputs(request)
    return request, [logprobs_shape(sample) for sample in samples]


def _sample(index: int, datum: WireDatum) -> TrainingSample:
    """A datum as a TrainingSample: its 1-D inputs as they are, a 2-D [N, K] target_tokens
    (with weights of the same shape) row-major with targets_per_position K."""
    where = f"data[{index}]"
    if not datum.tokens:
        raise InvalidRequest(f"{where}.model_input has no tokens", param=f"{where}.model_input")
    targets = datum.inputs.get("target_tokens")
    if targets is None:
        raise InvalidRequest(
            "target_tokens is required", param=f"{where}.loss_fn_inputs.target_tokens"
        )
    per_position = targets.shape[1] if len(targets.shape) == 2 else 1
    inputs: dict[str, tuple[float, ...]] = {}
    for key, tensor in datum.inputs.items():
        param = f"{where}.loss_fn_inputs.{key}"
        if len(tensor.shape) > 2 or (len(tensor.shape) == 2 and key not in _PER_TARGET):
            raise InvalidRequest(
                f"{key} has shape {list(tensor.shape)}; only target_tokens and weights may be"
                " 2-D [N, K]",
                param=param,
            )
        values = tuple(float(v) for v in tensor.values)
        if not all(math.isfinite(v) for v in values):
            raise InvalidRequest(f"{key} holds a value that is not finite", param=param)
        inputs[key] = values
    images = tuple(
        ImageInput(
            offset=image.offset,
            num_tokens=image.expected_tokens,
            chunk=image.chunk,
            data=image.data,
            format=image.format,
        )
        for image in datum.images
    )
    return TrainingSample(
        tokens=tuple(datum.tokens),
        loss_fn_inputs=inputs,
        targets_per_position=per_position,
        images=images,
    )


_PER_TARGET = ("target_tokens", "weights")


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


@contextmanager
def in_tinker_terms() -> Iterator[None]:
    """The service checks a forward-backward's samples in the Together API's words
    (`samples[i].model_input`); a Tinker caller sent `data[i]`, and the error says so."""
    try:
        yield
    except InvalidRequest as exc:
        param = exc.param.replace("samples[", "data[", 1) if exc.param else exc.param
        raise InvalidRequest(exc.message.replace("samples[", "data["), param=param) from None
