"""The Tinker wire's protobuf replies from plain values: the ForwardBackwardOutput of a
forward-backward (per-datum output tensors and metrics) and the SampleResponse of a sample,
both returned by retrieve_future as `application/x-protobuf`.

Laid out exactly as the SDK reads them (tinker 0.38.0, tinker/proto/response_conv.py), so
its deserialize_forward_backward_output and deserialize_sample_response give back the values
put in. The request side is codec.py.

Imports: api.tinker.codec, api.tinker.tinker_public_pb2.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from posttrain.api.tinker import tinker_public_pb2 as pb
from posttrain.api.tinker.codec import DTYPES, WireTensor

_BY_NAME = {name: (code, layout) for code, (name, layout) in DTYPES.items()}
_I32 = np.dtype("<i4")
_I64 = np.dtype("<i8")
_F32 = np.dtype("<f4")
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
# The SDK's filler for a top-k cell with no entry (tinker/types/topk_logprobs.py MASK_LOGPROB).
TOPK_EMPTY = (0, -99999.0)


@dataclass(frozen=True)
class WireSequence:
    """One sampled sequence: its tokens, their logprobs (None when not asked for), why it
    stopped ("stop" or "length"), and optionally per sampled position up to k (token_id,
    logprob) pairs (None or empty for a position without any)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    stop_reason: str
    topk_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...] | None = None


def encode_forward_backward_output(
    loss_fn_output_type: str,
    outputs: Sequence[Mapping[str, WireTensor]],
    metrics: Mapping[str, float],
) -> bytes:
    """The ForwardBackwardOutput protobuf for per-datum `outputs` (every datum with the same
    field names) and `metrics`. Each field of a run of datums is one BatchedTensor: the
    datums' values back to back, int64 byte offsets (one more than the datums), the dtype
    and the trailing shape (shape[1:]). Consecutive datums whose fields agree in dtype and
    trailing shape share one ArrayRecord; a change starts the next, which is how the SDK
    reads ragged outputs. The SDK gives each datum back the shape [size / prod(trailing),
    *trailing], so a 0-d tensor comes back as shape [1]."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=loss_fn_output_type)
    for name, value in metrics.items():
        msg.metrics[name] = float(value)
    names = sorted(outputs[0]) if outputs else []
    for i, output in enumerate(outputs):
        if sorted(output) != names:
            raise ValueError(
                f"output {i} has fields {sorted(output)} but output 0 has {names}: "
                "every datum's output carries the same fields"
            )
    start = 0
    while start < len(outputs):
        signature = _signature(outputs[start], names)
        end = start + 1
        while end < len(outputs) and _signature(outputs[end], names) == signature:
            end += 1
        _add_record(msg, loss_fn_output_type, outputs[start:end], names)
        start = end
    return msg.SerializeToString()


def encode_sample_response(
    sequences: Sequence[WireSequence],
    *,
    prompt_logprobs: Sequence[float | None] | None = None,
    topk_prompt_logprobs: Sequence[Sequence[tuple[int, float]] | None] | None = None,
    prompt_cache_hit_tokens: int = 0,
) -> bytes:
    """The SampleResponse protobuf. Tokens travel as int32 and logprobs as float32 bytes.
    `prompt_logprobs` has one entry per prompt token, None where undefined (position 0),
    sent as NaN, which the SDK turns back into None. A top-k table is a (positions, k)
    matrix pair, k the longest cell, shorter cells filled with TOPK_EMPTY: the SDK trims
    that filler and reads an all-filler row as None. The SDK reads an empty logprobs or
    prompt_logprobs, and a top-k table with no positions or no entries, as None."""
    msg = pb.SampleResponse(prompt_cache_hit_tokens=prompt_cache_hit_tokens)
    for i, sequence in enumerate(sequences):
        if sequence.stop_reason not in _STOP_REASONS:
            raise ValueError(
                f"sequence {i}'s stop_reason {sequence.stop_reason!r} is not 'stop' or 'length'"
            )
        out = msg.sequences.add(
            stop_reason=_STOP_REASONS[sequence.stop_reason],
            tokens=np.asarray(sequence.tokens, dtype=_I32).tobytes(),
        )
        if sequence.logprobs is not None:
            out.logprobs = np.asarray(sequence.logprobs, dtype=_F32).tobytes()
        if sequence.topk_logprobs is not None:
            _fill_topk(out.topk_sampled_logprobs, sequence.topk_logprobs)
    if prompt_logprobs is not None:
        with_nan = [math.nan if value is None else value for value in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(with_nan, dtype=_F32).tobytes()
    if topk_prompt_logprobs is not None:
        _fill_topk(msg.topk_prompt_logprobs, topk_prompt_logprobs)
    return msg.SerializeToString()


def _wire_array(tensor: WireTensor) -> np.ndarray:
    """`tensor`'s values as a flat array in its wire layout (bfloat16 rounded to nearest
    even, NaN kept); ValueError when the values do not fill the shape or the dtype is
    unknown."""
    if tensor.dtype not in _BY_NAME:
        raise ValueError(f"unknown dtype {tensor.dtype!r}; one of {sorted(_BY_NAME)}")
    if len(tensor.values) != math.prod(tensor.shape):
        raise ValueError(f"{len(tensor.values)} values do not fill the shape {tensor.shape}")
    layout = _BY_NAME[tensor.dtype][1]
    if tensor.dtype != "bfloat16":
        return np.asarray(tensor.values, dtype=layout).reshape(-1)
    floats = np.asarray(tensor.values, dtype=_F32).reshape(-1)
    bits = floats.view("<u4")
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(layout)
    nan = np.isnan(floats)
    rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(layout)
    return rounded


def _signature(output: Mapping[str, WireTensor], names: list[str]) -> tuple:
    return tuple((output[name].dtype, tuple(output[name].shape[1:])) for name in names)


def _add_record(
    msg: pb.ForwardBackwardOutput,
    type_tag: str,
    run: Sequence[Mapping[str, WireTensor]],
    names: list[str],
) -> None:
    record = msg.loss_fn_outputs.add(type_tag=type_tag, num_datums=len(run))
    for name in names:
        first = run[0][name]
        arrays = [_wire_array(output[name]) for output in run]
        offsets = np.zeros(len(arrays) + 1, dtype=_I64)
        offsets[1:] = np.cumsum([array.nbytes for array in arrays])
        field = record.fields[name]
        field.data = b"".join(array.tobytes() for array in arrays)
        field.offsets = offsets.tobytes()
        field.dtype = _BY_NAME[first.dtype][0]
        field.trailing_shape.extend(first.shape[1:])


def _fill_topk(msg: pb.TopkLogprobs, cells: Sequence[Sequence[tuple[int, float]] | None]) -> None:
    k = max((len(cell) for cell in cells if cell), default=0)
    token_ids = np.full((len(cells), k), TOPK_EMPTY[0], dtype=_I32)
    logprobs = np.full((len(cells), k), TOPK_EMPTY[1], dtype=_F32)
    for row, cell in enumerate(cells):
        if cell:
            token_ids[row, : len(cell)] = [token_id for token_id, _ in cell]
            logprobs[row, : len(cell)] = [logprob for _, logprob in cell]
    msg.SetInParent()
    msg.token_ids = token_ids.tobytes()
    msg.logprobs = logprobs.tobytes()
    msg.k = k
    msg.length = len(cells)
