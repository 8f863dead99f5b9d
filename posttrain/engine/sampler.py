"""Batched generation: many prompts, samples, sessions and sampling settings in one decode loop.

One `generate` call takes a list of GenerationRequests (one prompt of one sample operation
each; every request names its own adapter and sampling params, so requests of different
operations and sessions can share passes) and runs:

1. Prefill, once per distinct (adapter, prompt): the longest cached prefix comes from the prefix
   cache (prefix_cache.py), only the rest runs through the model, in passes of bounded size.
   Its last position gives the first token's logits; prompt logprobs, when asked for, come from
   the same pass.
2. Fan-out: one row per sampled sequence in a SharedPrefixCache (model/shared_prefix_cache.py):
   the prefill's KV stays one copy per prompt, read by all of its num_samples rows (shared-prefix
   attention, model/attention.py), and each row stores only the tokens it generates.
3. Decode, one token per live row per pass. A row stops on its own (EOS, a stop string even
   when it spans tokens, its max_tokens); finished rows leave the batch and the cache is
   compacted (prompts no live row continues too), so long rows never pay for finished ones.
4. In-flight weight updates (WEIGHT_SYNC_TYPE_PIPELINE): between passes `between_tokens` may
   publish new generator weights. Rows whose adapter changed get their KV recomputed with the new
   weights (their prompt's once, then each row's tokens so far), and their result gains a policy
   segment starting at the next generated token, so every token after the switch is exactly what
   the new weights give.

Sampling. Temperature 0 is argmax. Otherwise temperature, then top-k, then top-p (the smallest
set of most likely tokens whose mass reaches top_p), then one draw by inverse CDF: a uniform
from the row's own torch.Generator against the running sum of its probabilities. Sample j of a
prompt seeds its generator from (seed, j), so the same seed, prompt and weights give the same
tokens whatever else is in the batch and however many samples were asked for (two identical
prompts in one request with one seed therefore get identical samples). Unseeded rows draw
their seed from the OS. Draws happen on the CPU generator so a seed means the same on every
device.

Logprobs. A sampled token's logprob is the untempered float32 log-softmax (logprobs.py) of the
logits it was drawn from, the model's own distribution: what forward-backward computes for the
same token. Prompt logprobs use the same function.

Legend: G = prefill groups (distinct prompts), R = rows (sequences), B = rows in a pass,
Q = new positions per row in a pass, V = vocab, H = hidden size.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from posttrain.engine.logprobs import log_softmax_float32
from posttrain.engine.prefix_cache import PrefixCache
from posttrain.model import attention
from posttrain.model.kv_cache import KVCache
from posttrain.model.lora import LoraModel
from posttrain.model.shared_prefix_cache import SharedPrefixCache
from posttrain.types import (
    PolicySegment,
    SampledSequence,
    SampleResult,
    SamplingParams,
    StopReason,
    TopkPromptLogprobs,
)

# Query positions of one prefill pass, summed over its rows: bounds activation memory for many
# or long prompts while keeping passes large enough to be efficient.
PREFILL_TOKENS_PER_PASS = 8192
# Decode positions allocated at a time: memory follows the longest live row instead of being
# reserved for every row's max_tokens up front.
DECODE_POSITIONS_PER_GROWTH = 256
# Tokens per block of the two-level inverse-CDF search (draw_inverse_cdf).
CDF_BLOCK = 256
_SEED_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt of one sample operation: num_samples sequences sharing one prefill."""

    prompt: tuple[int, ...]
    num_samples: int
    params: SamplingParams
    adapter_key: str
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0


@dataclass(frozen=True)
class WeightsVersion:
    """What an adapter serves: `generation` changes on every publish (it keys the prefix
    cache); `version` is the policy version of those weights (api.md 2.4)."""

    generation: int
    version: int


@dataclass
class GeneratorModel:
    """What the sampler needs of one loaded model."""

    model: PreTrainedModel
    lora: LoraModel
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    prefix_cache: PrefixCache
    logprob_chunk_tokens: int


@dataclass
class _Group:
    """One prefill: a distinct (adapter, prompt) of the batch."""

    adapter_key: str
    prompt: tuple[int, ...]
    generation: int
    topk: int = 0
    wants_prompt_logprobs: bool = False
    cache_hit_tokens: int = 0
    prompt_logprobs: list[float] = field(default_factory=list)
    topk_prompt_logprobs: list[TopkPromptLogprobs] = field(default_factory=list)


@dataclass
class _Row:
    """One sampled sequence."""

    request: int
    group: int
    params: SamplingParams
    generator: torch.Generator | None  # None: greedy, draws nothing
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: StopReason | None = None


# ---------------------------------------------------------------- sampling math


def row_seed(seed: int | None, sample_index: int) -> int:
    """The generator seed of sample `sample_index` of a prompt; unseeded rows use the OS."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little") & _SEED_MASK
    # An odd multiplier spreads neighbouring seeds apart, so seed s sample 1 is not seed s+1
    # sample 0.
    return (seed * 0x9E3779B97F4A7C15 + sample_index) & _SEED_MASK


def filter_logits(logits_BV: Tensor, top_k_B: Tensor, top_p_B: Tensor) -> Tensor:
    """Top-k (top_k <= 0: off), then top-p, on tempered float32 logits; dropped tokens get
    -inf. Rows are independent: a row's result does not depend on the others."""
    vocab = logits_BV.shape[-1]
    needs_B = ((top_k_B > 0) & (top_k_B < vocab)) | (top_p_B < 1.0)
    if not bool(needs_B.any()):
        return logits_BV
    rows = needs_B.nonzero().squeeze(1)
    sorted_BV, order_BV = torch.sort(logits_BV[rows], dim=-1, descending=True)
    rank_V = torch.arange(vocab, device=logits_BV.device)
    k_B = torch.where(top_k_B[rows] > 0, top_k_B[rows], vocab)
    sorted_BV = sorted_BV.masked_fill(rank_V[None, :] >= k_B[:, None], float("-inf"))
    probs_BV = torch.softmax(sorted_BV, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the most likely token always stays).
    drop_BV = probs_BV.cumsum(-1) - probs_BV >= top_p_B[rows, None]
    sorted_BV = sorted_BV.masked_fill(drop_BV, float("-inf"))
    filtered_BV = logits_BV.clone()
    filtered_BV[rows] = torch.full_like(sorted_BV, float("-inf")).scatter(1, order_BV, sorted_BV)
    return filtered_BV


def choose_tokens(
    logprobs_BV: Tensor,
    temperature_B: Tensor,
    top_k_B: Tensor,
    top_p_B: Tensor,
    uniform_B: Tensor,
) -> Tensor:
    """One token per row from its float32 log-softmax: argmax where temperature is 0, else an
    inverse-CDF draw with the row's uniform in [0, 1) from the tempered, filtered distribution.

    log-softmax differs from the logits by a per-row constant, so tempering and filtering it
    gives the same distribution. Each row's arithmetic depends only on its own settings, never
    on which other rows share the batch."""
    vocab = logprobs_BV.shape[-1]
    tokens_B = torch.zeros(logprobs_BV.shape[0], dtype=torch.int64, device=logprobs_BV.device)
    greedy = temperature_B == 0
    plain = (temperature_B == 1) & ((top_k_B <= 0) | (top_k_B >= vocab)) & (top_p_B >= 1)
    if bool(greedy.any()):
        tokens_B[greedy] = logprobs_BV[greedy].argmax(-1)
    shaped = ~greedy & ~plain
    if bool(plain.all()):
        # The common RL case: no boolean-mask copies of the [B, V] logprobs.
        return draw_inverse_cdf(logprobs_BV.exp(), uniform_B)
    if bool(plain.any()):
        # The model's own distribution: exp of the log-softmax already at hand.
        tokens_B[plain] = draw_inverse_cdf(logprobs_BV[plain].exp(), uniform_B[plain])
    if bool(shaped.any()):
        tempered_BV = logprobs_BV[shaped] / temperature_B[shaped, None]
        filtered_BV = filter_logits(tempered_BV, top_k_B[shaped], top_p_B[shaped])
        tokens_B[shaped] = draw_inverse_cdf(torch.softmax(filtered_BV, dim=-1), uniform_B[shaped])
    return tokens_B


def draw_inverse_cdf(probs_BV: Tensor, uniform_B: Tensor) -> Tensor:
    """Per row, the first token whose running probability sum exceeds uniform * total.

    Two levels instead of one running sum over the whole vocabulary (a sequential scan, the
    slowest step of sampling a large vocabulary): running sums of blocks of CDF_BLOCK tokens
    find the block, then one running sum inside it finds the token. Scaling by the total keeps
    the draw exact when the float sum is not quite 1. A zero-probability token is never drawn:
    searches are right-sided (such a token's running sum equals its predecessor's) and capped
    at the last block, and the last token within it, that adds mass (the float threshold can
    round up to the total)."""
    rows, vocab = probs_BV.shape
    blocks = -(-vocab // CDF_BLOCK)
    if blocks * CDF_BLOCK != vocab:
        probs_BV = torch.nn.functional.pad(probs_BV, (0, blocks * CDF_BLOCK - vocab))
    probs_BNK = probs_BV.view(rows, blocks, CDF_BLOCK)
    cdf_BN = probs_BNK.sum(-1).cumsum(-1)
    threshold_B1 = uniform_B[:, None] * cdf_BN[:, -1:]
    block_B1 = torch.searchsorted(cdf_BN, threshold_B1, right=True)
    block_B1 = torch.minimum(block_B1, (cdf_BN < cdf_BN[:, -1:]).sum(-1, keepdim=True))
    before_B1 = torch.where(
        block_B1 > 0, cdf_BN.gather(1, (block_B1 - 1).clamp(min=0)), torch.zeros_like(threshold_B1)
    )
    inside_BK = probs_BNK.gather(1, block_B1[:, :, None].expand(-1, -1, CDF_BLOCK)).squeeze(1)
    local_cdf_BK = inside_BK.cumsum(-1)
    offset_B1 = torch.searchsorted(local_cdf_BK, threshold_B1 - before_B1, right=True)
    offset_B1 = torch.minimum(
        offset_B1, (local_cdf_BK < local_cdf_BK[:, -1:]).sum(-1, keepdim=True)
    )
    return (block_B1 * CDF_BLOCK + offset_B1).squeeze(1)


def hit_stop_string(
    tokenizer: PreTrainedTokenizerBase, tokens: list[int], stop: tuple[str, ...]
) -> bool:
    """True when the text of `tokens` contains a stop string that the last token completed;
    stop strings may span token boundaries."""
    if not stop:
        return False
    longest = max(len(s) for s in stop)
    # A text token decodes to at least one character; the margin covers tokens that decode to
    # nothing (special tokens, partial UTF-8) so a stop string is never missed.
    window = tokens[-(longest + 8) :]
    tail = tokenizer.decode(window)
    if not any(s in tail for s in stop):
        return False
    previous = tokenizer.decode(window[:-1])
    return any(s in tail and s not in previous for s in stop)


# ---------------------------------------------------------------- model passes


def _routing(keys_B: Sequence[str], device: torch.device) -> list[tuple[str, Tensor | None]]:
    """LoraModel.route assignments: rows grouped by adapter (None: every row)."""
    distinct = list(dict.fromkeys(keys_B))
    if len(distinct) == 1:
        return [(distinct[0], None)]
    return [
        (key, torch.tensor([i for i, k in enumerate(keys_B) if k == key], device=device))
        for key in distinct
    ]


def _new_cache(gm: GeneratorModel, num_rows: int, capacity: int) -> KVCache:
    embedding = gm.model.get_input_embeddings().weight
    return KVCache.for_model(
        gm.model.config,
        num_rows=num_rows,
        capacity=capacity,
        dtype=embedding.dtype,
        device=embedding.device,
    )


def _forward(
    gm: GeneratorModel,
    cache: KVCache | SharedPrefixCache,
    tokens_BQ: Tensor,
    num_new_B: Tensor,
    keys_B: list[str],
) -> Tensor:
    """Append the real positions of tokens_BQ to the cache rows; hidden states [B, Q, H]."""
    config = gm.model.config
    positions_BQ = cache.begin(num_new_B)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    masks = cache.attention_masks(
        positions_BQ, layer_types, getattr(config, "sliding_window", None)
    )
    with gm.lora.route(_routing(keys_B, tokens_BQ.device)):
        hidden_BQH = gm.model.base_model(
            input_ids=tokens_BQ,
            position_ids=positions_BQ,
            attention_mask=masks,
            cache=cache,
            use_cache=True,
        ).last_hidden_state
    cache.commit()
    return hidden_BQH


def _head(gm: GeneratorModel, hidden_BH: Tensor, keys_B: list[str]) -> Tensor:
    with gm.lora.route(_routing(keys_B, hidden_BH.device)):
        return gm.model.get_output_embeddings()(hidden_BH)


def _extend(
    gm: GeneratorModel,
    cache: KVCache | SharedPrefixCache,
    tokens_B: list[Sequence[int]],
    keys_B: list[str],
) -> Iterator[tuple[Tensor, list[int], list[int]]]:
    """Append tokens_B[b] to row b in passes of at most PREFILL_TOKENS_PER_PASS positions.

    Yields (hidden [B, Q, H], start offset into tokens_B[b], count) per pass, so callers can
    read the hidden states of the positions they need."""
    device = gm.model.get_input_embeddings().weight.device
    done = [0] * len(tokens_B)
    width_limit = max(1, PREFILL_TOKENS_PER_PASS // max(1, len(tokens_B)))
    while any(d < len(t) for d, t in zip(done, tokens_B, strict=True)):
        counts = [min(len(t) - d, width_limit) for d, t in zip(done, tokens_B, strict=True)]
        width = max(counts)
        batch_BQ = torch.zeros(len(tokens_B), width, dtype=torch.int64)
        for b, (tokens, start, count) in enumerate(zip(tokens_B, done, counts, strict=True)):
            batch_BQ[b, :count] = torch.tensor(tokens[start : start + count], dtype=torch.int64)
        num_new_B = torch.tensor(counts, dtype=torch.int64, device=device)
        hidden_BQH = _forward(gm, cache, batch_BQ.to(device), num_new_B, keys_B)
        yield hidden_BQH, list(done), counts
        done = [d + c for d, c in zip(done, counts, strict=True)]


def _prefill(
    gm: GeneratorModel, groups: list[_Group], *, with_logits: bool
) -> tuple[KVCache, Tensor | None]:
    """KV of every group's prompt in row g of a new cache, from the prefix cache where possible;
    the first-token logits [G, V] (float32) when asked; prompt logprobs into groups that want
    them. The computed KV goes back into the prefix cache."""
    cache = _new_cache(gm, len(groups), max(len(g.prompt) for g in groups))
    for row, group in enumerate(groups):
        group.cache_hit_tokens = 0
        if group.wants_prompt_logprobs or not gm.prefix_cache.enabled:
            continue  # prompt logprobs need every position's hidden state
        namespace = (group.adapter_key, group.generation)
        # At most len - 1: the last prompt token must run to give the first logits.
        spans = gm.prefix_cache.lookup(namespace, group.prompt, max_tokens=len(group.prompt) - 1)
        for span in spans:
            cache.write_span(row, group.cache_hit_tokens, span)
            group.cache_hit_tokens += span.shape[3]
    keys = [g.adapter_key for g in groups]
    suffixes = [g.prompt[g.cache_hit_tokens :] for g in groups]
    last_hidden: list[Tensor | None] = [None] * len(groups)
    for hidden_BQH, starts, counts in _extend(gm, cache, suffixes, keys):
        for row, group in enumerate(groups):
            if counts[row] == 0:
                continue
            first = group.cache_hit_tokens + starts[row]  # prompt position of hidden[row, 0]
            if first + counts[row] == len(group.prompt):
                last_hidden[row] = hidden_BQH[row, counts[row] - 1]
            if group.wants_prompt_logprobs:
                _harvest_prompt_logprobs(gm, group, hidden_BQH[row, : counts[row]], first)
    for row, group in enumerate(groups):
        gm.prefix_cache.insert(
            (group.adapter_key, group.generation),
            group.prompt,
            lambda start, end, row=row: cache.span(row, start, end),
        )
    if not with_logits:
        return cache, None
    hidden_GH = torch.stack([h for h in last_hidden if h is not None])
    assert hidden_GH.shape[0] == len(groups), "every prompt has a last position"
    # float32 whatever the model's dtype: sampling and reported logprobs are float32 math.
    return cache, _head(gm, hidden_GH, keys).float()


def _harvest_prompt_logprobs(
    gm: GeneratorModel, group: _Group, hidden_QH: Tensor, first: int
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
        logprobs_QV = log_softmax_float32(_head(gm, hidden_QH[start:end], [group.adapter_key]))
        group.prompt_logprobs.extend(
            logprobs_QV.gather(-1, targets[start:end, None]).squeeze(-1).tolist()
        )
        if group.topk:
            k = min(group.topk, logprobs_QV.shape[-1])
            values_QK, ids_QK = torch.topk(logprobs_QV, k, dim=-1)  # sorted, descending
            for ids, values in zip(ids_QK.tolist(), values_QK.tolist(), strict=True):
                group.topk_prompt_logprobs.append(TopkPromptLogprobs(ids, values))


# ---------------------------------------------------------------- the decode loop


class _Batch:
    """The live rows of the decode loop, in cache order, with their per-row settings."""

    def __init__(self, rows: list[_Row], live: list[int], device: torch.device) -> None:
        self.rows = rows
        self.live = live
        self.device = device
        self._refresh_settings()

    def _refresh_settings(self) -> None:
        params = [self.rows[r].params for r in self.live]
        self.temperature_B = torch.tensor([p.temperature for p in params], device=self.device)
        self.top_k_B = torch.tensor([p.top_k for p in params], device=self.device)
        self.top_p_B = torch.tensor([p.top_p for p in params], device=self.device)

    def keep(self, positions: list[int]) -> None:
        self.live = [self.live[i] for i in positions]
        self._refresh_settings()

    def uniforms(self) -> Tensor:
        """One uniform per live row from its own generator (0 for greedy rows, unused)."""
        values = [
            float(torch.rand((), generator=row.generator)) if row.generator is not None else 0.0
            for row in (self.rows[r] for r in self.live)
        ]
        return torch.tensor(values, device=self.device)


def generate(
    gm: GeneratorModel,
    requests: list[GenerationRequest],
    *,
    versions: Mapping[str, WeightsVersion],
    between_tokens: Callable[[], None] | None = None,
) -> list[SampleResult]:
    """Sample every request; results align with `requests`.

    `versions` maps each adapter key to what it serves now and is read again after every
    `between_tokens()` call, which may publish new weights (PIPELINE weights-sync)."""
    attention.install(gm.model)
    with torch.no_grad():
        return _generate(gm, requests, versions, between_tokens)


def _plan(
    requests: list[GenerationRequest], versions: Mapping[str, WeightsVersion]
) -> tuple[list[_Group], list[int], list[_Row]]:
    """Groups (distinct adapter + prompt), the group of each request, and the rows."""
    groups: list[_Group] = []
    group_of_request: list[int] = []
    index: dict[tuple[str, tuple[int, ...]], int] = {}
    rows: list[_Row] = []
    for r, request in enumerate(requests):
        key = (request.adapter_key, request.prompt)
        if key not in index:
            index[key] = len(groups)
            generation = versions[request.adapter_key].generation
            groups.append(_Group(request.adapter_key, request.prompt, generation))
        group_of_request.append(index[key])
        group = groups[index[key]]
        group.topk = max(group.topk, request.topk_prompt_logprobs)
        group.wants_prompt_logprobs |= request.prompt_logprobs or request.topk_prompt_logprobs > 0
        params = request.params
        for j in range(request.num_samples):
            generator = None
            if params.temperature > 0:
                generator = torch.Generator().manual_seed(row_seed(params.seed, j))
            rows.append(_Row(r, index[key], params, generator))
    return groups, group_of_request, rows


def _record(gm: GeneratorModel, row: _Row, token: int, logprob: float) -> None:
    """Append a sampled token; set the row's stop reason when it ends here."""
    row.tokens.append(token)
    row.logprobs.append(logprob)
    if token in gm.eos_token_ids or hit_stop_string(gm.tokenizer, row.tokens, row.params.stop):
        row.stop_reason = StopReason.STOP
    elif len(row.tokens) >= row.params.max_tokens:
        row.stop_reason = StopReason.LENGTH


def _sample_step(gm: GeneratorModel, batch: _Batch, logits_BV: Tensor) -> list[int]:
    """Draw and record one token for every live row; returns the batch positions still live."""
    logprobs_BV = log_softmax_float32(logits_BV)
    tokens_B = choose_tokens(
        logprobs_BV, batch.temperature_B, batch.top_k_B, batch.top_p_B, batch.uniforms()
    )
    logprobs_B = logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
    still_live = []
    for i, (r, token, logprob) in enumerate(
        zip(batch.live, tokens_B.tolist(), logprobs_B.tolist(), strict=True)
    ):
        _record(gm, batch.rows[r], token, logprob)
        if batch.rows[r].stop_reason is None:
            still_live.append(i)
    return still_live


def _generate(
    gm: GeneratorModel,
    requests: list[GenerationRequest],
    versions: Mapping[str, WeightsVersion],
    between_tokens: Callable[[], None] | None,
) -> list[SampleResult]:
    device = gm.model.get_input_embeddings().weight.device
    groups, group_of_request, rows = _plan(requests, versions)
    segments = [[PolicySegment(0, versions[q.adapter_key].version)] for q in requests]
    prefill_cache, first_logits_GV = _prefill(gm, groups, with_logits=True)
    assert first_logits_GV is not None
    batch = _Batch(rows, list(range(len(rows))), device)
    group_of_row_R = torch.tensor([row.group for row in rows], device=device)
    batch.keep(_sample_step(gm, batch, first_logits_GV[group_of_row_R]))
    if not batch.live:
        return _results(requests, groups, group_of_request, rows, segments)
    longest_completion = max(rows[r].params.max_tokens for r in batch.live)
    own = _new_cache(gm, len(batch.live), min(longest_completion, DECODE_POSITIONS_PER_GROWTH))
    cache = SharedPrefixCache(
        prefill_cache, list(range(len(groups))), own, [rows[r].group for r in batch.live]
    )
    # Frees the prompts whose every sample already ended on its first token.
    cache.keep(torch.arange(len(batch.live), device=device))
    while batch.live:
        if between_tokens is not None:
            between_tokens()
            _apply_new_weights(gm, batch, cache, groups, requests, versions, segments)
        if cache.longest_own() >= cache.capacity:
            cache.grow(cache.capacity + DECODE_POSITIONS_PER_GROWTH)
        keys = [groups[rows[r].group].adapter_key for r in batch.live]
        last_B1 = torch.tensor([[rows[r].tokens[-1]] for r in batch.live], device=device)
        num_new_B = torch.ones(len(batch.live), dtype=torch.int64, device=device)
        hidden_B1H = _forward(gm, cache, last_B1, num_new_B, keys)
        keep = _sample_step(gm, batch, _head(gm, hidden_B1H[:, -1], keys))
        if len(keep) < len(batch.live):
            order = _fill_holes(keep)
            cache.keep(torch.tensor(order, dtype=torch.int64, device=device))
            batch.keep(order)
    return _results(requests, groups, group_of_request, rows, segments)


def _fill_holes(keep: list[int]) -> list[int]:
    """A new order of the batch positions in `keep` (ascending) that leaves every kept position
    below len(keep) in place and moves the ones beyond into the holes: the fewest row copies."""
    count = len(keep)
    staying = {i for i in keep if i < count}
    movers = iter(i for i in keep if i >= count)
    return [i if i in staying else next(movers) for i in range(count)]


def _apply_new_weights(
    gm: GeneratorModel,
    batch: _Batch,
    cache: SharedPrefixCache,
    groups: list[_Group],
    requests: list[GenerationRequest],
    versions: Mapping[str, WeightsVersion],
    segments: list[list[PolicySegment]],
) -> None:
    """After a publish: recompute the KV of the live rows whose adapter changed with the new
    weights (their prompt once, then each row's tokens so far but the last, which the next pass
    feeds), and open a policy segment at their next token."""
    rows = batch.rows
    changed = {
        g
        for g in {rows[r].group for r in batch.live}
        if versions[groups[g].adapter_key].generation != groups[g].generation
    }
    if not changed:
        return
    fresh: list[_Group] = []
    for g in sorted(changed):
        current = versions[groups[g].adapter_key]
        groups[g].generation = current.generation
        fresh.append(_Group(groups[g].adapter_key, groups[g].prompt, current.generation))
    group_cache, _ = _prefill(gm, fresh, with_logits=False)
    for fresh_row, g in enumerate(sorted(changed)):
        cache.replace_prefix(g, group_cache, fresh_row)
    positions = [i for i, r in enumerate(batch.live) if rows[r].group in changed]
    affected = [rows[batch.live[i]] for i in positions]
    suffixes = [row.tokens[:-1] for row in affected]
    own = _new_cache(gm, len(affected), max(map(len, suffixes)) or 1)
    row_cache = cache.subset(own, [row.group for row in affected])
    keys = [groups[row.group].adapter_key for row in affected]
    for _ in _extend(gm, row_cache, suffixes, keys):
        pass
    device = cache.own.kv.device
    cache.own.copy_rows(
        row_cache.own,
        torch.arange(len(affected), device=device),
        torch.tensor(positions, dtype=torch.int64, device=device),
    )
    switched: dict[int, int] = {}  # request -> generated tokens before the switch
    for row in affected:
        switched[row.request] = len(row.tokens)
    for r, start in switched.items():
        version = versions[requests[r].adapter_key].version
        if segments[r][-1].version != version:
            segments[r].append(PolicySegment(start, version))


def _results(
    requests: list[GenerationRequest],
    groups: list[_Group],
    group_of_request: list[int],
    rows: list[_Row],
    segments: list[list[PolicySegment]],
) -> list[SampleResult]:
    sequences: list[list[SampledSequence]] = [[] for _ in requests]
    for row in rows:
        assert row.stop_reason is not None, "every row ends with a stop reason"
        hits = groups[row.group].cache_hit_tokens
        sequences[row.request].append(
            SampledSequence(row.tokens, row.logprobs, row.stop_reason, hits)
        )
    results = []
    for r, request in enumerate(requests):
        group = groups[group_of_request[r]]
        prompt_logprobs = [0.0, *group.prompt_logprobs] if request.prompt_logprobs else None
        topk = None
        if request.topk_prompt_logprobs:
            k = request.topk_prompt_logprobs
            topk = [TopkPromptLogprobs([], [])] + [
                TopkPromptLogprobs(t.token_ids[:k], t.logprobs[:k])
                for t in group.topk_prompt_logprobs
            ]
        results.append(SampleResult(sequences[r], segments[r], prompt_logprobs, topk))
    return results
