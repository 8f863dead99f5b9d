"""The Tinker wire's protobuf bodies as plain values, both ways. Requests in: the
ForwardBackwardRequest the SDK POSTs to /api/v1/forward_backward, decoded into frozen
dataclasses. Replies out: what retrieve_future returns as `application/x-protobuf`, encoded
from plain values: the ForwardBackwardOutput of a forward-backward (per-datum output tensors
and metrics) and the SampleResponse of a sample.

Pure functions over the vendored schema (tinker_public_pb2), so the routes hold no protobuf
or byte-layout knowledge; both directions share one dtype table and one tensor type. The
layout is the SDK's own (tinker 0.38.0, tinker/proto/request_conv.py and response_conv.py;
its deserialize_forward_backward_output and deserialize_sample_response give back the values
put in): token chunks are int32 little-endian bytes; a request tensor is either `dense` bytes
in its dtype or `sparse_csr` (values in its dtype, int64 row pointers and column indices),
which the SDK picks for a 2-D `target_tokens` / `weights` when that is smaller; the cells CSR
leaves out are 0 (the SDK's pad value for loss inputs; the wire carries no other).

Imports: api.tinker.tinker_public_pb2, errors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard
from google.protobuf.message import DecodeError

from posttrain.api.tinker import tinker_public_pb2 as pb
from posttrain.errors import InvalidRequest, PayloadTooLarge

# The largest body a forward_backward may decompress to; the route may pass its own limit.
DEFAULT_MAX_DECODED_BYTES = 1 << 30
# The most cells one tensor may densify to (a sparse CSR tensor declares its dense shape).
MAX_TENSOR_ELEMENTS = 1 << 28
# Compressed bytes fed to zstd at a time: a feed inflates to at most ~32 MiB (an RLE block is
# 4 bytes for 128 KiB), which bounds how far a decompression bomb passes the limit.
_ZSTD_FEED = 1 << 10

# Proto DType -> (the dtype's name in WireTensor, its little-endian layout on the wire).
# bfloat16 travels as the upper 16 bits of a float32.
DTYPES: dict[pb.DType.ValueType, tuple[str, np.dtype[Any]]] = {
    pb.DTYPE_FLOAT32: ("float32", np.dtype("<f4")),
    pb.DTYPE_INT64: ("int64", np.dtype("<i8")),
    pb.DTYPE_INT32: ("int32", np.dtype("<i4")),
    pb.DTYPE_BFLOAT16: ("bfloat16", np.dtype("<u2")),
}
_BY_NAME = {name: (code, layout) for code, (name, layout) in DTYPES.items()}
_I32 = np.dtype("<i4")
_I64 = np.dtype("<i8")
_F32 = np.dtype("<f4")
_SPAN_KINDS = {"prompt_tokens": "prompt", "sampled_tokens": "sampled"}
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
# The SDK's filler for a top-k cell with no entry (tinker/types/topk_logprobs.py MASK_LOGPROB).
TOPK_EMPTY = (0, -99999.0)


@dataclass(frozen=True)
class WireTensor:
    """A tensor, dense, row-major: `values` has prod(shape) entries (floats for float32 and
    bfloat16, ints for int64 and int32)."""

    values: tuple[float, ...] | tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str  # "float32" | "int64" | "int32" | "bfloat16"


@dataclass(frozen=True)
class WireSpan:
    """One provenance run: these datum positions are [offset, offset + length) of the named
    sequence's prompt (kind "prompt") or of its sampled tokens (kind "sampled")."""

    sequence_id: str
    offset: int
    length: int
    kind: str  # "prompt" | "sampled"


@dataclass(frozen=True)
class WireImage:
    """An image chunk of a model input: its bytes and format, the token positions
    [offset, offset + expected_tokens) it stands for, and its chunk index."""

    offset: int
    expected_tokens: int
    chunk: int
    data: bytes
    format: str


@dataclass(frozen=True)
class WireDatum:
    """One datum: its input tokens (the text chunks joined, an image chunk's
    `expected_tokens` positions held by 0s) and its loss inputs by name. The span tuples are
    empty when the datum carries no provenance (the SDK sends both or neither)."""

    tokens: tuple[int, ...]
    inputs: dict[str, WireTensor]
    model_input_spans: tuple[WireSpan, ...] = ()
    loss_fn_input_spans: tuple[WireSpan, ...] = ()
    images: tuple[WireImage, ...] = ()


@dataclass(frozen=True)
class WireForwardBackward:
    """A decoded ForwardBackwardRequest. `loss_fn_config` merges the legacy float map with
    `loss_fn_config_v2` (number or text), v2 winning on a shared key as the SDK intends."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    datums: tuple[WireDatum, ...]


@dataclass(frozen=True)
class WireSequence:
    """One sampled sequence: its tokens, their logprobs (None when not asked for), why it
    stopped ("stop" or "length"), and optionally per sampled position up to k (token_id,
    logprob) pairs (None or empty for a position without any)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    stop_reason: str
    topk_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...] | None = None


# Requests in.


def decode_forward_backward(
    body: bytes,
    content_encoding: str | None,
    *,
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
) -> WireForwardBackward:
    """The ForwardBackwardRequest in `body` (zstd-compressed when `content_encoding` says
    "zstd"). Raises InvalidRequest naming the field for anything malformed or not text, and
    PayloadTooLarge when the body decompresses past `max_decoded_bytes`."""
    raw = _decompressed(bytes(body), content_encoding, max_decoded_bytes)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except DecodeError as exc:
        raise InvalidRequest(
            f"the body is not a tinker_public.ForwardBackwardRequest protobuf: {exc}",
            param="body",
        ) from exc
    return WireForwardBackward(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        loss_fn_config=_loss_fn_config(msg),
        forward_only=msg.forward_only,
        datums=tuple(_datum(datum, i) for i, datum in enumerate(msg.data)),
    )


def _decompressed(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        raw = body
    elif encoding == "zstd":
        raw = _unzstd(body, limit)
    else:
        raise InvalidRequest(
            f"Content-Encoding {content_encoding!r} is not supported: send zstd or none",
            param="Content-Encoding",
        )
    if len(raw) > limit:
        raise _too_large(limit)
    return raw


def _unzstd(body: bytes, limit: int) -> bytes:
    decompressor = zstandard.ZstdDecompressor().decompressobj()
    out = bytearray()
    view = memoryview(body)
    end = 0
    try:
        while end < len(view) and not decompressor.eof:
            out += decompressor.decompress(view[end : end + _ZSTD_FEED])
            end += _ZSTD_FEED
            if len(out) > limit:
                raise _too_large(limit)
    except zstandard.ZstdError as exc:
        raise InvalidRequest(f"the zstd body does not decompress: {exc}", param="body") from exc
    if not decompressor.eof:
        raise InvalidRequest("the zstd body ends inside its frame (truncated)", param="body")
    if decompressor.unused_data or end < len(view):
        raise InvalidRequest("the zstd body has bytes after its frame", param="body")
    return bytes(out)


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the forward_backward body decompresses to more than {limit} bytes", param="body"
    )


def _loss_fn_config(msg: pb.ForwardBackwardRequest) -> dict[str, float | str]:
    config: dict[str, float | str] = {key: float(v) for key, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        arm = value.WhichOneof("value")
        if arm is None:
            raise InvalidRequest(
                f"loss_fn_config_v2[{key!r}] holds neither a number nor a text",
                param=f"loss_fn_config_v2.{key}",
            )
        config[key] = float(value.number) if arm == "number" else value.text
    return dict(sorted(config.items()))


def _datum(msg: pb.Datum, i: int) -> WireDatum:
    where = f"data[{i}]"
    tokens, images = _tokens(msg, f"{where}.model_input")
    return WireDatum(
        tokens=tokens,
        images=images,
        inputs={
            name: _tensor(msg.loss_fn_inputs[name], f"{where}.loss_fn_inputs.{name}")
            for name in sorted(msg.loss_fn_inputs)
        },
        model_input_spans=_spans(msg.model_input_spans, f"{where}.model_input_spans"),
        loss_fn_input_spans=_spans(msg.loss_fn_input_spans, f"{where}.loss_fn_input_spans"),
    )


def _tokens(msg: pb.Datum, param: str) -> tuple[tuple[int, ...], tuple[WireImage, ...]]:
    """The datum's tokens, an image's positions held by 0s, and its image chunks."""
    parts = []
    images = []
    offset = 0
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind == "encoded_text":
            parts.append(_array(chunk.encoded_text.tokens, _I32, param, f"chunk {j}'s tokens"))
        elif kind == "image":
            image = _image(chunk.image, j, offset, param)
            images.append(image)
            parts.append(np.zeros(image.expected_tokens, dtype=_I32))
        elif kind is None:
            raise InvalidRequest(f"chunk {j} is empty (no encoded_text)", param=param)
        else:
            raise InvalidRequest(
                f"chunk {j} is an {kind} chunk: model_input takes encoded_text and image"
                " chunks",
                param=param,
            )
        offset += len(parts[-1])
    if not parts:
        return (), ()
    tokens: list[int] = np.concatenate(parts).tolist()
    return tuple(tokens), tuple(images)


def _image(msg: pb.ImageChunk, j: int, offset: int, param: str) -> WireImage:
    # A datum's length counts an image as its expected_tokens (the SDK's ImageChunk.length),
    # so its loss inputs' lengths are known only with it.
    if not msg.HasField("expected_tokens") or msg.expected_tokens <= 0:
        raise InvalidRequest(
            f"chunk {j} is an image chunk without a positive expected_tokens; a datum's"
            " length counts an image as its expected_tokens",
            param=param,
        )
    if msg.HasField("override_dimensions"):
        raise InvalidRequest(
            f"chunk {j}: override_dimensions is not served (the image is processed at its"
            " own size)",
            param=param,
        )
    return WireImage(
        offset=offset,
        expected_tokens=msg.expected_tokens,
        chunk=j,
        data=bytes(msg.data),
        format=msg.format,
    )


def _spans(spans: Sequence[pb.ProvenanceSpan], param: str) -> tuple[WireSpan, ...]:
    out = []
    for k, span in enumerate(spans):
        arm = span.WhichOneof("span")
        if arm is None:
            raise InvalidRequest(
                "the span is neither prompt_tokens nor sampled_tokens", param=f"{param}[{k}]"
            )
        run = span.prompt_tokens if arm == "prompt_tokens" else span.sampled_tokens
        if not run.sequence_id or run.offset < 0 or run.length < 0:
            raise InvalidRequest(
                "a span needs a sequence_id and a non-negative offset and length",
                param=f"{param}[{k}]",
            )
        out.append(WireSpan(run.sequence_id, run.offset, run.length, _SPAN_KINDS[arm]))
    return tuple(out)


def _tensor(msg: pb.Tensor, param: str) -> WireTensor:
    if msg.dtype not in DTYPES:
        raise InvalidRequest(
            f"tensor dtype {msg.dtype} is not float32, int64, int32 or bfloat16", param=param
        )
    name, layout = DTYPES[msg.dtype]
    shape = tuple(msg.shape)
    if any(dim < 0 for dim in shape):
        raise InvalidRequest(f"the shape {list(shape)} has a negative dimension", param=param)
    if math.prod(shape) > MAX_TENSOR_ELEMENTS:
        raise InvalidRequest(
            f"the shape {list(shape)} is over {MAX_TENSOR_ELEMENTS} elements", param=param
        )
    if msg.WhichOneof("encoding") == "sparse_csr":
        flat = _densified(msg.sparse_csr, layout, shape, param)
    else:  # dense; a tensor with neither encoding set is an empty dense one
        flat = _array(msg.dense, layout, param, "the dense data")
        if not shape:  # the SDK leaves the shape out of a 1-D tensor built without one
            shape = (flat.size,)
        elif math.prod(shape) != flat.size:
            raise InvalidRequest(
                f"{flat.size} values do not fill the shape {list(shape)}", param=param
            )
    if name == "bfloat16":
        flat = (flat.astype("<u4") << 16).view("<f4")
    values: list[float] | list[int] = flat.tolist()
    return WireTensor(values=tuple(values), shape=shape, dtype=name)


def _densified(
    csr: pb.SparseCsr, layout: np.dtype, shape: tuple[int, ...], param: str
) -> np.ndarray:
    if len(shape) != 2:
        raise InvalidRequest(
            f"a sparse_csr tensor needs a 2-D shape, not {list(shape)}", param=param
        )
    rows, cols = shape
    values = _array(csr.values, layout, param, "sparse_csr.values")
    crow = _array(csr.crow_indices, _I64, param, "sparse_csr.crow_indices")
    col = _array(csr.col_indices, _I64, param, "sparse_csr.col_indices")
    nnz = values.size
    counts = np.diff(crow)
    if crow.size != rows + 1 or crow[0] != 0 or crow[-1] != nnz or (counts < 0).any():
        raise InvalidRequest(
            f"sparse_csr.crow_indices must rise from 0 to the {nnz} values in {rows + 1} entries",
            param=param,
        )
    if col.size != nnz or (nnz and (col.min() < 0 or col.max() >= cols)):
        raise InvalidRequest(
            f"sparse_csr.col_indices must be {nnz} columns in [0, {cols})", param=param
        )
    row_of = np.repeat(np.arange(rows, dtype=np.int64), counts)
    same_row = row_of[1:] == row_of[:-1]
    if (col[1:][same_row] <= col[:-1][same_row]).any():
        raise InvalidRequest(
            "sparse_csr.col_indices must increase strictly within each row", param=param
        )
    dense = np.zeros(rows * cols, dtype=layout)
    dense[row_of * cols + col] = values
    return dense


def _array(raw: bytes, layout: np.dtype, param: str, what: str) -> np.ndarray:
    if len(raw) % layout.itemsize:
        raise InvalidRequest(
            f"{what} is {len(raw)} bytes, not a whole number of {layout.itemsize}-byte values",
            param=param,
        )
    return np.frombuffer(raw, dtype=layout)


# Replies out.


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
    bits: npt.NDArray[np.uint32] = floats.view("<u4")
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(layout)
    nan = np.isnan(floats)
    rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(layout)
    return rounded


def _signature(
    output: Mapping[str, WireTensor], names: list[str]
) -> tuple[tuple[str, tuple[int, ...]], ...]:
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
