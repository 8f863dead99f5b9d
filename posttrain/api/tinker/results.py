"""What retrieve_future answers for a finished request, in the SDK's shapes.

Forward(-backward) and sample results are protobuf (the SDK asks for them with
`Accept: application/x-protobuf` and refuses JSON); the others are the JSON objects of the
SDK's response models. A failed operation is `{"error", "category"}` with HTTP 200, which the
SDK raises as RequestFailedError carrying the message.

Imports: api.tinker, records, types.
"""

from __future__ import annotations

from typing import Any

from posttrain.api.tinker.codec import (
    WireSequence,
    WireTensor,
    encode_forward_backward_output,
    encode_sample_response,
)
from posttrain.api.tinker.losses import tinker_metrics
from posttrain.records import OperationRecord
from posttrain.service.tinker.records import FutureRecord
from posttrain.statuses import OperationErrorCode
from posttrain.types import ForwardBackwardResult, SampleOutput, StopReason

PROTO = "application/x-protobuf"
# Failures the caller's input caused; the rest are the server's.
USER_ERRORS = {
    OperationErrorCode.INVALID_INPUT,
    OperationErrorCode.SESSION_NOT_ACTIVE,
    OperationErrorCode.NON_FINITE_LOSS,
    OperationErrorCode.RESOURCE_EXHAUSTED,
}


def failure(op: OperationRecord) -> dict[str, str]:
    category = "user" if op.error_code in USER_ERRORS else "server"
    return {"error": op.error_message or "the operation failed", "category": category}


def rendered(future: FutureRecord, op: OperationRecord) -> tuple[bytes | dict[str, Any], str]:
    """(body, media type) of a completed operation's future."""
    output = op.output
    if future.type == "forward_backward":
        assert isinstance(output, ForwardBackwardResult)
        return _forward_backward(future, output), PROTO
    if future.type == "sample":
        assert isinstance(output, SampleOutput)
        return _sample(output), PROTO
    if future.type == "optim_step":
        return {"type": "optim_step", "metrics": {}}, "json"
    if future.type in ("save_weights", "save_weights_for_sampler"):
        body: dict[str, Any] = {"type": future.type}
        if "path" in future.extra:
            body["path"] = future.extra["path"]
        if "sampling_session_id" in future.extra:
            body["sampling_session_id"] = future.extra["sampling_session_id"]
        return body, "json"
    raise AssertionError(f"no rendering for a {future.type} future")


def _forward_backward(future: FutureRecord, result: ForwardBackwardResult) -> bytes:
    """Per datum, Tinker's outputs of every built-in loss: `logprobs` and `elementwise_loss`
    (each token's share of the loss, so that they sum to loss:sum), in the targets' shape."""
    shapes = future.extra.get("shapes", [])
    outputs = []
    per_token = zip(result.loss_fn_outputs or [], result.elementwise_loss or [], strict=True)
    for index, (logprobs, elementwise) in enumerate(per_token):
        shape = tuple(shapes[index]) if index < len(shapes) else (len(logprobs),)
        outputs.append(
            {
                "logprobs": WireTensor(tuple(logprobs), shape, "float32"),
                "elementwise_loss": WireTensor(tuple(elementwise), shape, "float32"),
            }
        )
    return encode_forward_backward_output(
        "ArrayRecord", outputs, tinker_metrics(result.loss, result.metrics)
    )


def _sample(output: SampleOutput) -> bytes:
    """posttrain's prompt logprobs hold a placeholder at position 0 (nothing predicts the first
    token); the SDK reads None (NaN on the wire) there."""
    result = output.results[0]
    sequences = [
        WireSequence(
            tokens=tuple(seq.tokens),
            logprobs=tuple(seq.logprobs),
            stop_reason="stop" if seq.stop_reason == StopReason.STOP else "length",
        )
        for seq in result.sequences
    ]
    prompt_logprobs = None
    if result.prompt_logprobs is not None:
        prompt_logprobs = [None, *result.prompt_logprobs[1:]]
    topk = None
    if result.topk_prompt_logprobs is not None:
        topk = [None] + [
            list(zip(t.token_ids, t.logprobs, strict=True)) for t in result.topk_prompt_logprobs[1:]
        ]
    hits = result.sequences[0].prompt_cache_hit_tokens if result.sequences else 0
    return encode_sample_response(
        sequences,
        prompt_logprobs=prompt_logprobs,
        topk_prompt_logprobs=topk,
        prompt_cache_hit_tokens=hits,
    )
