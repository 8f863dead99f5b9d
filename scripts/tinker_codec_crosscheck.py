"""Cross-check posttrain's Tinker protobuf codec against the real tinker 0.38 SDK.

What: the SDK (in its own environment, given by --sdk-python) builds a forward_backward
request from `tinker.Datum` objects through its own request_conv, exactly as
TrainingClient.forward_backward sends it (plain and zstd), and writes down what it put in;
posttrain's codec (api/tinker/codec.py) decodes both bodies here and must give those values
back exactly. Then posttrain's codec encodes a ForwardBackwardOutput and a SampleResponse,
and the SDK's response_conv parses them and must read the values put in.

Why: the unit tests (tests/unit/api/test_tinker_codec.py) build the wire by hand, following
the SDK's rules, because CI has no 0.38 SDK; this script checks those rules against the SDK
itself. The batch covers 1-D and 2-D targets (dense, and sparse CSR as Datum picks it for a
sparse 2-D torch tensor when torch is importable, else built as TensorData.from_torch_sparse
builds it), negative weights, list inputs, provenance spans, string and float loss configs,
and a 1024-datum batch (the SDK's default chunk length).

Run from the repository root in posttrain's environment:

    python scripts/tinker_codec_crosscheck.py --sdk-python /path/to/tinker-0.38-venv/bin/python

It prints one line per check and exits non-zero on the first mismatch. The SDK's environment
needs only `tinker==0.38.0`; this script lends it this environment's torch (appended to its
sys.path) so the SDK's own torch-to-CSR conversion runs, and says so when it cannot.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REQUEST_JSON, REPLIES_JSON = "request_expected.json", "replies_expected.json"


# The SDK side (runs under --sdk-python; imports tinker, never posttrain).


def sdk_build(out: Path, datums: int) -> None:
    torch_dir = os.environ.get("XCHECK_TORCH_DIR")
    if torch_dir:
        sys.path.append(torch_dir)  # after the SDK's own packages
    import tinker
    import zstandard
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.types.tensor_data import _HAVE_TORCH

    rng = np.random.default_rng(26)
    data, originals = [], []
    for i in range(datums):
        length = int(rng.integers(2, 300))
        tokens = rng.integers(0, 151_000, size=length)
        cut = int(rng.integers(0, length))
        model_input = tinker.ModelInput(
            chunks=[
                tinker.EncodedTextChunk(tokens=tokens[:cut].tolist()),
                tinker.EncodedTextChunk(tokens=tokens[cut:].tolist()),
            ]
        )
        weights = rng.normal(size=length).astype(np.float32)  # negative ones included
        inputs: dict = {"target_tokens": np.roll(tokens, -1), "weights": weights}
        if i % 7 == 1:  # plain lists: Datum types them by key
            inputs = {"target_tokens": np.roll(tokens, -1).tolist(), "weights": weights.tolist()}
            inputs["advantages"] = rng.normal(size=length).astype(np.float32).tolist()
        elif i % 7 == 2:  # top-k distillation: [N, K] targets and weights, dense
            inputs["target_tokens"] = rng.integers(0, 151_000, size=(length, 4))
            inputs["weights"] = rng.random(size=(length, 4)).astype(np.float32)
        elif i % 7 == 3:  # [N, K] with most weights zero: CSR
            targets = rng.integers(1, 151_000, size=(length, 5)) * (rng.random((length, 5)) < 0.1)
            sparse_weights = (rng.normal(size=(length, 5)) * (targets != 0)).astype(np.float32)
            inputs["target_tokens"] = _sdk_sparse(targets, tinker, _HAVE_TORCH)
            inputs["weights"] = _sdk_sparse(sparse_weights, tinker, _HAVE_TORCH)
            originals_2d = {"target_tokens": targets, "weights": sparse_weights}
        datum = tinker.Datum(model_input=model_input, loss_fn_inputs=inputs)
        if i % 5 == 0:
            datum = datum.with_provenance(
                model_input=[
                    tinker.PromptProvenanceSpan(sequence_id=f"s{i}", offset=0, length=cut),
                    tinker.SampledProvenanceSpan(
                        sequence_id=f"s{i}", offset=3, length=length - cut
                    ),
                ],
                loss_fn_inputs=[tinker.SampledProvenanceSpan(sequence_id=f"s{i}", length=length)],
            )
        data.append(datum)
        expected_inputs = {}
        for name, td in datum.loss_fn_inputs.items():
            if td.sparse_crow_indices is not None:
                dense = originals_2d[name]
                if _HAVE_TORCH:  # the SDK's own densification agrees
                    assert np.array_equal(td.to_numpy(), dense), name
            else:
                dense = td.to_numpy()
            expected_inputs[name] = {
                "values": dense.ravel().tolist(),
                "shape": list(td.shape) if td.shape is not None else [dense.size],
                "dtype": td.dtype,
            }
        originals.append(
            {
                "tokens": tokens.tolist(),
                "inputs": expected_inputs,
                "model_input_spans": _spans(datum.model_input_spans),
                "loss_fn_input_spans": _spans(datum.loss_fn_input_spans),
            }
        )

    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28, "loss_id": "dpo-ref"}
    request = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(
            data=data, loss_fn="cross_entropy", loss_fn_config=config
        ),
        model_id="sess-xcheck:train:0",
        seq_id=42,
    )
    # What resources/training.py sends.
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = True
    body = msg.SerializeToString()
    (out / "request.pb").write_bytes(body)
    (out / "request.pb.zst").write_bytes(zstandard.ZstdCompressor().compress(body))
    encodings: dict[str, int] = {}
    for datum_msg in msg.data:
        for tensor in datum_msg.loss_fn_inputs.values():
            kind = tensor.WhichOneof("encoding")
            encodings[kind] = encodings.get(kind, 0) + 1
    expected = {
        "model_id": "sess-xcheck:train:0",
        "seq_id": 42,
        "loss_fn": "cross_entropy",
        "loss_fn_config": config,
        "forward_only": True,
        "datums": originals,
        "encodings": encodings,
        "torch": _HAVE_TORCH,
        "sdk_version": tinker.__version__,
    }
    (out / REQUEST_JSON).write_text(json.dumps(expected))


def _sdk_sparse(dense: np.ndarray, tinker, have_torch: bool):
    """What Datum does with a 2-D torch target_tokens / weights (TensorData.from_torch_sparse);
    without torch, the same TensorData built from numpy."""
    if have_torch:
        import torch

        return torch.from_numpy(dense)  # Datum converts it
    listed = dense != 0
    return tinker.TensorData(
        data=dense[listed],
        dtype="int64" if dense.dtype.kind == "i" else "float32",
        shape=list(dense.shape),
        sparse_crow_indices=[0, *np.cumsum(listed.sum(axis=1)).tolist()],
        sparse_col_indices=np.nonzero(listed)[1].tolist(),
    )


def _spans(spans) -> list:
    if spans is None:
        return []
    kinds = {"PromptProvenanceSpan": "prompt", "SampledProvenanceSpan": "sampled"}
    return [[s.sequence_id, s.offset, s.length, kinds[type(s).__name__]] for s in spans]


def sdk_read(out: Path) -> None:
    from tinker.proto.response_conv import (
        deserialize_forward_backward_output,
        deserialize_sample_response,
    )

    expected = json.loads((out / REPLIES_JSON).read_text())
    for name, want in expected["forward_backward"].items():
        got = deserialize_forward_backward_output((out / f"{name}.pb").read_bytes())
        read = [
            {
                field: {"values": td.tolist(), "shape": list(td.shape), "dtype": td.dtype}
                for field, td in output.items()
            }
            for output in got.loss_fn_outputs
        ]
        _same(f"{name}: loss_fn_output_type", got.loss_fn_output_type, want["type"])
        _same(f"{name}: metrics", got.metrics, want["metrics"])
        _same(f"{name}: {len(read)} datums' outputs", read, want["outputs"])

    want = expected["sample"]
    got = deserialize_sample_response((out / "sample.pb").read_bytes())
    read = [
        {
            "tokens": s.tokens,
            "logprobs": s.logprobs,
            "stop_reason": s.stop_reason,
            "topk_logprobs": _lists(s.topk_logprobs),
        }
        for s in got.sequences
    ]
    _same("sample: sequences", read, want["sequences"])
    _same("sample: prompt_logprobs (None at 0)", got.prompt_logprobs, want["prompt_logprobs"])
    _same("sample: topk_prompt_logprobs", _lists(got.topk_prompt_logprobs), want["topk_prompt"])
    _same("sample: prompt_cache_hit_tokens", got.prompt_cache_hit_tokens, want["cache_hits"])


def _lists(cells):
    if cells is None:
        return None
    return [None if cell is None else [list(pair) for pair in cell] for cell in cells]


def _same(what: str, got, want) -> None:
    if _canonical(got) != _canonical(want):
        print(f"MISMATCH {what}:\n  got  {str(got)[:600]}\n  want {str(want)[:600]}")
        sys.exit(1)
    print(f"ok  {what}")


def _canonical(value):
    """Equal values compare equal: tuples as lists, NaN as a marker."""
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    return value


# posttrain's side.


def check_request(out: Path) -> None:
    from posttrain.api.tinker.codec import decode_forward_backward

    expected = json.loads((out / REQUEST_JSON).read_text())
    print(
        f"SDK {expected['sdk_version']} built {len(expected['datums'])} datums; tensor "
        f"encodings {expected['encodings']}; torch in the SDK process: {expected['torch']}"
    )
    if "sparse_csr" not in expected["encodings"]:
        print("MISMATCH: the SDK sent no sparse_csr tensor, so CSR was not checked")
        sys.exit(1)
    for path, encoding in (("request.pb", None), ("request.pb.zst", "zstd")):
        wire = decode_forward_backward((out / path).read_bytes(), encoding)
        got = {
            "model_id": wire.model_id,
            "seq_id": wire.seq_id,
            "loss_fn": wire.loss_fn,
            "loss_fn_config": wire.loss_fn_config,
            "forward_only": wire.forward_only,
            "datums": [
                {
                    "tokens": d.tokens,
                    "inputs": {
                        name: {"values": t.values, "shape": t.shape, "dtype": t.dtype}
                        for name, t in d.inputs.items()
                    },
                    "model_input_spans": [list(vars(s).values()) for s in d.model_input_spans],
                    "loss_fn_input_spans": [list(vars(s).values()) for s in d.loss_fn_input_spans],
                }
                for d in wire.datums
            ],
        }
        for key in ("model_id", "seq_id", "loss_fn", "loss_fn_config", "forward_only"):
            _same(f"request ({encoding or 'plain'}): {key}", got[key], expected[key])
        _same(
            f"request ({encoding or 'plain'}): {len(got['datums'])} datums",
            got["datums"],
            expected["datums"],
        )


def write_replies(out: Path) -> None:
    from posttrain.api.tinker.codec import (
        WireSequence,
        WireTensor,
        encode_forward_backward_output,
        encode_sample_response,
    )

    rng = np.random.default_rng(38)

    def f32(values) -> list[float]:
        return np.asarray(values, dtype=np.float32).tolist()

    large, large_want = [], []
    for _ in range(1024):
        n = int(rng.integers(0, 300))
        logprobs = f32(-rng.exponential(size=n))
        topk = rng.integers(0, 151_000, size=(n, 3)).ravel().tolist()
        large.append(
            {
                "logprobs": WireTensor(tuple(logprobs), (n,), "float32"),
                "topk_ids": WireTensor(tuple(topk), (n, 3), "int64"),
            }
        )
        large_want.append(
            {
                "logprobs": {"values": logprobs, "shape": [n], "dtype": "float32"},
                "topk_ids": {
                    "values": np.reshape(topk, (n, 3)).tolist(),
                    "shape": [n, 3],
                    "dtype": "int64",
                },
            }
        )
    metrics = {"loss:sum": 1234.5, "valid_tokens:sum": 987.0}
    (out / "fwdbwd_large.pb").write_bytes(
        encode_forward_backward_output("ArrayRecord", large, metrics)
    )

    # Ragged trailing shapes (two ArrayRecords), bfloat16 and int32 widened by the SDK.
    bf16 = [1.0, -2.5, 1 + 2**-8, 1 + 3 * 2**-8]  # the last two round to 1.0 and 1.015625
    ragged = [
        {"x": WireTensor((1, 2), (1, 2), "int32"), "h": WireTensor(tuple(bf16), (4,), "bfloat16")},
        {"x": WireTensor((3, 4, 5), (1, 3), "int32"), "h": WireTensor((0.5,), (1,), "bfloat16")},
    ]
    ragged_want = [
        {
            "x": {"values": [[1, 2]], "shape": [1, 2], "dtype": "int64"},
            "h": {"values": [1.0, -2.5, 1.0, 1.015625], "shape": [4], "dtype": "float32"},
        },
        {
            "x": {"values": [[3, 4, 5]], "shape": [1, 3], "dtype": "int64"},
            "h": {"values": [0.5], "shape": [1], "dtype": "float32"},
        },
    ]
    (out / "fwdbwd_ragged.pb").write_bytes(
        encode_forward_backward_output("ArrayRecord", ragged, {"loss:sum": 0.0})
    )
    (out / "fwdbwd_empty.pb").write_bytes(encode_forward_backward_output("ArrayRecord", [], {}))

    sequences = [
        WireSequence((11, 12, 13), (-0.1, -1.7, -0.03), "stop"),
        WireSequence((14, 15), None, "length"),
        WireSequence((16,), (-2.2,), "stop", topk_logprobs=(((16, -2.2), (3, -2.9)),)),
    ]
    prompt_logprobs = [None, -3.1, -0.42, -7.75]
    topk_prompt = [None, [(5, -0.5), (6, -1.25)], [(7, -0.1)], [(8, -0.2), (9, -0.3)]]
    (out / "sample.pb").write_bytes(
        encode_sample_response(
            sequences,
            prompt_logprobs=prompt_logprobs,
            topk_prompt_logprobs=topk_prompt,
            prompt_cache_hit_tokens=3,
        )
    )
    expected = {
        "forward_backward": {
            "fwdbwd_large": {"type": "ArrayRecord", "metrics": metrics, "outputs": large_want},
            "fwdbwd_ragged": {
                "type": "ArrayRecord",
                "metrics": {"loss:sum": 0.0},
                "outputs": ragged_want,
            },
            "fwdbwd_empty": {"type": "ArrayRecord", "metrics": {}, "outputs": []},
        },
        "sample": {
            "sequences": [
                {
                    "tokens": [11, 12, 13],
                    "logprobs": f32([-0.1, -1.7, -0.03]),
                    "stop_reason": "stop",
                    "topk_logprobs": None,
                },
                {
                    "tokens": [14, 15],
                    "logprobs": None,
                    "stop_reason": "length",
                    "topk_logprobs": None,
                },
                {
                    "tokens": [16],
                    "logprobs": f32([-2.2]),
                    "stop_reason": "stop",
                    "topk_logprobs": [[[16, f32(-2.2)], [3, f32(-2.9)]]],
                },
            ],
            "prompt_logprobs": [None, *f32(prompt_logprobs[1:])],
            "topk_prompt": [
                None if c is None else [[t, f32(lp)] for t, lp in c] for c in topk_prompt
            ],
            "cache_hits": 3,
        },
    }
    (out / REPLIES_JSON).write_text(json.dumps(expected))


def run_sdk(sdk_python: str, role: str, out: Path, env: dict[str, str], datums: int) -> None:
    command = [sdk_python, __file__, "--role", role, "--out", str(out), "--datums", str(datums)]
    done = subprocess.run(command, env=env)
    if done.returncode:
        sys.exit(done.returncode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdk-python", help="python of an environment with tinker==0.38.0")
    parser.add_argument("--datums", type=int, default=1024)
    parser.add_argument("--role", choices=["sdk-build", "sdk-read"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "sdk-build":
        sdk_build(args.out, args.datums)
        return
    if args.role == "sdk-read":
        sdk_read(args.out)
        return
    if not args.sdk_python:
        parser.error("--sdk-python is required")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the SDK's environment, not posttrain's
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.origin:
        env["XCHECK_TORCH_DIR"] = str(Path(spec.origin).parent.parent)
    with tempfile.TemporaryDirectory(prefix="tinker-xcheck-") as tmp:
        out = Path(tmp)
        subprocess.run(
            [args.sdk_python, "-c", "import tinker; assert tinker.__version__ == '0.38.0'"],
            check=True,
            env=env,
        )
        run_sdk(args.sdk_python, "sdk-build", out, env, args.datums)
        check_request(out)
        write_replies(out)
        run_sdk(args.sdk_python, "sdk-read", out, env, args.datums)
    print("all checks passed")


if __name__ == "__main__":
    main()
