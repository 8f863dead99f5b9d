"""Domain types shared by the service and the engine: plain frozen dataclasses and enums.

Names follow the API's vocabulary (api.md). Enum values are the wire spellings, so a domain value
serialises to the wire unchanged. Wire-only details (seed-era aliases, string token ids, dtype
names) are gone by the time a value becomes one of these types: api/schemas/ converts once.

The stored records that hold these values are records.py's; their lifecycle enums, statuses.py's.
Imports: nothing from posttrain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class LossType(StrEnum):
    CROSS_ENTROPY = "LOSS_TYPE_CROSS_ENTROPY"
    IMPORTANCE_SAMPLING = "LOSS_TYPE_IMPORTANCE_SAMPLING"
    PPO = "LOSS_TYPE_PPO"
    CISPO = "LOSS_TYPE_CISPO"
    DRO = "LOSS_TYPE_DRO"
    DPPO = "LOSS_TYPE_DPPO"
    GRPO = "LOSS_TYPE_GRPO"
    GSPO = "LOSS_TYPE_GSPO"  # the Tinker surface's only (loss_specs.LossSpec.dialects)


class GrpoAggregation(StrEnum):
    FIXED_HORIZON = "GRPO_LOSS_AGGREGATION_TYPE_FIXED_HORIZON"
    TOKEN_MEAN = "GRPO_LOSS_AGGREGATION_TYPE_TOKEN_MEAN"
    SEQUENCE_MEAN = "GRPO_LOSS_AGGREGATION_TYPE_SEQUENCE_MEAN"


class GrpoRatioType(StrEnum):
    TOKEN = "GRPO_LOSS_RATIO_TYPE_TOKEN"
    SEQUENCE = "GRPO_LOSS_RATIO_TYPE_SEQUENCE"


class OperationKind(StrEnum):
    FORWARD_BACKWARD = "forward-backward"
    CUSTOM_FORWARD_BACKWARD = "custom-forward-backward"
    OPTIM_STEP = "optim-step"
    WEIGHTS_SYNC = "weights-sync"
    SAMPLE = "sample"
    TRAINING_CHECKPOINT = "training-checkpoint"
    INFERENCE_CHECKPOINT = "inference-checkpoint"


class WeightSyncType(StrEnum):
    SYNCHRONOUS = "WEIGHT_SYNC_TYPE_SYNCHRONOUS"
    BACKGROUND_PUBLISH = "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH"
    PIPELINE = "WEIGHT_SYNC_TYPE_PIPELINE"


class StopReason(StrEnum):
    STOP = "STOP_REASON_STOP"
    LENGTH = "STOP_REASON_LENGTH"


class CheckpointType(StrEnum):
    TRAINING = "CHECKPOINT_TYPE_TRAINING"
    INFERENCE = "CHECKPOINT_TYPE_INFERENCE"


class MuonScaling(StrEnum):
    MATCH_ADAM = "MUON_SCALING_STRATEGY_MATCH_ADAM"
    ORIGINAL = "MUON_SCALING_STRATEGY_ORIGINAL"


# ---------------------------------------------------------------- losses (losses.md)

# What each loss takes and allows (params ranges, required inputs, wire names) is one table in
# posttrain/loss_specs.py; these types hold values that passed it.


@dataclass(frozen=True)
class PpoParams:
    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.2


@dataclass(frozen=True)
class CispoParams:
    clip_low_threshold: float = 0.0
    clip_high_threshold: float = 4.0


@dataclass(frozen=True)
class DroParams:
    beta: float


@dataclass(frozen=True)
class DppoParams:
    delta_low: float = 0.15
    delta_high: float = 0.15


@dataclass(frozen=True)
class GrpoParams:
    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.28
    beta: float = 0.0
    agg_type: GrpoAggregation = GrpoAggregation.FIXED_HORIZON
    ratio_type: GrpoRatioType = GrpoRatioType.TOKEN


@dataclass(frozen=True)
class GspoParams:
    """Tinker's gspo: absolute bounds on the sequence ratio (losses.md 9.3, tinker/losses.py)."""

    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.2


LossParams = PpoParams | CispoParams | DroParams | DppoParams | GrpoParams | GspoParams | None


@dataclass(frozen=True)
class LossConfig:
    """A loss type and its parameters; `params` is None for CE and IS."""

    type: LossType
    params: LossParams = None


# ---------------------------------------------------------------- training requests


@dataclass(frozen=True)
class MoeShape:
    """What an expert route of a mixture-of-experts model holds per token."""

    num_layers: int  # MoE layers, in model order
    top_k: int
    num_experts: int


@dataclass(frozen=True)
class ExpertRoutes:
    """The top-k experts of every token in every MoE layer of a model (routing replay):
    little-endian uint16, row-major over [num_tokens, num_layers, top_k] (api.md 5.2)."""

    num_tokens: int
    num_layers: int
    top_k: int
    data: bytes = field(repr=False)


@dataclass(frozen=True)
class ImageInput:
    """An image in a model input: `data` holds PNG or JPEG bytes (`format` "png" or "jpeg")
    that stand for the `num_tokens` token positions [offset, offset + num_tokens); `chunk` is
    the image's index among the input's chunks, which errors name. The tokens at those
    positions are the model's image placeholder once the service has checked the image
    (engine/images.py)."""

    offset: int
    num_tokens: int
    chunk: int
    data: bytes
    format: str


@dataclass(frozen=True)
class TrainingSample:
    """One sample: `tokens` is the model input ((prompt + completion)[:-1]); every
    `loss_fn_inputs` value has exactly len(tokens) entries (checked by the api layer).

    `targets_per_position` K > 1 (the Tinker surface's [N, K] target_tokens, top-k
    distillation; cross-entropy only): target_tokens and weights then hold N * K entries,
    row-major (position n's K targets at [n * K, (n + 1) * K)), every other key N, and the
    sample's logprobs are N * K values in the same order (`loss_length`).

    `routed_experts_key` names routes the sampler recorded; the service resolves it into
    `routed_experts` at submit, so the engine only ever reads the routes."""

    tokens: tuple[int, ...]
    loss_fn_inputs: dict[str, tuple[float, ...]]
    routed_experts_key: str | None = None
    routed_experts: ExpertRoutes | None = None
    targets_per_position: int = 1
    images: tuple[ImageInput, ...] = ()  # in offset order; () for a text-only sample

    @property
    def loss_length(self) -> int:
        """Entries of target_tokens, weights and the reported logprobs: N * K."""
        return len(self.tokens) * self.targets_per_position


@dataclass(frozen=True)
class ForwardBackwardRequest:
    samples: tuple[TrainingSample, ...]
    loss: LossConfig
    forward_only: bool = False
    return_loss_fn_outputs: bool = False
    # The Tinker surface: report the logprob of every target (outputs always carry one per
    # target there), not 0.0 where the loss excludes a position (losses.md 1.3).
    report_all_logprobs: bool = False


@dataclass(frozen=True)
class CustomForwardBackwardRequest:
    samples: tuple[TrainingSample, ...]
    gradients: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class AdamParams:
    """Per-step AdamW settings; omitted fields take these defaults every step (losses.md 12.2)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip_norm: float = 1.0


@dataclass(frozen=True)
class MuonParams:
    """Per-step Muon settings (losses.md 12.3). `adam` holds the values for the parameters Muon
    does not own; None means AdamParams defaults with the lr rule of losses.md 12.3."""

    learning_rate: float = 0.02
    momentum: float = 0.95
    newton_schulz_steps: int = 5
    weight_decay: float = 0.1
    grad_clip_norm: float | None = None
    adam: AdamParams | None = None


@dataclass(frozen=True)
class OptimStepRequest:
    adam: AdamParams | None = None
    muon: MuonParams | None = None


@dataclass(frozen=True)
class WeightsSyncRequest:
    weight_sync_type: WeightSyncType = WeightSyncType.SYNCHRONOUS


# ---------------------------------------------------------------- sampling


# The most top-k alternatives per prompt position a sample request may ask for: the service
# refuses more (service/operations/submit.py) and the Together schema advertises it (api.md 1.4.6).
# 20 is the tinker cookbook's default and recommended width for top-k distillation.
MAX_TOPK_PROMPT_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How a sample request's sequences are drawn, and where each one ends.

    A sequence ends with STOP at the first sampled token that is one of `stop_token_ids`, or
    one of the model's EOS ids while `stop_at_eos` holds, or that completes one of the `stop`
    strings (the text of the sequence, stop strings spanning tokens); that token is the last one
    returned, with its logprob. Otherwise it ends with LENGTH after `max_tokens` tokens. With
    `stop_at_eos` False and no other stop a sequence always runs to `max_tokens`.

    `max_tokens` None: as many tokens as the context length leaves after the longest prompt,
    within the operation token limit (service/operations/submit.py resolves it at submit; the engine
    only ever sees a number).

    The Together surface sends strings only and always stops at EOS. Tinker's `stop`: None ->
    the defaults here; [] -> stop_at_eos False; a list of strings -> `stop`; a list of token
    ids -> `stop_token_ids` (EOS still stops, as with strings).
    """

    max_tokens: int | None = 100
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_at_eos: bool = True


@dataclass(frozen=True)
class SampleRequest:
    prompts: tuple[tuple[int, ...], ...]
    num_samples: int = 1
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    return_routed_experts: bool = False
    # Per prompt, its images in offset order (ImageInput); () when no prompt has one.
    prompt_images: tuple[tuple[ImageInput, ...], ...] = ()

    def images_of(self, index: int) -> tuple[ImageInput, ...]:
        """The images of prompt `index`."""
        return self.prompt_images[index] if self.prompt_images else ()


@dataclass(frozen=True)
class CheckpointRequest:  # the checkpoint operations take no body: the kind says which type
    type: CheckpointType


# An operation POST as the api layer parsed it: one type per kind.
OperationRequest = (
    ForwardBackwardRequest
    | CustomForwardBackwardRequest
    | OptimStepRequest
    | WeightsSyncRequest
    | SampleRequest
    | CheckpointRequest
)


# ---------------------------------------------------------------- sessions and resources


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 8
    alpha: float = 16
    dropout: float = 0.0
    seed: int = 0
    train_unembed: bool = True


# ---------------------------------------------------------------- results (wire field names)


@dataclass(frozen=True)
class ForwardBackwardResult:
    loss: float
    metrics: dict[str, float]
    # One list of per-token logprobs per sample when return_loss_fn_outputs was set.
    loss_fn_outputs: list[list[float]] | None = None
    # With them, each sample's per-token share of `loss` (Tinker's elementwise_loss).
    elementwise_loss: list[list[float]] | None = None


@dataclass(frozen=True)
class PolicySegment:
    start_token: int
    version: int


@dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    prompt_cache_hit_tokens: int = 0
    # return_routed_experts on an MoE model: the engine returns the routes of prompt and
    # completion (all but the last token); the service stores them and answers with the key.
    routed_experts: ExpertRoutes | None = None
    routed_experts_key: str | None = None


@dataclass(frozen=True)
class TopkPromptLogprobs:
    token_ids: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class LogprobMismatch:
    """|sampled logprob - the trainer's logprob| over one result's sampled tokens, where the
    generators run apart from the trainer (vLLM) and the trainer scored what they sampled."""

    mean: float
    max: float
    tokens: int


@dataclass(frozen=True)
class SampleResult:
    """One prompt's sequences. `prompt_logprobs` and `topk_prompt_logprobs` cover the whole
    prompt; entry i belongs to prompt token i given the tokens before it, so entry 0 has no
    value: it holds the placeholder 0.0 (and an empty top-k entry), which the Together wire
    sends as is (api.md 1.4.6) and the Tinker wire sends as NaN (its SDK reads None there)."""

    sequences: list[SampledSequence]
    policy_segments: list[PolicySegment]
    prompt_logprobs: list[float] | None = None
    topk_prompt_logprobs: list[TopkPromptLogprobs] | None = None
    logprob_mismatch: LogprobMismatch | None = None
    # Why the prompt did not go through the enabled prefix cache (a model whose layers keep a
    # recurrent state); None: it did, or the cache is off. Counted in /metrics.
    prefix_cache_refused: str | None = None


@dataclass(frozen=True)
class SampleOutput:  # one result per prompt
    results: tuple[SampleResult, ...]


@dataclass(frozen=True)
class OptimStepOutput:
    step: int


@dataclass(frozen=True)
class WeightsSyncOutput:
    weights_version: int


@dataclass(frozen=True)
class CustomForwardBackwardOutput:  # the empty object: custom forward-backward returns nothing
    pass


@dataclass(frozen=True)
class CheckpointRef:
    id: str
    created_at: float
    step: int


@dataclass(frozen=True)
class CheckpointOutput:
    checkpoint: CheckpointRef


# A completed operation's output, in wire field names; store/repo.py reads it back by kind.
OperationOutput = (
    ForwardBackwardResult
    | CustomForwardBackwardOutput
    | OptimStepOutput
    | WeightsSyncOutput
    | SampleOutput
    | CheckpointOutput
)


@dataclass(frozen=True)
class OperationTypes:
    """What an operation of one kind takes and completes with. The layers' own halves of the
    kind table build on it: service/operations/kinds.py (scheduling, durability, restart) and
    api/kinds.py (wire body and reply)."""

    request: type
    output: type


OPERATION_TYPES: dict[OperationKind, OperationTypes] = {
    OperationKind.FORWARD_BACKWARD: OperationTypes(ForwardBackwardRequest, ForwardBackwardResult),
    OperationKind.CUSTOM_FORWARD_BACKWARD: OperationTypes(
        CustomForwardBackwardRequest, CustomForwardBackwardOutput
    ),
    OperationKind.OPTIM_STEP: OperationTypes(OptimStepRequest, OptimStepOutput),
    OperationKind.WEIGHTS_SYNC: OperationTypes(WeightsSyncRequest, WeightsSyncOutput),
    OperationKind.SAMPLE: OperationTypes(SampleRequest, SampleOutput),
    OperationKind.TRAINING_CHECKPOINT: OperationTypes(CheckpointRequest, CheckpointOutput),
    OperationKind.INFERENCE_CHECKPOINT: OperationTypes(CheckpointRequest, CheckpointOutput),
}
