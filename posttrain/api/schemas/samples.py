"""Training samples as they arrive, and their conversion to TrainingSample.

Two sample shapes arrive (api.md 5.2): 3.1.1 `loss_fn_inputs`, a map of TensorData, and the
seed-era `loss_inputs`, a fixed structure with one inputs block per loss. Both become the same
TrainingSample; every error names the field the client actually sent, per sample. What each
loss requires and allows is the table in posttrain/loss_specs.py; limits that need the model
are checked by the service.

Imports: api.schemas.wire, loss_specs, types, errors.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import math

from pydantic import ConfigDict

from posttrain.api.schemas.wire import Int64, Int64List, Wire
from posttrain.errors import InvalidRequest
from posttrain.loss_specs import INPUT_SPECS, LOSS_FN_INPUT_KEYS, LOSS_SPECS, required_inputs
from posttrain.types import ExpertRoutes, LossConfig, LossType, TrainingSample


class EncodedTextIn(Wire):
    tokens: Int64List


class ChunkIn(Wire):
    encoded_text: EncodedTextIn


class ModelInputIn(Wire):
    chunks: list[ChunkIn]

    def tokens(self) -> tuple[int, ...]:
        return tuple(itertools.chain.from_iterable(c.encoded_text.tokens for c in self.chunks))


# The dtype of a loss_fn_inputs key when none is sent (those it may carry: INPUT_SPECS).
DEFAULT_DTYPES = {"target_tokens": "int64"}


def wire_dtype(name: str | None, key: str, param: str) -> str:
    """3.1.1 `int64`/`float32`, or a seed-era `D_TYPE_*` name in any case (api.md 5.3)."""
    spelling = (name or "unspecified").lower().removeprefix("d_type_")
    if spelling == "unspecified":
        return DEFAULT_DTYPES.get(key, "float32")
    if spelling == "bfloat16":
        return "float32"  # the values are JSON numbers either way
    if spelling not in ("int64", "float32"):
        raise InvalidRequest(f"unknown dtype {name!r}", param=f"{param}.dtype")
    return spelling


class TensorIn(Wire):
    """TensorData (api.md 4.1); seed-era tensors have the same fields. Its values are checked
    by parse_numbers (finite, integral where asked), which names the index."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=True)

    data: list[float | int | str]
    dtype: str | None = None
    shape: list[Int64] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class PolicySegmentIn(Wire):
    version: Int64
    start_token: Int64 | None = None


class PolicyInputsIn(Wire):
    """A seed-era per-loss block: importance_sampling_inputs, ppo_inputs, cispo_inputs,
    dro_inputs or dppo_inputs."""

    advantages: TensorIn | None = None
    logprobs: TensorIn | None = None

    def sent(self, path: str) -> dict[str, tuple[TensorIn, str]]:
        """3.1.1 key -> (tensor, the field path it was sent under)."""
        fields = {"advantages": self.advantages, "logprobs": self.logprobs}
        return {k: (t, f"{path}.{k}") for k, t in fields.items() if t is not None}


class GrpoInputsIn(PolicyInputsIn):
    generator_logprobs: TensorIn | None = None  # April spelling of logprobs
    reference_logprobs: TensorIn | None = None

    def sent(self, path: str) -> dict[str, tuple[TensorIn, str]]:
        out = super().sent(path)
        if self.generator_logprobs is not None:
            if self.logprobs is not None:
                raise InvalidRequest(
                    "send logprobs or generator_logprobs, not both",
                    param=f"{path}.generator_logprobs",
                )
            out["logprobs"] = (self.generator_logprobs, f"{path}.generator_logprobs")
        if self.reference_logprobs is not None:
            out["reference_logprobs"] = (self.reference_logprobs, f"{path}.reference_logprobs")
        return out


class RoutedExpertsIn(Wire):
    """Seed-era routes (api.md 5.2): base64 of a contiguous little-endian uint16 buffer,
    row-major over `shape` = [num_tokens, num_layers, topk]; shape items may be strings."""

    data: str
    shape: list[Int64]

    def to_domain(self, param: str) -> ExpertRoutes:
        if len(self.shape) != 3 or min(self.shape) < 0:
            raise InvalidRequest(
                f"shape {self.shape} must be [num_tokens, num_layers, topk]",
                param=f"{param}.shape",
            )
        try:
            data = base64.b64decode(self.data, validate=True)
        except binascii.Error:
            raise InvalidRequest("data is not base64", param=f"{param}.data") from None
        tokens, layers, top_k = self.shape
        if len(data) != 2 * tokens * layers * top_k:
            raise InvalidRequest(
                f"data holds {len(data)} bytes; shape {self.shape} of uint16 needs"
                f" {2 * tokens * layers * top_k}",
                param=f"{param}.data",
            )
        return ExpertRoutes(tokens, layers, top_k, data)


class LossInputsIn(Wire):
    """Seed-era structured inputs (api.md 5.2)."""

    target_tokens: TensorIn | None = None
    weights: TensorIn | None = None
    loss_mask: TensorIn | None = None  # April
    grpo_inputs: GrpoInputsIn | None = None
    importance_sampling_inputs: PolicyInputsIn | None = None
    ppo_inputs: PolicyInputsIn | None = None
    cispo_inputs: PolicyInputsIn | None = None
    dro_inputs: PolicyInputsIn | None = None
    dppo_inputs: PolicyInputsIn | None = None  # see loss_specs: accepted for symmetry
    routed_experts: RoutedExpertsIn | None = None

    def blocks(self) -> dict[LossType, PolicyInputsIn]:
        """The per-loss blocks this sample sent, by the loss each belongs to (LOSS_SPECS)."""
        named = {
            loss_type: getattr(self, spec.inputs_block)
            for loss_type, spec in LOSS_SPECS.items()
            if spec.inputs_block is not None
        }
        return {loss_type: block for loss_type, block in named.items() if block is not None}

    def sent(self, path: str, loss_type: LossType | None) -> dict[str, tuple[TensorIn, str]]:
        """3.1.1 key -> (tensor, field path) for a request whose loss is `loss_type` (None:
        custom-forward-backward, which reads no inputs block)."""
        fields = {"target_tokens": self.target_tokens, "weights": self.weights}
        out = {k: (t, f"{path}.{k}") for k, t in fields.items() if t is not None}
        if self.loss_mask is not None:
            # Cross-entropy takes no mask (api.md 4.4); a 0/1 loss_mask means 0/1 weights there.
            key = "weights" if loss_type == LossType.CROSS_ENTROPY else "mask"
            if "weights" in out:
                raise InvalidRequest(
                    "send weights or loss_mask, not both", param=f"{path}.loss_mask"
                )
            out[key] = (self.loss_mask, f"{path}.loss_mask")
        if loss_type is None or LOSS_SPECS[loss_type].inputs_block is None:
            return out  # CE and custom-forward-backward read no block; others are ignored
        block_name = LOSS_SPECS[loss_type].inputs_block
        block = self.blocks().get(loss_type)
        if block is None:
            raise InvalidRequest(
                f"{loss_type.value} reads its inputs from loss_inputs.{block_name}",
                param=f"{path}.{block_name}",
            )
        return {**out, **block.sent(f"{path}.{block_name}")}


class TrainingSampleIn(Wire):
    model_input: ModelInputIn
    loss_fn_inputs: dict[str, TensorIn] | None = None
    loss_inputs: LossInputsIn | None = None  # seed era (api.md 5.2)
    routed_experts_key: str | None = None
    # Seed era: which policy versions produced the tokens. Accepted and ignored (api.md 5.2).
    policy_segments: list[PolicySegmentIn] | None = None

    def sent(self, where: str, loss_type: LossType | None) -> dict[str, tuple[TensorIn, str]]:
        if (self.loss_fn_inputs is None) == (self.loss_inputs is None):
            raise InvalidRequest(
                "a sample needs exactly one of loss_fn_inputs and loss_inputs (seed era)",
                param=f"{where}.loss_fn_inputs",
            )
        if self.loss_inputs is not None:
            return self.loss_inputs.sent(f"{where}.loss_inputs", loss_type)
        assert self.loss_fn_inputs is not None
        return {k: (t, f"{where}.loss_fn_inputs.{k}") for k, t in self.loss_fn_inputs.items()}

    def param_of(self, where: str, key: str, loss_type: LossType | None) -> str:
        """Where `key` belongs in this sample's shape: for errors about a missing input."""
        if self.loss_inputs is None:
            return f"{where}.loss_fn_inputs.{key}"
        if loss_type is None or key in ("target_tokens", "weights"):
            return f"{where}.loss_inputs.{key}"
        return f"{where}.loss_inputs.{LOSS_SPECS[loss_type].inputs_block}.{key}"


def parse_numbers(
    values: list[float | int | str], param: str, *, integral: bool
) -> tuple[float, ...]:
    """Numbers from a tensor's data. The common case (JSON numbers, all finite, integral where
    asked) runs in C (map over builtins); anything else takes the loop that names the index."""
    if set(map(type, values)) <= {int, float}:
        numbers = tuple(map(float, values))
        if all(map(math.isfinite, numbers)) and (
            not integral or all(map(float.is_integer, numbers))
        ):
            return numbers
    out: list[float] = []
    for index, value in enumerate(values):
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise InvalidRequest(f"{param}[{index}] is not a number", param=param) from None
        else:
            number = float(value)
        if not math.isfinite(number):
            raise InvalidRequest(f"{param}[{index}] is not finite", param=param)
        if integral and not number.is_integer():
            raise InvalidRequest(f"{param}[{index}] = {value} is not an integer", param=param)
        out.append(number)
    return tuple(out)


def _tensor_values(key: str, tensor: TensorIn, param: str, num_tokens: int) -> tuple[float, ...]:
    """One loss input as numbers, after the checks of api.md 4.1 and 4.2."""
    if tensor.sparse_crow_indices is not None or tensor.sparse_col_indices is not None:
        raise InvalidRequest("sparse tensors are not supported", param=param)
    dtype = wire_dtype(tensor.dtype, key, param)
    allowed = INPUT_SPECS[key].dtypes
    if dtype not in allowed:
        raise InvalidRequest(
            f"{key} must be {' or '.join(sorted(allowed))}, got {dtype}",
            param=f"{param}.dtype",
        )
    if tensor.shape is not None and tensor.shape != [len(tensor.data)]:
        raise InvalidRequest(
            f"shape {tensor.shape} must be [{len(tensor.data)}] (1-D only)",
            param=f"{param}.shape",
        )
    if len(tensor.data) != num_tokens:
        raise InvalidRequest(
            f"{key} has {len(tensor.data)} values, model_input has {num_tokens} tokens",
            param=param,
        )
    return parse_numbers(tensor.data, param, integral=dtype == "int64")


def sample_to_domain(
    sample: TrainingSampleIn, index: int, loss_type: LossType | None
) -> TrainingSample:
    """One sample in either shape -> TrainingSample. `loss_type` picks the seed-era inputs
    block (None for custom-forward-backward)."""
    tokens = sample.model_input.tokens()
    where = f"samples[{index}]"
    if not tokens:
        raise InvalidRequest(f"{where}.model_input has no tokens", param=f"{where}.model_input")
    routes = None
    if sample.loss_inputs is not None and sample.loss_inputs.routed_experts is not None:
        param = f"{where}.loss_inputs.routed_experts"
        if sample.routed_experts_key is not None:
            raise InvalidRequest("send routed_experts_key or routed_experts, not both", param=param)
        routes = sample.loss_inputs.routed_experts.to_domain(param)
    inputs: dict[str, tuple[float, ...]] = {}
    for key, (tensor, param) in sample.sent(where, loss_type).items():
        if key not in LOSS_FN_INPUT_KEYS:
            known = ", ".join(sorted(LOSS_FN_INPUT_KEYS))
            raise InvalidRequest(f"unknown loss_fn_inputs key {key!r}; known: {known}", param=param)
        inputs[key] = _tensor_values(key, tensor, param, len(tokens))
    if "target_tokens" not in inputs:
        raise InvalidRequest(
            "target_tokens is required", param=sample.param_of(where, "target_tokens", None)
        )
    if "weights" in inputs and "mask" in inputs:
        raise InvalidRequest("send weights or mask, not both", param=f"{where}.loss_fn_inputs.mask")
    return TrainingSample(
        tokens=tokens,
        loss_fn_inputs=inputs,
        routed_experts_key=sample.routed_experts_key,
        routed_experts=routes,
    )


def check_required_inputs(
    loss: LossConfig, wire: list[TrainingSampleIn], samples: tuple[TrainingSample, ...]
) -> None:
    """Per sample, so the error names the sample that lacks an input (api.md 4.4)."""
    required = required_inputs(loss)
    for index, (sample_in, sample) in enumerate(zip(wire, samples, strict=True)):
        for key, why in required.items():
            if key not in sample.loss_fn_inputs:
                raise InvalidRequest(
                    f"{loss.type.value}{why} requires {key} in every sample",
                    param=sample_in.param_of(f"samples[{index}]", key, loss.type),
                )
