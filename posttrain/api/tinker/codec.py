"""The Tinker wire's forward_backward request as plain values: the ForwardBackwardRequest
protobuf the SDK POSTs to /api/v1/forward_backward, decoded into frozen dataclasses. The
replies (ForwardBackwardOutput, SampleResponse) are codec_replies.py.

A pure function over the vendored schema (tinker_public_pb2), so the routes hold no protobuf
or byte-layout knowledge. The layout is the SDK's own (tinker 0.38.0,
tinker/proto/request_conv.py): token chunks are int32 little-endian bytes; a tensor is either
`dense` bytes in its dtype or `sparse_csr` (values in its dtype, int64 row pointers and column
indices), which the SDK picks for a 2-D `target_tokens` / `weights` when that is smaller; the
cells CSR leaves out are 0 (the SDK's pad value for loss inputs; the wire carries no other).

Imports: api.tinker.tinker_public_pb2, errors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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
DTYPES: dict[int, tuple[str, np.dtype]] = {
    pb.DTYPE_FLOAT32: ("float32", np.dtype("<f4")),
    pb.DTYPE_INT64: ("int64", np.dtype("<i8")),
    pb.DTYPE_INT32: ("int32", np.dtype("<i4")),
    pb.DTYPE_BFLOAT16: ("bfloat16", np.dtype("<u2")),
}
_I32 = np.dtype("<i4")
_I64 = np.dtype("<i8")
_SPAN_KINDS = {"prompt_tokens": "prompt", "sampled_tokens": "sampled"}


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
class WireDatum:
    """One datum: its input tokens (the text chunks joined) and its loss inputs by name. The
    span tuples are empty when the datum carries no provenance (the SDK sends both or
    neither)."""

    tokens: tuple[int, ...]
    inputs: dict[str, WireTensor]
    model_input_spans: tuple[WireSpan, ...] = ()
    loss_fn_input_spans: tuple[WireSpan, ...] = ()


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
    return WireDatum(
        tokens=_tokens(msg, f"{where}.model_input"),
        inputs={
            name: _tensor(msg.loss_fn_inputs[name], f"{where}.loss_fn_inputs.{name}")
            for name in sorted(msg.loss_fn_inputs)
        },
        model_input_spans=_spans(msg.model_input_spans, f"{where}.model_input_spans"),
        loss_fn_input_spans=_spans(msg.loss_fn_input_spans, f"{where}.loss_fn_input_spans"),
    )


def _tokens(msg: pb.Datum, param: str) -> tuple[int, ...]:
    parts = []
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind == "encoded_text":
            parts.append(_array(chunk.encoded_text.tokens, _I32, param, f"chunk {j}'s tokens"))
        elif kind is None:
            raise InvalidRequest(f"chunk {j} is empty (no encoded_text)", param=param)
        else:
            raise InvalidRequest(
                f"chunk {j} is an {kind} chunk: posttrain serves text models only, so "
                "model_input takes encoded_text chunks",
                param=param,
            )
    return tuple(np.concatenate(parts).tolist()) if parts else ()


def _spans(spans: Sequence[pb.ProvenanceSpan], param: str) -> tuple[WireSpan, ...]:
    out = []
    for k, span in enumerate(spans):
        arm = span.WhichOneof("span")
        if arm is None:
            raise InvalidRequest(
                "the span is neither prompt_tokens nor sampled_tokens", param=f"{param}[{k}]"
            )
        run = getattr(span, arm)
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
    return WireTensor(values=tuple(flat.tolist()), shape=shape, dtype=name)


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
