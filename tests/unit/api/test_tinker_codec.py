"""The Tinker protobuf codec (api/tinker/codec.py) against bytes laid out by the SDK's rules
(tinker 0.38 request_conv.py / response_conv.py), built here with the vendored schema: the 0.38
SDK is not installed in this environment. scripts/tinker_codec_crosscheck.py checks the same
codec against the real SDK."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest
import zstandard
from google.protobuf.descriptor import Descriptor

from posttrain.api.tinker import tinker_public_pb2 as pb
from posttrain.api.tinker.codec import (
    TOPK_EMPTY,
    WireDatum,
    WireImage,
    WireSequence,
    WireSpan,
    WireTensor,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)
from posttrain.errors import InvalidRequest, PayloadTooLarge

# Request bodies, written the way request_conv.forward_backward_request_to_proto writes them.


def layout(array: np.ndarray) -> tuple[int, str]:
    """The public wire's two request dtypes: integers as int64, floats as float32."""
    return (pb.DTYPE_INT64, "<i8") if array.dtype.kind == "i" else (pb.DTYPE_FLOAT32, "<f4")


def dense(msg: pb.Tensor, array: np.ndarray, with_shape: bool = True) -> None:
    """request_conv._tensor_data_to_proto's dense path; a TensorData built without a shape
    sends none."""
    msg.dtype, wire = layout(array)
    if with_shape:
        msg.shape.extend(array.shape)
    msg.dense = array.astype(wire).tobytes()


def csr(msg: pb.Tensor, array: np.ndarray) -> None:
    """Datum's 2-D target_tokens / weights: TensorData.from_torch_sparse (pad 0, CSR only when
    (rows + 1) + 2 * nnz < rows * cols), then request_conv's sparse path."""
    rows, cols = array.shape
    assert (rows + 1) + 2 * np.count_nonzero(array) < rows * cols, "the SDK would send it dense"
    listed = array != 0
    msg.dtype, wire = layout(array)
    msg.shape.extend(array.shape)
    msg.sparse_csr.values = array[listed].astype(wire).tobytes()
    crow = np.concatenate([[0], np.cumsum(listed.sum(axis=1))]).astype("<i8")
    msg.sparse_csr.crow_indices = crow.tobytes()
    msg.sparse_csr.col_indices = np.nonzero(listed)[1].astype("<i8").tobytes()


def text(datum: pb.Datum, *chunks: list[int]) -> None:
    for tokens in chunks:
        datum.model_input.add().encoded_text.tokens = np.asarray(tokens, "<i4").tobytes()


def request(**fields) -> pb.ForwardBackwardRequest:
    return pb.ForwardBackwardRequest(model_id="sess-1:train:0", seq_id=7, **fields)


def f32(values) -> tuple[float, ...]:
    return tuple(np.asarray(values, dtype=np.float32).tolist())


def test_a_text_datum_decodes_to_its_tokens_and_dense_inputs():
    msg = request(loss_fn="cross_entropy")
    datum = msg.data.add()
    text(datum, [151644, 872, 198], [9707, 11])
    dense(datum.loss_fn_inputs["target_tokens"], np.array([872, 198, 9707, 11, 0]))
    weights = np.array([0.0, 1.0, -0.37, 2.5, -1e-3], dtype=np.float32)
    dense(datum.loss_fn_inputs["weights"], weights)

    wire = decode_forward_backward(msg.SerializeToString(), None)

    head = (wire.model_id, wire.seq_id, wire.loss_fn, wire.forward_only, wire.loss_fn_config)
    assert head == ("sess-1:train:0", 7, "cross_entropy", False, {})
    assert wire.datums == (
        WireDatum(
            tokens=(151644, 872, 198, 9707, 11),
            inputs={
                "target_tokens": WireTensor((872, 198, 9707, 11, 0), (5,), "int64"),
                "weights": WireTensor(f32(weights), (5,), "float32"),
            },
        ),
    )
    assert wire.datums[0].inputs["weights"].values[2] == float(np.float32(-0.37))


def test_loss_fn_config_merges_the_float_map_and_v2_as_the_sdk_writes_them():
    # request_conv dual-writes floats into both maps and strings into v2 only; an older
    # client writes only the float map.
    msg = request(loss_fn="ppo", forward_only=True)
    for key, value in {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}.items():
        msg.loss_fn_config[key] = value
        msg.loss_fn_config_v2[key].number = value
    msg.loss_fn_config_v2["loss_id"].text = "abc123"
    msg.loss_fn_config["legacy_only"] = 3.0
    msg.loss_fn_config["beta"] = 1.0
    msg.loss_fn_config_v2["beta"].number = 0.0  # v2 wins on a shared key, 0.0 included

    wire = decode_forward_backward(msg.SerializeToString(), None)

    assert wire.forward_only is True
    assert wire.loss_fn_config == {
        "beta": 0.0,
        "clip_high_threshold": 1.2,
        "clip_low_threshold": 0.8,
        "legacy_only": 3.0,
        "loss_id": "abc123",
    }


def test_a_sparse_csr_2d_tensor_decodes_to_its_dense_values():
    # Top-k distillation: [N, K] targets and weights, most weights 0, so the SDK sends CSR.
    targets = np.zeros((8, 4), dtype=np.int64)
    targets[0, :3] = [5, 9, 2]
    targets[2, 0], targets[5, 3], targets[7, 1] = 7, 4, 151_000
    weights = np.zeros((8, 4), dtype=np.float32)
    weights[0, 0], weights[2, 3], weights[6, 2] = 0.5, -0.25, 1e-7
    msg = request(loss_fn="cross_entropy")
    datum = msg.data.add()
    text(datum, [1, 2, 3, 4])
    csr(datum.loss_fn_inputs["target_tokens"], targets)
    csr(datum.loss_fn_inputs["weights"], weights)
    assert datum.loss_fn_inputs["weights"].WhichOneof("encoding") == "sparse_csr"

    inputs = decode_forward_backward(msg.SerializeToString(), None).datums[0].inputs

    assert inputs["target_tokens"] == WireTensor(tuple(targets.ravel().tolist()), (8, 4), "int64")
    assert inputs["weights"] == WireTensor(f32(weights.ravel()), (8, 4), "float32")


def test_bfloat16_int32_and_shapeless_tensors_decode():
    bf16 = np.array([1.0, -2.5, 0.15625, 3.0e38], dtype=np.float32)
    msg = request(loss_fn="importance_sampling")
    datum = msg.data.add()
    text(datum, [3, 4])
    half = datum.loss_fn_inputs["advantages"]
    half.dtype = pb.DTYPE_BFLOAT16
    half.shape.extend([2, 2])
    half.dense = (bf16.view("<u4") >> 16).astype("<u2").tobytes()
    ints = datum.loss_fn_inputs["mask"]
    ints.dtype = pb.DTYPE_INT32
    ints.dense = np.array([1, 0, -3], "<i4").tobytes()  # no shape: 1-D
    dense(datum.loss_fn_inputs["logprobs"], np.array([-0.5, -1.5], np.float32), with_shape=False)

    inputs = decode_forward_backward(msg.SerializeToString(), None).datums[0].inputs

    truncated = (bf16.view("<u4") & 0xFFFF0000).view("<f4")
    assert inputs["advantages"] == WireTensor(tuple(truncated.tolist()), (2, 2), "bfloat16")
    assert inputs["advantages"].values[:3] == (1.0, -2.5, 0.15625)
    assert inputs["mask"] == WireTensor((1, 0, -3), (3,), "int32")
    assert inputs["logprobs"] == WireTensor((-0.5, -1.5), (2,), "float32")


def test_provenance_spans_decode_in_order():
    msg = request(loss_fn="stable_reinforce")
    datum = msg.data.add()
    text(datum, [1, 2, 3, 4, 5])
    dense(datum.loss_fn_inputs["target_tokens"], np.array([2, 3, 4, 5, 6]))
    prompt = datum.model_input_spans.add().prompt_tokens
    prompt.sequence_id, prompt.offset, prompt.length = "seq-a", 0, 3
    sampled = datum.model_input_spans.add().sampled_tokens
    sampled.sequence_id, sampled.offset, sampled.length = "seq-a", 0, 2
    tail = datum.loss_fn_input_spans.add().sampled_tokens
    tail.sequence_id, tail.offset, tail.length = "seq-b", 4, 5

    decoded = decode_forward_backward(msg.SerializeToString(), None).datums[0]

    assert decoded.model_input_spans == (
        WireSpan("seq-a", 0, 3, "prompt"),
        WireSpan("seq-a", 0, 2, "sampled"),
    )
    assert decoded.loss_fn_input_spans == (WireSpan("seq-b", 4, 5, "sampled"),)


def test_a_large_zstd_batch_decodes_as_the_uncompressed_one():
    rng = np.random.default_rng(0)
    msg = request(loss_fn="cross_entropy")
    expected = []
    for _ in range(300):
        tokens = rng.integers(0, 150_000, size=int(rng.integers(1, 200)))
        weights = rng.normal(size=tokens.size).astype(np.float32)
        datum = msg.data.add()
        text(datum, tokens[: tokens.size // 2].tolist(), tokens[tokens.size // 2 :].tolist())
        dense(datum.loss_fn_inputs["target_tokens"], tokens)
        dense(datum.loss_fn_inputs["weights"], weights)
        expected.append((tuple(tokens.tolist()), f32(weights)))
    body = msg.SerializeToString()

    plain = decode_forward_backward(body, None)
    packed = decode_forward_backward(zstandard.ZstdCompressor().compress(body), "zstd")
    streamed = zstandard.ZstdCompressor(write_content_size=False).compress(body)

    assert packed == plain == decode_forward_backward(streamed, " ZSTD")
    assert [(d.tokens, d.inputs["weights"].values) for d in plain.datums] == expected
    assert all(d.inputs["target_tokens"].values == d.tokens for d in plain.datums)


# Bad input: InvalidRequest naming the field.


def one_datum(**tensors: np.ndarray) -> tuple[pb.ForwardBackwardRequest, pb.Datum]:
    msg = request(loss_fn="cross_entropy")
    datum = msg.data.add()
    text(datum, [1, 2])
    for name, array in tensors.items():
        dense(datum.loss_fn_inputs[name], array)
    return msg, datum


def rejected(body: bytes, encoding: str | None = None) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        decode_forward_backward(body, encoding)
    return caught.value


def test_garbage_and_bad_zstd_are_invalid_bodies():
    good = one_datum()[0].SerializeToString()
    frame = zstandard.ZstdCompressor().compress(good * 50)
    cases = {
        "not a tinker_public.ForwardBackwardRequest protobuf": (b"\xff\xff\xff\xff\xff\xff", None),
        "does not decompress": (b"this is not zstd", "zstd"),
        "truncated": (frame[:-6], "zstd"),
        "after its frame": (frame + b"\x00", "zstd"),
    }
    for words, (body, encoding) in cases.items():
        error = rejected(body, encoding)
        assert (error.param, words in error.message) == ("body", True), error.message
    error = rejected(good, "gzip")
    assert error.param == "Content-Encoding" and "'gzip'" in error.message


def test_a_body_that_decompresses_past_the_limit_is_too_large():
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    assert len(bomb) < 64 << 10
    with pytest.raises(PayloadTooLarge):
        decode_forward_backward(bomb, "zstd", max_decoded_bytes=16 << 20)


def test_an_image_chunk_holds_its_expected_tokens_positions_and_keeps_its_bytes():
    msg = request(loss_fn="cross_entropy")
    datum = msg.data.add()
    text(datum, [1, 99])
    image = datum.model_input.add().image
    image.data, image.format, image.expected_tokens = b"\x89PNG...", "png", 3
    text(datum, [100, 7])

    (decoded,) = decode_forward_backward(msg.SerializeToString(), None).datums

    assert decoded.tokens == (1, 99, 0, 0, 0, 100, 7)
    assert decoded.images == (WireImage(2, 3, 1, b"\x89PNG...", "png"),)


def test_image_chunks_without_expected_tokens_and_dmel_chunks_name_the_datum():
    msg = request(loss_fn="cross_entropy")
    for _ in range(3):
        text(msg.data.add(), [1, 2])
    datum = msg.data.add()
    text(datum, [1])
    datum.model_input.add().image.data = b"\x89PNG"
    error = rejected(msg.SerializeToString())
    assert error.param == "data[3].model_input"
    assert "chunk 1 is an image chunk without a positive expected_tokens" in error.message

    msg = request(loss_fn="cross_entropy")
    image = msg.data.add().model_input.add().image
    image.data, image.format, image.expected_tokens = b"\x89PNG", "png", 4
    image.override_dimensions.width = 8
    error = rejected(msg.SerializeToString())
    assert error.param == "data[0].model_input" and "override_dimensions" in error.message

    msg = request(loss_fn="cross_entropy")
    msg.data.add().model_input.add().dmel.dmel = b"\x00"
    error = rejected(msg.SerializeToString())
    assert error.param == "data[0].model_input" and "dmel" in error.message


def test_malformed_tensors_name_the_input():
    msg, datum = one_datum(weights=np.ones(2, np.float32))
    datum.loss_fn_inputs["weights"].dense += b"\x00"
    assert rejected(msg.SerializeToString()).param == "data[0].loss_fn_inputs.weights"

    msg, datum = one_datum(weights=np.ones(2, np.float32))
    datum.loss_fn_inputs["weights"].shape[:] = [3]
    error = rejected(msg.SerializeToString())
    assert (error.param, error.message) == (
        "data[0].loss_fn_inputs.weights",
        "2 values do not fill the shape [3]",
    )

    msg, datum = one_datum()
    csr(datum.loss_fn_inputs["target_tokens"], np.array([[0, 0, 3], [0, 0, 0], [0, 0, 0]]))
    datum.loss_fn_inputs["target_tokens"].sparse_csr.col_indices = np.array([3], "<i8").tobytes()
    error = rejected(msg.SerializeToString())
    assert error.param == "data[0].loss_fn_inputs.target_tokens" and "[0, 3)" in error.message

    msg, datum = one_datum()
    csr(datum.loss_fn_inputs["target_tokens"], np.array([[0, 0, 3], [0, 0, 0], [0, 0, 0]]))
    datum.loss_fn_inputs["target_tokens"].sparse_csr.crow_indices = np.array(
        [0, 1, 0, 1], "<i8"
    ).tobytes()
    assert "crow_indices" in rejected(msg.SerializeToString()).message

    msg, datum = one_datum()
    datum.loss_fn_inputs["weights"].dense = b"\x00" * 4  # DTYPE_UNSPECIFIED
    assert rejected(msg.SerializeToString()).param == "data[0].loss_fn_inputs.weights"


def test_odd_token_bytes_and_empty_spans_name_their_field():
    msg, datum = one_datum()
    datum.model_input.add().encoded_text.tokens = b"\x01\x00\x00"
    error = rejected(msg.SerializeToString())
    assert error.param == "data[0].model_input" and "chunk 1's tokens is 3 bytes" in error.message

    msg, datum = one_datum()
    datum.model_input_spans.add()
    assert rejected(msg.SerializeToString()).param == "data[0].model_input_spans[0]"


# Replies, read back the way response_conv.py reads them.


def read_forward_backward_output(body: bytes) -> tuple[str, list[dict], dict[str, float]]:
    """response_conv.deserialize_forward_backward_output, on the vendored schema."""
    msg = pb.ForwardBackwardOutput.FromString(body)
    layouts = {1: "<f4", 2: "<i8", 3: "<i4", 4: "<u2"}
    outputs: list[dict] = []
    for record in msg.loss_fn_outputs:
        rows: list[dict] = [{} for _ in range(record.num_datums)]
        for name, field in record.fields.items():
            offsets = np.frombuffer(field.offsets, "<i8")
            assert [len(offsets), *offsets[[0, -1]]] == [record.num_datums + 1, 0, len(field.data)]
            flat = np.frombuffer(field.data, layouts[field.dtype])
            size, trailing = flat.itemsize, tuple(field.trailing_shape)
            if field.dtype == 4:  # bfloat16: the upper half of a float32
                flat = (flat.astype("<u4") << 16).view("<f4")
            for i in range(record.num_datums):
                values = flat[offsets[i] // size : offsets[i + 1] // size]
                leading = values.size // math.prod(trailing)
                rows[i][name] = (values.tolist(), (leading, *trailing), field.dtype)
        outputs.extend(rows)
    return msg.loss_fn_output_type, outputs, dict(msg.metrics)


def test_forward_backward_output_batches_each_field_with_byte_offsets():
    logprobs = [((-0.5, -1.25, -3.0), (3,)), ((-2.0,), (1,)), ((), (0,))]
    topk_ids = [((1, 2, 3, 4, 5, 6), (3, 2)), ((7, 8), (1, 2)), ((), (0, 2))]
    outputs = [
        {"logprobs": WireTensor(*lp, "float32"), "topk_ids": WireTensor(*ids, "int64")}
        for lp, ids in zip(logprobs, topk_ids, strict=True)
    ]
    metrics = {"loss:sum": 12.5, "valid_tokens:sum": 4.0}

    body = encode_forward_backward_output("ArrayRecord", outputs, metrics)

    msg = pb.ForwardBackwardOutput.FromString(body)
    assert len(msg.loss_fn_outputs) == 1 and msg.loss_fn_outputs[0].num_datums == 3
    offsets = msg.loss_fn_outputs[0].fields["logprobs"].offsets
    assert np.frombuffer(offsets, "<i8").tolist() == [0, 12, 16, 16]
    assert list(msg.loss_fn_outputs[0].fields["topk_ids"].trailing_shape) == [2]
    kind, read, read_metrics = read_forward_backward_output(body)
    assert (kind, read_metrics) == ("ArrayRecord", metrics)
    assert read == [
        {"logprobs": ([-0.5, -1.25, -3.0], (3,), 1), "topk_ids": ([1, 2, 3, 4, 5, 6], (3, 2), 2)},
        {"logprobs": ([-2.0], (1,), 1), "topk_ids": ([7, 8], (1, 2), 2)},
        {"logprobs": ([], (0,), 1), "topk_ids": ([], (0, 2), 2)},
    ]


def test_ragged_trailing_shapes_split_into_records_and_bfloat16_rounds_to_nearest_even():
    halfway_down, halfway_up = 1 + 2**-8, 1 + 3 * 2**-8  # ties: to 1.0 and to 1.015625
    outputs = [
        {"x": WireTensor((1, 2), (1, 2), "int32")},
        {"x": WireTensor((3, 4, 5), (1, 3), "int32")},
        {"x": WireTensor((6, 7, 8), (1, 3), "int32")},
    ]
    body = encode_forward_backward_output("ArrayRecord", outputs, {})
    records = pb.ForwardBackwardOutput.FromString(body).loss_fn_outputs
    assert [record.num_datums for record in records] == [1, 2]
    assert [o["x"][:2] for o in read_forward_backward_output(body)[1]] == [
        ([1, 2], (1, 2)),
        ([3, 4, 5], (1, 3)),
        ([6, 7, 8], (1, 3)),
    ]

    half = WireTensor((halfway_down, halfway_up, -2.5, math.nan, math.inf), (5,), "bfloat16")
    body = encode_forward_backward_output("ArrayRecord", [{"h": half}], {})
    values, shape, dtype = read_forward_backward_output(body)[1][0]["h"]
    assert (values[:3], values[4], shape, dtype) == ([1.0, 1.015625, -2.5], math.inf, (5,), 4)
    assert math.isnan(values[3])


def test_forward_backward_output_edge_cases():
    kind, read, metrics = read_forward_backward_output(
        encode_forward_backward_output("ArrayRecord", [], {"loss:sum": 0.0})
    )
    assert (kind, read, metrics) == ("ArrayRecord", [], {"loss:sum": 0.0})
    # No fields at all: num_datums still counts the datums.
    body = encode_forward_backward_output("ArrayRecord", [{}, {}], {})
    assert pb.ForwardBackwardOutput.FromString(body).loss_fn_outputs[0].num_datums == 2
    with pytest.raises(ValueError, match="same fields"):
        encode_forward_backward_output(
            "ArrayRecord", [{"a": WireTensor((), (0,), "int64")}, {}], {}
        )
    with pytest.raises(ValueError, match="do not fill"):
        encode_forward_backward_output("ArrayRecord", [{"a": WireTensor((1,), (2,), "int64")}], {})


def test_sample_response_carries_sequences_and_prompt_logprobs_as_the_sdk_reads_them():
    body = encode_sample_response(
        [
            WireSequence((11, 12, 13), (-0.25, -1.5, -0.125), "stop"),
            WireSequence((14,), None, "length"),
        ],
        prompt_logprobs=[None, -2.5, -0.75],
        topk_prompt_logprobs=[None, [(5, -0.5), (6, -1.0)], [(7, -0.25)]],
        prompt_cache_hit_tokens=2,
    )

    msg = pb.SampleResponse.FromString(body)
    first, second = msg.sequences
    assert (first.stop_reason, second.stop_reason) == (pb.STOP_REASON_STOP, pb.STOP_REASON_LENGTH)
    assert np.frombuffer(first.tokens, "<i4").tolist() == [11, 12, 13]
    assert np.frombuffer(first.logprobs, "<f4").tolist() == [-0.25, -1.5, -0.125]
    assert np.frombuffer(second.tokens, "<i4").tolist() == [14]
    assert not second.HasField("logprobs") and not first.HasField("topk_sampled_logprobs")
    prompt = np.frombuffer(msg.prompt_logprobs, "<f4")
    assert math.isnan(prompt[0]) and prompt[1:].tolist() == [-2.5, -0.75]
    topk = msg.topk_prompt_logprobs
    assert (topk.length, topk.k, msg.prompt_cache_hit_tokens) == (3, 2, 2)
    empty_id, empty_logprob = TOPK_EMPTY
    ids = np.frombuffer(topk.token_ids, "<i4").reshape(3, 2).tolist()
    assert ids == [[empty_id, empty_id], [5, 6], [7, empty_id]]
    logprobs = np.frombuffer(topk.logprobs, "<f4").reshape(3, 2).tolist()
    assert logprobs == [[empty_logprob, empty_logprob], [-0.5, -1.0], [-0.25, empty_logprob]]


def test_sample_response_without_prompt_fields_and_with_sampled_topk():
    body = encode_sample_response(
        [WireSequence((1, 2), (-0.5, -0.5), "stop", topk_logprobs=(((1, -0.5),), None))]
    )
    msg = pb.SampleResponse.FromString(body)
    assert not msg.HasField("prompt_logprobs") and not msg.HasField("topk_prompt_logprobs")
    sampled = msg.sequences[0].topk_sampled_logprobs
    assert (sampled.length, sampled.k) == (2, 1)
    assert np.frombuffer(sampled.token_ids, "<i4").tolist() == [1, 0]
    with pytest.raises(ValueError, match="stop_reason"):
        encode_sample_response([WireSequence((), None, "eos")])


def test_the_vendored_schema_lives_beside_the_together_shims_tinker_proto():
    """Both register tinker_public.proto, with different contents; the vendored one is in a
    private pool, so both import in either order and each parses the other's bytes."""
    sdk = pytest.importorskip("tinker.proto.tinker_public_pb2")
    assert pb.DESCRIPTOR.pool is not sdk.DESCRIPTOR.pool
    msg, _ = one_datum(weights=np.array([0.5, 1.0], np.float32))
    parsed = sdk.ForwardBackwardRequest.FromString(msg.SerializeToString())
    assert parsed.SerializeToString() == msg.SerializeToString()
    sdk_first = (
        "import tinker.proto.tinker_public_pb2 as sdk\n"
        "import posttrain.api.tinker.tinker_public_pb2 as pb\n"
        "print(pb.Tensor.FromString(sdk.Tensor(dense=b'ab').SerializeToString()).dense)"
    )
    done = subprocess.run([sys.executable, "-c", sdk_first], capture_output=True, text=True)
    assert (done.returncode, done.stdout.strip()) == (0, "b'ab'"), done.stderr


def test_the_type_stub_declares_every_message_field_and_enum_value_of_the_vendored_schema():
    """tinker_public_pb2.pyi is generated from the vendored module's descriptor (its header
    says how): a schema vendored again without the stub regenerated fails here, not as a type
    checker reading fields the wire no longer has."""
    tree = ast.parse(Path(pb.__file__).with_suffix(".pyi").read_text())
    declared: dict[str, set[str]] = {}

    def collect(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                names = declared.setdefault(prefix + node.name, set())
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
                    elif isinstance(item, ast.FunctionDef):
                        names.add(item.name)
                collect(node.body, f"{prefix}{node.name}.")

    def messages(descriptors: Iterable[Descriptor]) -> Iterator[Descriptor]:
        for descriptor in descriptors:
            yield descriptor
            yield from messages(descriptor.nested_types)

    collect(tree.body, "")
    package = pb.DESCRIPTOR.package + "."
    for message in messages(pb.DESCRIPTOR.message_types_by_name.values()):
        name = message.full_name.removeprefix(package)
        assert name in declared, name
        fields = {field.name for field in message.fields}
        assert fields <= declared[name], (name, fields - declared[name])
    module_level = {
        node.target.id
        for node in tree.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    values = {v.name for e in pb.DESCRIPTOR.enum_types_by_name.values() for v in e.values}
    assert values <= module_level, values - module_level
