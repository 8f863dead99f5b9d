"""What an operation will allocate beyond what the engine holds now: its estimated peak bytes,
so an operation that cannot fit is refused before it runs (memory/headroom.py says what is
free). footprint.py counts what is resident; this module counts what one pass adds on top.

Each estimate is an upper bound built from the tensors the pass creates, not a fit:

- forward-backward keeps, until its backward, every decoder layer's saved activations: per
  token and layer about 6 hidden-sized tensors (the two RMSNorm inputs and outputs, the two
  residual adds' operands), 4 of the query width (projection, q-norm in and out, rotary output,
  attention output), 6 of the KV width (keys and values before and after k-norm and rotary,
  repeated for sdpa) and 6 of the FFN width (gate, up, SiLU in and out, their product, the
  down projection's input). Multi-head latent attention (DeepSeek-V3, latent_attention.py)
  caches a compressed latent but trains on full heads: its query width is heads x
  (qk_nope_head_dim + qk_rope_head_dim), its KV width the mean of the per-head keys' and values'
  (heads x qk_head_dim, heads x v_head_dim), and its q_a / kv_a latents add LATENT_COPIES of
  q_lora_rank + kv_lora_rank + qk_rope_head_dim (projection out, norm in and out). Its keys and
  values differ in width, which a CPU's fused sdpa kernel does not take: there sdpa's unfused
  path keeps each head's softmaxed [T, T] scores, SCORE_COPIES per layer (the saved weights, and
  their and the scores' gradients in backward) of heads x the longest row per token.
  tests/unit/engine/test_memory_estimate.py counts the bytes autograd
  saves (saved_tensors_hooks) and measures the peak RSS of a pass in a subprocess: the per-layer
  count is at least the saved bytes, and ACTIVATION_SAFETY (1.5) covers what backward allocates
  while it runs (the gradient of the largest activation, allocator slack), so the estimate is
  never below the measured peak and within 2.5x of it. With its decoder layers checkpointed
  (train/layer_checkpoint.py) a pass keeps one hidden-sized input per layer and token instead,
  and at the backward's peak one layer's activations, recomputed, and their gradients
  (RECOMPUTED_LAYERS): memory that grows with the tokens, the layers adding a hidden vector
  each (an MoE layer's captured routes besides, K int64 per token, within the safety factor).
- the head's log-softmax runs over chunks of logprob_chunk_tokens positions (train/logprobs.py), so
  logits cost chunk x vocab x 4 bytes x LOGIT_COPIES (logits, log-softmax, their gradients in
  backward), plus the hidden-sized unit the frozen head keeps per token.
- the gradients it accumulates: new gradients beside the earlier ones, then their sum.
- a linear-attention (Gated DeltaNet) layer of a hybrid keeps, in place of attention's query
  and KV activations, its mixer's float32 tensors (transformers' chunked delta rule): per value
  head LINEAR_CHUNK_COPIES rows of the 64-wide chunk matrices and LINEAR_VECTOR_COPIES of its
  key and value vectors, and LINEAR_CONV_COPIES of the convolution's channels (measured on
  three shapes: 1.12x to 1.17x of the saved bytes with the rest of the layer's count).
- sampling holds a KV cache of num_samples x (prompt + max_tokens) positions x layers x 2 x
  kv_heads x head_dim x dtype bytes (MLA: the latent's kv_lora_rank + qk_rope_head_dim numbers,
  padded to an even width, in place of 2 x kv_heads x head_dim; the prompt once per prompt,
  model/fanout_kv_cache.py; the generated part grown in steps of DECODE_POSITIONS_PER_GROWTH
  and counted twice: the old and new buffer side by side while it grows, or a compaction's
  gathered copy: the sampler's peak_own_positions), per decode pass rows x vocab float32
  logits in SAMPLE_LOGIT_COPIES (log-softmax, probabilities, top-k/top-p sorts and masks), and
  per generated token the Python lists of its token and logprob and its share of the recorded
  result. Prompts prefilled side by side attend through [Q, K] masks (bounded by the prefill
  pass's positions times the longest prompt); a lone prompt's chunks build none. A hybrid's
  rows hold a recurrent state each besides (linear_attention.py: per linear layer the conv
  state and the float32 delta-rule state), whatever their length: one per prompt and two per
  sequence (the old and the new while rows grow).
- a sample stream's pool (rows allocated at its start for operations joining later): per row a
  prompt row rounded up to the pool's width and the generated part as above; the stream sizes
  it itself (generate/sample_stream.py pool_rows, pool_row_bytes) from what is free.
- a vision-language model's images: per placeholder token, its merge window's patches through
  every Linear of the vision tower (the sum of their output widths, twice: inputs of norms and
  residuals beside), an upper bound whether the tower is frozen (one block at a time) or
  trained (every block's saved).
- optim-step's AdamW moments (two per trainable tensor) appear at a session's first step, and
  each tensor's update allocates temporaries of its size.

Not here: what is free (headroom.py), the refusal (service/scheduling/admission.py).

Legend: S = samples (training) or sequences (sampling), T = tokens, V = vocab, H = hidden size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from posttrain.engine.generate.decode_rows import max_tokens_of
from posttrain.engine.generate.prefill import PREFILL_TOKENS_PER_PASS
from posttrain.engine.generate.sampler import peak_own_positions
from posttrain.model.kv_shape import KVShape
from posttrain.types import (
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    SampleRequest,
    TrainingSample,
)

FLOAT32 = 4
INT64 = 8
ACTIVATION_SAFETY = 1.5
# Per token and decoder layer, in units of the hidden, query, KV and FFN widths (module docstring).
HIDDEN_COPIES, QUERY_COPIES, KV_COPIES, FFN_COPIES = 6, 4, 6, 6
# MLA's latents per token and layer (module docstring), and its [T, T] scores per head where
# sdpa runs unfused.
LATENT_COPIES, SCORE_COPIES = 3, 2
LOGIT_COPIES = 4
# A linear-attention (Gated DeltaNet) layer's mixer per token, float32 whatever the model's
# dtype (transformers' chunked delta rule): per value head, [chunk]-wide rows of the chunk's
# decay, UT-system and attention matrices, and copies of its key and value vectors; copies of
# the convolution's channels (module docstring).
LINEAR_CHUNK, LINEAR_CHUNK_COPIES, LINEAR_VECTOR_COPIES, LINEAR_CONV_COPIES = 64, 8, 6, 3
# Checkpointed, the backward's peak holds one layer's recomputed activations and the gradients
# its backward computes from them, about as many again: ACTIVATION_SAFETY's slack over every
# layer's activations covered those when all were kept, and one layer's is too little for them
# (measured: tests/unit/engine/test_memory_estimate.py).
RECOMPUTED_LAYERS = 2
SAMPLE_LOGIT_COPIES = 8
# Boolean prefill masks per pass: the full-attention and the sliding-window one.
MASK_COPIES = 2
# Per token of a batch: its packed inputs (tokens, targets, masks, positions as int64) and
# float32 per-token outputs (logprobs, loss terms, their gradients).
PACKED_BYTES_PER_TOKEN = 8 * INT64 + 8 * FLOAT32
# Per generated token: two Python list entries (int and float objects) while decoding, then the
# result's lists and the JSON the store records.
PYTHON_BYTES_PER_GENERATED_TOKEN = 256


@dataclass(frozen=True)
class ModelShape:
    """The widths that size a pass's tensors: attention's from the model's modules (a config
    may carry head counts its family ignores; MLA's, whose cache holds a latent rather than
    heads, from its config: _attention_widths), the rest from its config."""

    layers: int
    hidden: int
    query_width: int  # query heads x head dim
    kv_width: int  # KV heads x head dim (MLA: the mean of its expanded keys' and values' widths)
    ffn_width: int  # FFN width one token passes through: dense, or its top-k experts (+ shared)
    vocab: int
    dtype_bytes: int  # the model's compute dtype
    latent_width: int = 0  # MLA: q_lora_rank + kv_lora_rank + qk_rope_head_dim; 0 elsewhere
    # Numbers one position holds in one layer's KV cache; None: keys and values, 2 x kv_width.
    cache_width: int | None = None
    # Heads whose [T, T] scores a pass materialises (sdpa unfused: MLA on a CPU); 0 elsewhere.
    score_heads: int = 0
    # A vision-language model: bytes its vision tower's activations take per image placeholder
    # token (model/vision/images.py VisionInputs.token_activation_bytes); 0 for a text model.
    vision_token_bytes: int = 0
    # Of `layers`, the linear-attention ones (hybrids), whose mixer keeps linear_token_bytes
    # per token in place of attention's activations; and a row's recurrent state in bytes.
    linear_layers: int = 0
    linear_token_bytes: int = 0
    recurrent_row_bytes: int = 0

    @property
    def cache_elements(self) -> int:
        """Numbers one position holds in one layer's KV cache."""
        return 2 * self.kv_width if self.cache_width is None else self.cache_width


@dataclass(frozen=True)
class _AttentionWidths:
    """Per token, what attention's activations are wide (ModelShape's fields of those names),
    and whether its keys and values differ in width."""

    query: int
    kv: int
    latent: int
    unequal_kv: bool


def _attention_widths(config: PretrainedConfig, kv: KVShape) -> _AttentionWidths:
    """Attention's activation widths: from the cache shape `kv` (the modules' own heads, which a
    config's fields may misstate), or for MLA (a config with kv_lora_rank, whose cache holds
    the latent, not heads) from its config's latent and per-head widths."""
    kv_lora_rank = getattr(config, "kv_lora_rank", None)
    if kv_lora_rank is None:
        return _AttentionWidths(
            query=config.num_attention_heads * kv.head_dim,
            kv=kv.num_kv_heads * kv.head_dim,
            latent=0,
            unequal_kv=False,
        )
    heads, rope = config.num_attention_heads, config.qk_rope_head_dim
    key_dim, value_dim = config.qk_nope_head_dim + rope, config.v_head_dim
    return _AttentionWidths(
        query=heads * key_dim,
        kv=math.ceil(heads * (key_dim + value_dim) / 2),
        latent=(getattr(config, "q_lora_rank", None) or 0) + kv_lora_rank + rope,
        unequal_kv=key_dim != value_dim,
    )


def model_shape(
    config: PretrainedConfig,
    kv: KVShape,
    dtype_bytes: int,
    *,
    device: torch.device | None = None,
) -> ModelShape:
    """ModelShape of a Hugging Face decoder (dense or MoE families) whose attention writes `kv`
    (model/kv_shape.py), its passes on `device` (a CPU: sdpa's kernel there takes only keys
    and values of one width; None or another device: a fused kernel takes MLA's too, as CUDA's
    memory-efficient one does)."""
    config = config.get_text_config()  # a vision-language model's language model
    top_k = getattr(config, "num_experts_per_tok", None)
    ffn = config.intermediate_size
    if top_k:
        # MoE: each token runs through top_k experts (moe_intermediate_size where the family
        # has one) and a shared expert where it has one; the dispatch copies hidden states
        # once per expert slot, counted here as FFN width too.
        expert = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        shared = getattr(config, "shared_expert_intermediate_size", None) or 0
        # DeepSeek's shared experts: n_shared_experts of the routed experts' width, as one MLP.
        shared = shared or (getattr(config, "n_shared_experts", None) or 0) * expert
        ffn = top_k * (expert + config.hidden_size) + shared
    attention = _attention_widths(config, kv)
    unfused = attention.unequal_kv and device is not None and device.type == "cpu"
    recurrent = kv.recurrent
    linear_token_bytes = 0
    if recurrent is not None:
        heads = recurrent.value_heads
        linear_token_bytes = FLOAT32 * (
            LINEAR_CHUNK_COPIES * heads * LINEAR_CHUNK
            + LINEAR_VECTOR_COPIES * heads * (recurrent.key_dim + recurrent.value_dim)
            + LINEAR_CONV_COPIES * recurrent.conv_channels
        )
    return ModelShape(
        layers=kv.num_layers + (0 if recurrent is None else len(recurrent.layers)),
        hidden=config.hidden_size,
        query_width=attention.query,
        kv_width=attention.kv,
        ffn_width=ffn,
        vocab=config.vocab_size,
        dtype_bytes=dtype_bytes,
        latent_width=attention.latent,
        cache_width=2 * kv.num_kv_heads * kv.head_dim,
        score_heads=config.num_attention_heads if unfused else 0,
        linear_layers=0 if recurrent is None else len(recurrent.layers),
        linear_token_bytes=linear_token_bytes,
        recurrent_row_bytes=0 if recurrent is None else recurrent.bytes_per_row(dtype_bytes),
    )


def _layer_elements(shape: ModelShape, longest: int = 0) -> int:
    """Saved activation elements per token and decoder layer (module docstring), in a batch
    whose longest row is `longest` positions."""
    return (
        HIDDEN_COPIES * shape.hidden
        + QUERY_COPIES * shape.query_width
        + KV_COPIES * shape.kv_width
        + FFN_COPIES * shape.ffn_width
        + LATENT_COPIES * shape.latent_width
        + SCORE_COPIES * shape.score_heads * longest
    )


def _layer_bytes(shape: ModelShape, longest: int = 0) -> tuple[int, int]:
    """Saved activation bytes per token of (all decoder layers, the largest one): a linear-
    attention layer's mixer in place of attention's query, KV and score activations."""
    full = _layer_elements(shape, longest) * shape.dtype_bytes
    attention = (
        QUERY_COPIES * shape.query_width
        + KV_COPIES * shape.kv_width
        + SCORE_COPIES * shape.score_heads * longest
    ) * shape.dtype_bytes
    linear = full - attention + shape.linear_token_bytes
    every = (shape.layers - shape.linear_layers) * full + shape.linear_layers * linear
    return every, max(full, linear) if shape.linear_layers else full


def saved_activation_bytes(
    shape: ModelShape, tokens: int, *, checkpointed: bool = False, longest: int = 0
) -> int:
    """What autograd keeps for backward over `tokens` positions, rows of at most `longest`:
    every layer's saved tensors (`checkpointed`: every layer's input, and one layer's saved
    tensors while its backward recomputes them, with their gradients: RECOMPUTED_LAYERS), and
    the hidden-sized unit the frozen head keeps per token (train/logprobs.py)."""
    every, largest = _layer_bytes(shape, longest)
    if checkpointed:
        layers = shape.layers * shape.hidden * shape.dtype_bytes + RECOMPUTED_LAYERS * largest
    else:
        layers = every
    return tokens * (layers + shape.hidden * FLOAT32)


def _padded_tokens(samples: tuple[TrainingSample, ...]) -> tuple[int, int]:
    """(rows, padded tokens) of a batch packed to its longest sample (batching.pack)."""
    longest = max(len(sample.tokens) for sample in samples)
    return len(samples), len(samples) * longest


def _logits_bytes(shape: ModelShape, rows: int, tokens: int, chunk_tokens: int) -> int:
    """One chunk of the head's float32 log-softmax and its backward (train/logprobs.py)."""
    chunk = min(tokens, max(rows, chunk_tokens))
    return chunk * shape.vocab * FLOAT32 * LOGIT_COPIES


def training_pass_bytes(
    shape: ModelShape,
    samples: tuple[TrainingSample, ...],
    *,
    chunk_tokens: int,
    is_forward_only: bool,
    checkpointed: bool,
) -> int:
    """Peak bytes of one forward (and backward, its decoder layers `checkpointed` or not) over
    `samples` packed into one batch."""
    rows, tokens = _padded_tokens(samples)
    longest = tokens // rows
    _, per_token = _layer_bytes(shape, longest)
    if is_forward_only:
        # No graph: one layer's tensors at a time, beside the hidden states in and out. The
        # per-layer count already holds more than a no-grad layer keeps at once (its FFN
        # intermediates are freed as it goes), and no backward runs: no safety factor.
        activations = tokens * (per_token + 2 * shape.hidden * shape.dtype_bytes)
    else:
        saved = saved_activation_bytes(shape, tokens, checkpointed=checkpointed, longest=longest)
        activations = math.ceil(ACTIVATION_SAFETY * saved)
    image_tokens = sum(image.num_tokens for sample in samples for image in sample.images)
    return (
        activations
        + _logits_bytes(shape, rows, tokens, chunk_tokens)
        + tokens * PACKED_BYTES_PER_TOKEN
        + image_tokens * shape.vision_token_bytes
    )


def forward_backward_bytes(
    shape: ModelShape,
    requests: list[ForwardBackwardRequest],
    *,
    chunk_tokens: int,
    trainable_bytes: list[int],
    checkpointed: bool,
) -> int:
    """Peak bytes of one shared forward-backward pass over several sessions' requests, its
    decoder layers `checkpointed` or not.

    `trainable_bytes[i]`: the trainable tensors of request i's session; its new gradients
    appear beside the accumulated ones and then their sum (train/accumulate.py)."""
    samples = tuple(s for request in requests for s in request.samples)
    is_forward_only = all(request.forward_only for request in requests)
    gradients = sum(
        2 * size
        for request, size in zip(requests, trainable_bytes, strict=True)
        if not request.forward_only
    )
    return (
        training_pass_bytes(
            shape,
            samples,
            chunk_tokens=chunk_tokens,
            is_forward_only=is_forward_only,
            checkpointed=checkpointed,
        )
        + gradients
    )


def custom_forward_backward_bytes(
    shape: ModelShape,
    request: CustomForwardBackwardRequest,
    *,
    chunk_tokens: int,
    trainable_bytes: int,
    checkpointed: bool,
) -> int:
    """A forward-backward pass plus the [S, T] float32 tensor of the given gradients."""
    _, tokens = _padded_tokens(request.samples)
    pass_bytes = training_pass_bytes(
        shape,
        request.samples,
        chunk_tokens=chunk_tokens,
        is_forward_only=False,
        checkpointed=checkpointed,
    )
    return pass_bytes + tokens * FLOAT32 + 2 * trainable_bytes


def sample_bytes(shape: ModelShape, requests: list[SampleRequest], *, chunk_tokens: int) -> int:
    """Peak bytes of one generation over several sample operations (sampler.generate)."""
    kv_layers = shape.layers - shape.linear_layers
    kv_per_position = kv_layers * shape.cache_elements * shape.dtype_bytes
    prompt_positions = sum(len(p) for request in requests for p in request.prompts)
    rows = sum(len(request.prompts) * request.num_samples for request in requests)
    own_positions = sum(
        len(request.prompts)
        * request.num_samples
        * peak_own_positions(max_tokens_of(request.sampling_params))
        for request in requests
    )
    generated = sum(
        len(request.prompts) * request.num_samples * max_tokens_of(request.sampling_params)
        for request in requests
    )
    # The prompts' KV twice: the decode cache's copy and the prefix cache's. A hybrid's
    # recurrent state: one per prompt (its prefill row) and per sequence, that twice while
    # the rows grow (the old and the new state side by side).
    prompts = sum(len(request.prompts) for request in requests)
    cache = (2 * prompt_positions + own_positions) * kv_per_position
    cache += (prompts + 2 * rows) * shape.recurrent_row_bytes
    # A prefill pass (at most PREFILL_TOKENS_PER_PASS positions, no graph) or a decode pass
    # over every row: one layer's tensors at a time, and the logits of the rows.
    # Unfused attention's scores (MLA on a CPU) over a prefill's prompt columns.
    pass_tokens = max(min(prompt_positions, PREFILL_TOKENS_PER_PASS), rows)
    longest = max((len(p) for request in requests for p in request.prompts), default=0)
    _, layer = _layer_bytes(shape, longest)
    pass_bytes = pass_tokens * (layer + 2 * shape.hidden * shape.dtype_bytes)
    # Prompts prefilled side by side attend through boolean [Q, K] masks over the cached
    # columns (one per layer type) and sdpa's copy of one in the model's dtype; a lone prompt
    # attends as a CausalChunk (model/attention.py) and builds none.
    if len(requests) > 1 or any(len(request.prompts) > 1 for request in requests):
        pass_bytes += (
            min(prompt_positions, PREFILL_TOKENS_PER_PASS)
            * longest
            * (MASK_COPIES + shape.dtype_bytes)
        )
    prompt_logits = min(prompt_positions, chunk_tokens) * shape.vocab * FLOAT32 * LOGIT_COPIES
    row_logits = rows * shape.vocab * FLOAT32 * SAMPLE_LOGIT_COPIES
    image_tokens = sum(
        image.num_tokens
        for request in requests
        for images in request.prompt_images
        for image in images
    )
    return (
        cache
        + math.ceil(ACTIVATION_SAFETY * pass_bytes)
        + max(prompt_logits, row_logits)
        + generated * PYTHON_BYTES_PER_GENERATED_TOKEN
        + image_tokens * shape.vision_token_bytes
    )


def optim_step_bytes(trainable_bytes: int, largest_bytes: int, *, has_moments: bool) -> int:
    """AdamW's two moments per trainable tensor at the first step, and the single-tensor
    update's temporaries of the largest tensor (optim/optimizer.py runs torch's foreach=False path).

    The copy-backed step (optim/optimizer.py, only for settings that could overflow the weights)
    clones weights, gradients and moments on top; should that not fit, the allocator's failure fails
    the step RESOURCE_EXHAUSTED and optim/optimizer.py puts everything back."""
    moments = 0 if has_moments else 2 * trainable_bytes
    return moments + 3 * largest_bytes
