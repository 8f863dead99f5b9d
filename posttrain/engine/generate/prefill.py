"""The generator's passes through the model: prefill (from the prefix cache where it can, with
prompt logprobs when asked), appending positions to cache rows, and the output head.

sampler.py runs the decode loop over these; the sampling math is in sampling_math.py. Each
pass routes its rows to their adapters (model/lora.py) and reads and writes a KVCache or a
FanoutKVCache (model/fanout_kv_cache.py).

Legend: G = prefill groups (distinct prompts), B = rows in a pass, Q = new positions per row
in a pass, V = vocab, H = hidden size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor
from transformers import PretrainedConfig, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from posttrain.engine.generate.prefix_cache import PrefixCache
from posttrain.engine.images import ImagePass, cacheable_length, prefix_key
from posttrain.engine.train.logprobs import log_softmax_float32
from posttrain.model import attention, routing
from posttrain.model.fanout_kv_cache import FanoutKVCache
from posttrain.model.joining_pass_cache import JoiningPassCache
from posttrain.model.kv_cache import KVCache
from posttrain.model.kv_shape import KVShape
from posttrain.model.logit_head import output_head
from posttrain.model.lora import LoraModel
from posttrain.model.static_decode_cache import StaticDecodeCache
from posttrain.model.vision import VisionInputs
from posttrain.types import ImageInput, MoeShape, TopkPromptLogprobs

# Query positions of one prefill pass, summed over its rows: bounds activation memory for many
# or long prompts while keeping passes large enough to be efficient.
PREFILL_TOKENS_PER_PASS = 8192


@dataclass
class GeneratorModel:
    """What the sampler needs of one loaded model."""

    model: PreTrainedModel
    lora: LoraModel
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    prefix_cache: PrefixCache
    logprob_chunk_tokens: int
    kv: KVShape  # the KV shape its attention writes (LoadedModel.kv)
    moe: MoeShape | None = None  # the model's expert-route shape; None: dense
    cuda_graphs: bool = False  # EngineConfig.cuda_graphs: static passes in CUDA graphs on CUDA
    vision: VisionInputs | None = None  # a vision-language model's image processor

    @property
    def embedding(self) -> Tensor:
        """The input embedding's weight: its dtype and device are the model's."""
        weight = self.model.get_input_embeddings().weight
        assert isinstance(weight, Tensor), "an embedding's weight is a tensor"
        return weight


@dataclass
class PromptGroup:
    """One prefill: a distinct (adapter, prompt) of the batch."""

    adapter_key: str
    prompt: tuple[int, ...]
    generation: int
    topk: int = 0
    wants_prompt_logprobs: bool = False
    cache_hit_tokens: int = 0
    prompt_logprobs: list[float] = field(default_factory=list)
    topk_prompt_logprobs: list[TopkPromptLogprobs] = field(default_factory=list)
    # return_routed_experts: the experts of each prompt position, [Q, L, K] pieces in order.
    wants_routes: bool = False
    routes: list[Tensor] = field(default_factory=list)
    # The prompt's images (placeholders in `prompt`): prefilled whole, in one pass, with the
    # vision embeddings (engine/images.py); the prefix cache keys them by their bytes.
    images: tuple[ImageInput, ...] = ()
    prefix_cache_refused: str | None = None  # SampleResult's: why the prefix cache was skipped


def routing_of(keys_B: Sequence[str], device: torch.device) -> list[tuple[str, Tensor | None]]:
    """LoraModel.route assignments: rows grouped by adapter (None: every row)."""
    distinct = list(dict.fromkeys(keys_B))
    if len(distinct) == 1:
        return [(distinct[0], None)]
    return [
        (key, torch.tensor([i for i, k in enumerate(keys_B) if k == key], device=device))
        for key in distinct
    ]


def new_cache(gm: GeneratorModel, num_rows: int, capacity: int, pool_rows: int = 0) -> KVCache:
    embedding = gm.embedding
    return KVCache.for_model(
        gm.kv,
        num_rows=num_rows,
        capacity=capacity,
        dtype=embedding.dtype,
        device=embedding.device,
        pool_rows=pool_rows,
    )


def layer_types(config: PretrainedConfig) -> list[str]:
    """The attention kind of each decoder layer: the config's `layer_types` where the family
    has them (Qwen2/3, Gemma 2/3), else sliding everywhere when it has a window (Mistral,
    Phi-3), full otherwise (Llama, GPT-NeoX, ...)."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds)
    sliding = getattr(config, "sliding_window", None)
    return ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers


def forward_rows(
    gm: GeneratorModel,
    cache: KVCache | FanoutKVCache | StaticDecodeCache | JoiningPassCache,
    tokens_BQ: Tensor,
    num_new_B: Tensor | None,
    keys_B: list[str],
    routes_out: list[Tensor] | None = None,
    uniform: tuple[int, int] | None = None,
    adapter_routing: list[tuple[str, Tensor | None]] | None = None,
    ragged: bool = False,
    images: ImagePass | None = None,
) -> Tensor:
    """Append the real positions of tokens_BQ to the cache rows; hidden states [B, Q, H].
    `num_new_B`: the real positions of each row (None with a StaticDecodeCache, whose pass
    appends one to every row). With `routes_out`, also append the experts every position
    used, [B, Q, L, K].
    `uniform`: what the caller knows of the rows' lengths (KVCache.begin). `adapter_routing`: the
    rows' adapter routing made once (routing_of(keys_B)), for passes a CUDA graph captures
    (no index tensor may be made from the host inside one). `ragged`: a FanoutKVCache's rows
    hold different own lengths, `uniform`'s longest the longest (FanoutKVCache.begin).
    `images`: the rows' images, into the model's own forward (engine/images.py)."""
    config = gm.model.config.get_text_config()  # a vision-language model: its language model
    if isinstance(cache, StaticDecodeCache):
        positions_BQ = cache.begin()
    elif ragged:
        assert isinstance(cache, FanoutKVCache) and uniform is not None and num_new_B is not None
        positions_BQ = cache.begin(num_new_B, uniform, ragged=True)
    else:
        assert num_new_B is not None, "a pass appends num_new_B[b] positions to row b"
        positions_BQ = cache.begin(num_new_B, uniform)
    # The attention layers' kinds, in the order their modules' layer_idx number them (a
    # hybrid's linear layers have none: attention_kinds/linear_attention.install).
    kinds = [kind for kind in layer_types(config) if kind != "linear_attention"]
    layouts: list[attention.Layout]
    if gm.kv.recurrent is None and _is_causal_chunk(gm, cache, kinds):
        layouts = [attention.CausalChunk()] * len(kinds)
    else:
        masks = cache.attention_masks(positions_BQ, kinds, getattr(config, "sliding_window", None))
        layouts = [masks[kind] for kind in kinds]
    # The model gets a placeholder 4-D mask, which every family's mask creation passes on
    # as-is; the attention function reads the real one of its layer from the pass layout.
    rows, width = positions_BQ.shape
    placeholder = torch.ones((), dtype=torch.bool, device=positions_BQ.device).expand(
        rows, 1, width, cache.placeholder_columns(positions_BQ)
    )
    with (
        gm.lora.route(adapter_routing or routing_of(keys_B, tokens_BQ.device)),
        attention.pass_layout(layouts),
        routing.capture() if routes_out is not None else nullcontext() as captured,
    ):
        inputs = {"position_ids": positions_BQ}
        if images is not None:
            assert num_new_B is not None, "an image pass is a prefill"
            inputs = images.inputs(tokens_BQ, positions_BQ, num_new_B)
        hidden_BQH: Tensor = gm.model.base_model(
            input_ids=tokens_BQ,
            attention_mask=placeholder,
            cache=cache,
            use_cache=True,
            **inputs,
        ).last_hidden_state
    cache.commit()
    if routes_out is not None:
        assert captured is not None, "routing.capture yields the routes list"
        # One [B * Q, K] entry per MoE layer, tokens flattened row-major as the blocks see them.
        routes_out.append(torch.stack(captured, dim=1).view(rows, width, len(captured), -1))
    return hidden_BQH


def _is_causal_chunk(
    gm: GeneratorModel,
    cache: KVCache | FanoutKVCache | StaticDecodeCache | JoiningPassCache,
    kinds: list[str],
) -> bool:
    """Whether this pass attends as a CausalChunk: a plain KVCache pass (a prefill) whose rows
    share their start and width, every layer full attention, the model on posttrain's sdpa
    attention. A long prompt's prefill chunk then builds no [Q, K] mask (model/attention.py)."""
    return (
        type(cache) is KVCache
        and cache.same_start
        and all(kind == "full_attention" for kind in kinds)
        and gm.model.config._attn_implementation == attention.IMPLEMENTATION
    )


def head_logits(
    gm: GeneratorModel,
    hidden_BH: Tensor,
    keys_B: list[str],
    adapter_routing: list[tuple[str, Tensor | None]] | None = None,
    ragged: bool = False,
) -> Tensor:
    with gm.lora.route(adapter_routing or routing_of(keys_B, hidden_BH.device)):
        logits_BV: Tensor = output_head(gm.model)(hidden_BH)
    return logits_BV


def extend_rows(
    gm: GeneratorModel,
    cache: KVCache | FanoutKVCache,
    tokens_B: Sequence[Sequence[int]],
    keys_B: list[str],
    routes_out: list[Tensor] | None = None,
) -> Iterator[tuple[Tensor, list[int], list[int]]]:
    """Append tokens_B[b] to row b in passes of at most PREFILL_TOKENS_PER_PASS positions
    (a hybrid's: each pass as many positions for every row that runs).

    Yields (hidden [B, Q, H], start offset into tokens_B[b], count) per pass, so callers can
    read the hidden states of the positions they need; with `routes_out`, each pass's routes
    are its last entry when the pass is yielded (forward_rows)."""
    device = gm.embedding.device
    done = [0] * len(tokens_B)
    width_limit = max(1, PREFILL_TOKENS_PER_PASS // max(1, len(tokens_B)))
    while any(d < len(t) for d, t in zip(done, tokens_B, strict=True)):
        counts = [min(len(t) - d, width_limit) for d, t in zip(done, tokens_B, strict=True)]
        if gm.kv.recurrent is not None:
            # Linear attention: every row that runs runs as many positions (the shortest's),
            # so a row's recurrent state is the pass's final one (linear_attention.py
            # steps token by token from the shortest row's end otherwise).
            step = min(c for c in counts if c > 0)
            counts = [min(c, step) for c in counts]
        width = max(counts)
        batch_BQ = torch.zeros(len(tokens_B), width, dtype=torch.int64)
        for b, (tokens, start, count) in enumerate(zip(tokens_B, done, counts, strict=True)):
            batch_BQ[b, :count] = torch.tensor(tokens[start : start + count], dtype=torch.int64)
        num_new_B = torch.tensor(counts, dtype=torch.int64, device=device)
        hidden_BQH = forward_rows(gm, cache, batch_BQ.to(device), num_new_B, keys_B, routes_out)
        yield hidden_BQH, list(done), counts
        done = [d + c for d, c in zip(done, counts, strict=True)]


def prefill(
    gm: GeneratorModel,
    groups: list[PromptGroup],
    *,
    with_logits: bool,
    cache: KVCache | None = None,
) -> tuple[KVCache, Tensor | None]:
    """KV of every group's prompt in row g of a new cache, from the prefix cache where possible;
    the first-token logits [G, V] (float32) when asked; prompt logprobs into groups that want
    them. The computed KV goes back into the prefix cache. `cache`: the groups' prompt_cache,
    when the caller has already looked them up."""
    cache = cache or prompt_cache(gm, groups)
    keys = [g.adapter_key for g in groups]
    suffixes = [g.prompt[g.cache_hit_tokens :] for g in groups]
    last_hidden: list[Tensor | None] = [None] * len(groups)
    routes_out: list[Tensor] | None = [] if any(g.wants_routes for g in groups) else None
    passes = (
        [_image_pass(gm, cache, groups, suffixes, keys, routes_out)]
        if any(g.images for g in groups)
        else extend_rows(gm, cache, suffixes, keys, routes_out)
    )
    for hidden_BQH, starts, counts in passes:
        for row, group in enumerate(groups):
            if counts[row] == 0:
                continue
            if group.wants_routes:
                assert routes_out is not None
                group.routes.append(routes_out[-1][row, : counts[row]])
            first = group.cache_hit_tokens + starts[row]  # prompt position of hidden[row, 0]
            if first + counts[row] == len(group.prompt):
                last_hidden[row] = hidden_BQH[row, counts[row] - 1]
            if group.wants_prompt_logprobs:
                _harvest_prompt_logprobs(gm, group, hidden_BQH[row, : counts[row]], first)
    keep_prompts(gm, groups, cache)
    if not with_logits:
        return cache, None
    hidden_GH = torch.stack([h for h in last_hidden if h is not None])
    assert hidden_GH.shape[0] == len(groups), "every prompt has a last position"
    # float32 whatever the model's dtype: sampling and reported logprobs are float32 math.
    return cache, head_logits(gm, hidden_GH, keys).float()


def _image_pass(
    gm: GeneratorModel,
    cache: KVCache,
    groups: list[PromptGroup],
    suffixes: list[tuple[int, ...]],
    keys: list[str],
    routes_out: list[Tensor] | None,
) -> tuple[Tensor, list[int], list[int]]:
    """Every suffix in one pass (an image's embeddings come whole from the vision tower, so
    its placeholders are not split between passes), as extend_rows yields a pass; an image
    prompt's suffix starts after a prefix-cache hit, which ends before an image."""
    assert gm.vision is not None, "image prompts are checked against the model at submit"
    counts = [len(suffix) for suffix in suffixes]
    batch_BQ = torch.zeros(len(suffixes), max(counts), dtype=torch.int64)
    for b, suffix in enumerate(suffixes):
        batch_BQ[b, : counts[b]] = torch.tensor(suffix, dtype=torch.int64)
    device = gm.embedding.device
    images = ImagePass(
        gm.model,
        gm.vision,
        [group.prompt for group in groups],
        [group.images for group in groups],
        [group.cache_hit_tokens for group in groups],
    )
    num_new_B = torch.tensor(counts, dtype=torch.int64, device=device)
    hidden_BQH = forward_rows(
        gm, cache, batch_BQ.to(device), num_new_B, keys, routes_out, images=images
    )
    return hidden_BQH, [0] * len(groups), counts


# Why a hybrid's prompts skip the prefix cache (SampleResult.prefix_cache_refused, /metrics).
PREFIX_CACHE_REFUSED_RECURRENT = "linear_attention_state"


def prefix_cache_serves(gm: GeneratorModel) -> bool:
    """Whether prompts go through the prefix cache: enabled, and the model keeps no recurrent
    state (linear-attention layers, attention_kinds/linear_attention.py), which a span of positions
    cannot carry; such a model recomputes every prompt."""
    return gm.prefix_cache.enabled and gm.kv.recurrent is None


def prompt_cache(gm: GeneratorModel, groups: list[PromptGroup]) -> KVCache:
    """A cache of one row per group holding the longest prefix of its prompt the prefix cache
    has (group.cache_hit_tokens); the rest is what a prefill pass runs."""
    cache = new_cache(gm, len(groups), max(len(g.prompt) for g in groups))
    for row, group in enumerate(groups):
        group.cache_hit_tokens = 0
        if gm.prefix_cache.enabled and gm.kv.recurrent is not None:
            group.prefix_cache_refused = PREFIX_CACHE_REFUSED_RECURRENT
        if group.wants_prompt_logprobs or group.wants_routes or not prefix_cache_serves(gm):
            continue  # prompt logprobs and routes need every position to run
        namespace = (group.adapter_key, group.generation)
        # At most len - 1: the last prompt token must run to give the first logits.
        spans = gm.prefix_cache.lookup(
            namespace,
            cache_key(gm, group),
            max_tokens=cacheable_length(len(group.prompt), group.images),
        )
        for span in spans:
            cache.write_span(row, group.cache_hit_tokens, span)
            group.cache_hit_tokens += span.shape[3]
    return cache


def keep_prompts(gm: GeneratorModel, groups: list[PromptGroup], cache: KVCache) -> None:
    """The prompts' KV (row g of `cache` is groups[g]'s, all computed) into the prefix cache."""
    if not prefix_cache_serves(gm):
        return
    for row, group in enumerate(groups):
        gm.prefix_cache.insert(
            (group.adapter_key, group.generation),
            cache_key(gm, group),
            partial(cache.span, row),
        )


def cache_key(gm: GeneratorModel, group: PromptGroup) -> tuple[int, ...]:
    """What the prefix cache keys the group's prompt by: its tokens, or for an image prompt
    the tokens with its images' bytes and position shift in them (engine/images.py)."""
    if not group.images:
        return group.prompt
    assert gm.vision is not None, "image prompts are checked against the model at submit"
    return prefix_key(gm.model, gm.vision, group.prompt, group.images)


def _harvest_prompt_logprobs(
    gm: GeneratorModel, group: PromptGroup, hidden_QH: Tensor, first: int
) -> None:
    """Logprobs of prompt tokens first+1 .. first+Q (capped at the prompt's end) from the
    hidden states of positions first .. first+Q-1, and their top-k alternatives."""
    positions = min(hidden_QH.shape[0], len(group.prompt) - 1 - first)
    if positions <= 0:
        return
    targets = torch.tensor(group.prompt[first + 1 : first + 1 + positions], device=hidden_QH.device)
    chunk = max(1, gm.logprob_chunk_tokens)
    for start in range(0, positions, chunk):
        end = min(positions, start + chunk)
        logprobs_QV = log_softmax_float32(
            head_logits(gm, hidden_QH[start:end], [group.adapter_key])
        )
        group.prompt_logprobs.extend(
            logprobs_QV.gather(-1, targets[start:end, None]).squeeze(-1).tolist()
        )
        if group.topk:
            k = min(group.topk, logprobs_QV.shape[-1])
            values_QK, ids_QK = torch.topk(logprobs_QV, k, dim=-1)  # sorted, descending
            for ids, values in zip(ids_QK.tolist(), values_QK.tolist(), strict=True):
                group.topk_prompt_logprobs.append(TopkPromptLogprobs(ids, values))
