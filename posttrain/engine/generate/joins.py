"""The requests, prompts and rows of one generation (sampler.py's Decoding) and what changes
them: rows starting (the first requests' and those joining the running decode batch at a block
boundary), weights switching under running rows (PIPELINE), results as requests complete.

A Generation grows as requests join: `add` plans requests into prompt groups (one per distinct
adapter + prompt among them) and rows (one per sampled sequence), appended to what the call
already has, so a row's `request` and `group` stay indices into one list each. `start_rows`
prefills the new groups and draws each new row's first token, the same way for the first
requests and for joining ones; the rows still live after it are what joins the decode batch
(LiveRows.join, FanoutKVCache.join). A joined row's random stream is its own torch.Generator,
seeded from (seed, sample index) as alone, so its tokens do not depend on when it joined.
`settle` says which requests just completed, `result` builds one request's result.
`switch_weights` recomputes the KV of running rows whose weights were published meanwhile.
`pooled_prefixes` puts a stream's first prompts in its pool (prompts that join later are
appended there without moving the running ones; sampler.Decoding.pool_rows).

Legend: G = prefill groups (distinct prompts), R = rows (sequences), V = vocab.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from posttrain.engine.generate.decode_rows import LiveRows, SampledRow
from posttrain.engine.generate.draws import draw, record_steps
from posttrain.engine.generate.prefill import (
    GeneratorModel,
    PromptGroup,
    extend_rows,
    new_cache,
    prefill,
)
from posttrain.engine.generate.sampling_math import row_seed
from posttrain.engine.state import WeightsVersion
from posttrain.engine.train.expert_routes import to_routes
from posttrain.model.fanout_kv_cache import FanoutKVCache
from posttrain.model.kv_cache import KVCache
from posttrain.model.vision import image_hash
from posttrain.types import (
    ImageInput,
    PolicySegment,
    SampledSequence,
    SampleResult,
    SamplingParams,
    StopReason,
    TopkPromptLogprobs,
)

# A stream's pool holds prompts of up to a multiple of this many positions: joining prompts up
# to that length take a free row; a longer one reallocates the prompt part (a copy of the
# prompts, not of the rows' generated KV).
PREFIX_POOL_POSITIONS = 256


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt of one sample operation: num_samples sequences sharing one prefill."""

    prompt: tuple[int, ...]
    num_samples: int
    params: SamplingParams
    adapter_key: str
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    return_routed_experts: bool = False  # ignored by a dense model (api.md 1.4.6)
    images: tuple[ImageInput, ...] = ()  # the prompt's images, placeholders in `prompt`


@dataclass
class Generation:
    """Everything one generate call has been asked for so far, in arrival order."""

    requests: list[GenerationRequest] = field(default_factory=list)
    groups: list[PromptGroup] = field(default_factory=list)
    group_of_request: list[int] = field(default_factory=list)
    rows: list[SampledRow] = field(default_factory=list)
    segments: list[list[PolicySegment]] = field(default_factory=list)
    # Per request, its rows not ended yet; and the rows counted as ended (see `settle`).
    _open: dict[int, int] = field(default_factory=dict)
    _ended: set[int] = field(default_factory=set)
    _first_row: list[int] = field(default_factory=list)  # per request, its first row's id

    def add(
        self,
        gm: GeneratorModel,
        requests: list[GenerationRequest],
        versions: Mapping[str, WeightsVersion],
    ) -> tuple[list[int], list[int]]:
        """Plan `requests`; returns the ids of their (new) prompt groups and of their rows.
        Prompts are shared within one `add` only: a joining request never reads the prefix
        of a running group (its weights may have been published since)."""
        first_group, first_row = len(self.groups), len(self.rows)
        # Placeholders of equal-sized images are equal tokens: the images' bytes tell apart.
        index: dict[tuple[str, tuple[int, ...], tuple[str, ...]], int] = {}
        for request in requests:
            r = len(self.requests)
            self.requests.append(request)
            self._open[r] = request.num_samples
            self._first_row.append(len(self.rows))
            self.segments.append([PolicySegment(0, versions[request.adapter_key].version)])
            wants_routes = request.return_routed_experts and gm.moe is not None
            hashes = tuple(image_hash(image.data) for image in request.images)
            key = (request.adapter_key, request.prompt, hashes)
            if key not in index:
                index[key] = len(self.groups)
                generation = versions[request.adapter_key].generation
                self.groups.append(
                    PromptGroup(
                        request.adapter_key, request.prompt, generation, images=request.images
                    )
                )
            g = index[key]
            self.group_of_request.append(g)
            group = self.groups[g]
            group.topk = max(group.topk, request.topk_prompt_logprobs)
            group.wants_prompt_logprobs |= (
                request.prompt_logprobs or request.topk_prompt_logprobs > 0
            )
            group.wants_routes |= wants_routes
            params = request.params
            for j in range(request.num_samples):
                generator = None
                if params.temperature > 0:
                    generator = torch.Generator().manual_seed(row_seed(params.seed, j))
                routes: list[Tensor] | None = [] if wants_routes else None
                self.rows.append(
                    SampledRow(r, g, request.adapter_key, params, generator, routes=routes)
                )
        return list(range(first_group, len(self.groups))), list(range(first_row, len(self.rows)))

    def placeholders(self, likes: list[SampledRow]) -> tuple[list[int], list[int]]:
        """A row of no request per running row of `likes`, each with an empty prompt group of
        its own, ended from the start: rows a static layout holds for joins to take
        (padding_joins.py). Each takes the adapter and settings of its `like`, so a join into
        it keeps the layout's routing and sampling kind. Returns (their group ids, their row
        ids)."""
        group_ids, row_ids = [], []
        for like in likes:
            generation = self.groups[like.group].generation
            group_ids.append(len(self.groups))
            self.groups.append(PromptGroup(like.adapter_key, (), generation))
            row_ids.append(len(self.rows))
            # Ended from the start: whatever it computes is dropped (draws.record_steps).
            row = SampledRow(-1, group_ids[-1], like.adapter_key, like.params, None)
            row.stop_reason = StopReason.LENGTH
            self.rows.append(row)
            self._ended.add(row_ids[-1])  # no request to settle
        return group_ids, row_ids

    def renew(
        self, group_ids: list[int], row_ids: list[int], versions: Mapping[str, WeightsVersion]
    ) -> None:
        """Groups planned but not prefilled yet (joining_pass.py defers a join's prefill to
        the next decode pass) are served by what their adapters serve now: weights published
        since `add` (PIPELINE) give their every token, in one policy segment."""
        for g in group_ids:
            self.groups[g].generation = versions[self.groups[g].adapter_key].generation
        for r in dict.fromkeys(self.rows[row].request for row in row_ids):
            version = versions[self.requests[r].adapter_key].version
            self.segments[r] = [PolicySegment(0, version)]

    def results(self) -> list[SampleResult]:
        return [self.result(r) for r in range(len(self.requests))]

    def result(self, r: int) -> SampleResult:
        """Request r's result; every row of it has ended."""
        request = self.requests[r]
        group = self.groups[self.group_of_request[r]]
        sequences: list[SampledSequence] = []
        for row in self.rows_of(r):
            assert row.stop_reason is not None, "every row ends with a stop reason"
            routes = None
            if row.routes is not None:
                # Every position that ran: the prompt's and each generated token but the last.
                routes = to_routes(torch.cat([*group.routes, *(t[None] for t in row.routes)]))
            sequences.append(
                SampledSequence(
                    row.tokens, row.logprobs, row.stop_reason, group.cache_hit_tokens, routes
                )
            )
        prompt_logprobs = [0.0, *group.prompt_logprobs] if request.prompt_logprobs else None
        topk = None
        if request.topk_prompt_logprobs:
            k = request.topk_prompt_logprobs
            topk = [TopkPromptLogprobs([], [])] + [
                TopkPromptLogprobs(t.token_ids[:k], t.logprobs[:k])
                for t in group.topk_prompt_logprobs
            ]
        return SampleResult(
            sequences,
            self.segments[r],
            prompt_logprobs,
            topk,
            prefix_cache_refused=group.prefix_cache_refused,
        )

    def rows_of(self, r: int) -> list[SampledRow]:
        """Request r's rows, in sample order (a request's rows are planned together)."""
        first = self._first_row[r]
        return self.rows[first : first + self.requests[r].num_samples]

    def settle(self, row_ids: Iterable[int]) -> list[int]:
        """The requests whose last open row is among `row_ids` and has ended: each request is
        returned once, when its result is complete (rows may be looked at again, e.g. the
        finished rows a static batch keeps as padding)."""
        done = []
        for row_id in row_ids:
            row = self.rows[row_id]
            if row.stop_reason is None or row_id in self._ended:
                continue
            self._ended.add(row_id)
            self._open[row.request] -= 1
            if self._open[row.request] == 0:
                done.append(row.request)
        return done


def start_rows(
    gm: GeneratorModel,
    generation: Generation,
    group_ids: list[int],
    row_ids: list[int],
    hits: KVCache | None = None,
) -> tuple[KVCache, LiveRows]:
    """Prefill groups `group_ids` (row i of the returned cache is group group_ids[i]) and draw
    the first token of rows `row_ids` (rows of those groups); returns the prefill and the
    rows still live after their first token, as a batch of their own. `hits`: the groups'
    prompt_cache, when the caller has already looked them up."""
    groups = [generation.groups[g] for g in group_ids]
    prefill_cache, first_logits_GV = prefill(gm, groups, with_logits=True, cache=hits)
    assert first_logits_GV is not None
    return prefill_cache, first_tokens(gm, generation, group_ids, row_ids, first_logits_GV)


def first_tokens(
    gm: GeneratorModel,
    generation: Generation,
    group_ids: list[int],
    row_ids: list[int],
    first_logits_GV: Tensor,
) -> LiveRows:
    """Draw the first token of rows `row_ids` from their groups' first logits (row i of
    first_logits_GV is group group_ids[i]'s); returns the rows still live after it."""
    device = first_logits_GV.device
    batch = LiveRows(generation.rows, list(row_ids), device, first_logits_GV.shape[-1])
    cache_row = {g: i for i, g in enumerate(group_ids)}
    rows_of_R = torch.tensor([cache_row[generation.rows[r].group] for r in row_ids], device=device)
    first_B = draw(batch, first_logits_GV[rows_of_R])
    tokens_1B, logprobs_1B = batch.to_host(first_B[0][None], first_B[1][None])
    batch.keep(record_steps(gm, batch, tokens_1B, logprobs_1B))
    return batch


def pooled_prefixes(gm: GeneratorModel, prefill_cache: KVCache, rows: int) -> KVCache:
    """The prompts' KV of a prefill in a cache allocated for `rows` prompts (a stream's pool:
    one per row at most) of up to the prefill's longest rounded up to PREFIX_POOL_POSITIONS,
    so prompts joining later that are no longer take its free rows without reallocating."""
    step = PREFIX_POOL_POSITIONS
    columns = step * math.ceil(prefill_cache.capacity / step)
    pool = new_cache(gm, prefill_cache.num_rows, columns, rows)
    every = torch.arange(prefill_cache.num_rows, device=pool.kv.device)
    pool.copy_rows(prefill_cache, every, every)
    return pool


def switch_weights(
    gm: GeneratorModel,
    batch: LiveRows,
    cache: FanoutKVCache,
    generation: Generation,
    versions: Mapping[str, WeightsVersion],
) -> bool:
    """After a publish: recompute the KV of the running rows whose adapter changed with the new
    weights (their prompt once, then each row's tokens so far but the last, which the next pass
    feeds), and open a policy segment at their next token. Finished rows kept as padding
    (static passes) are left alone. Returns whether anything changed."""
    rows, groups, segments = batch.rows, generation.groups, generation.segments
    changed = {
        g
        for g in {rows[r].group for r in batch.live if rows[r].stop_reason is None}
        if versions[groups[g].adapter_key].generation != groups[g].generation
    }
    if not changed:
        return False
    fresh: list[PromptGroup] = []
    for g in sorted(changed):
        current = versions[groups[g].adapter_key]
        groups[g].generation = current.generation
        group = groups[g]
        fresh.append(
            PromptGroup(group.adapter_key, group.prompt, current.generation, images=group.images)
        )
    group_cache, _ = prefill(gm, fresh, with_logits=False)
    for fresh_row, g in enumerate(sorted(changed)):
        cache.replace_prefix(g, group_cache, fresh_row)
    positions = [
        i
        for i, r in enumerate(batch.live)
        if rows[r].group in changed and rows[r].stop_reason is None
    ]
    affected = [rows[batch.live[i]] for i in positions]
    suffixes = [row.tokens[:-1] for row in affected]
    own = new_cache(gm, len(affected), max(map(len, suffixes)) or 1)
    row_cache = cache.subset(own, [row.group for row in affected])
    keys = [groups[row.group].adapter_key for row in affected]
    for _ in extend_rows(gm, row_cache, suffixes, keys):
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
        version = versions[generation.requests[r].adapter_key].version
        if segments[r][-1].version != version:
            segments[r].append(PolicySegment(start, version))
    return True
