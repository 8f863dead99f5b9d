"""The prefill of prompts joining a running batch of static passes, run over persistent tensors
and, on CUDA, replayed from a CUDA graph: the join's counterpart of decode_graph.py.

Beside static passes (CUDA graphs) a join's prompts cannot ride in a decode pass
(joining_pass.py: it would turn a replayed pass into an eager one). An eager prefill pass
costs on the H200 about 88 ms of launches for a 28-layer model, about what a replayed block of
8 decode passes costs, at almost every block of a stream. So a join's prefill is a
PrefillStep of a bucket (the adapter; rows, positions run and cache columns each rounded up
to a power of two, positions to at least MIN_WIDTH), made once and reused by every later join
of that bucket. What the prefix cache holds of each prompt is copied into the step's
persistent KVCache and the pass starts each row there (`start_B`, which the pass copies into
the cache's lengths itself); the rest of each prompt is copied into a persistent token tensor
(right-padded: causal attention keeps a real position from seeing the padding after it); the
head's logits at each prompt's last real position land in a persistent tensor. On CUDA the
pass is captured after a warm-up and replayed; elsewhere it runs eagerly (how the CPU tests
check it).

It serves joins whose prompts are all on one adapter (`by_adapter` splits a join of several),
within STEP_POSITIONS positions; not a prompt that wants prompt logprobs or routed experts.
`start_rows` gives the others a prefill pass (joins.start_rows, with what the prefix cache was
already asked). A step serves one generation of its adapter's weights (a capture holds the
addresses of the weights it read): publishing new ones drops the steps, and a step is keyed by
the generation too. KEPT_POSITIONS bounds what they hold.

Legend: B = rows of the bucket, Q = its positions, V = vocab.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from posttrain.engine.generate.decode_rows import LiveRows
from posttrain.engine.generate.joins import Generation, first_tokens, start_rows
from posttrain.engine.generate.prefill import (
    GeneratorModel,
    PromptGroup,
    forward_rows,
    head_logits,
    keep_prompts,
    prompt_cache,
    routing_of,
)
from posttrain.model.kv_cache import KVCache, power_of_two_at_least

log = logging.getLogger("posttrain")

# The fewest prompt positions of a bucket: short prompts share one step.
MIN_WIDTH = 16
# What a step may hold: it keeps its KV cache (rows x columns) and, on CUDA, its graph's
# memory between joins, outside the memory estimate; a bucket past it prefills eagerly.
STEP_POSITIONS = 4096
# What the kept steps hold in all (the most recently used): as much as 4 of the largest, or a
# step per bucket of each of many adapters (a stream sampling many LoRA sessions), each made
# once where a bound by count would remake them round after round.
KEPT_POSITIONS = 4 * STEP_POSITIONS
# Benchmarks turn it off to compare with eager prefill passes for every join.
JOIN_PREFILL_STEPS = True


class _PaddedPromptCache(KVCache):
    """A KVCache whose passes all start empty and fill every row to its capacity: the mask's
    columns are known on the host (the base class reads the last position back, which a
    capture cannot)."""

    def placeholder_columns(self, positions_BQ: Tensor) -> int:
        return self.capacity


class PrefillStep:
    """The prefill pass of one bucket: `run` prefills up to `rows` prompts on adapter `key`,
    each running up to `width` positions after what the prefix cache held of it, all within
    `capacity` positions."""

    def __init__(
        self, gm: GeneratorModel, key: str, rows: int, width: int, capacity: int, graph: bool
    ) -> None:
        self.gm = gm
        embedding = gm.embedding
        device = embedding.device
        self.cache = _PaddedPromptCache.for_model(
            gm.kv, num_rows=rows, capacity=capacity, dtype=embedding.dtype, device=device
        )
        self.keys = [key] * rows
        self.routing = routing_of(self.keys, device)
        self.width = width
        # Persistent inputs and outputs: the tokens run, the positions each row starts at (its
        # prefix-cache hit) and its last real one, the first-token logits.
        self.tokens_BQ = torch.zeros(rows, width, dtype=torch.int64, device=device)
        self.start_B = torch.zeros(rows, dtype=torch.int64, device=device)
        self.last_B = torch.zeros(rows, dtype=torch.int64, device=device)
        self.rows_B = torch.arange(rows, device=device)
        self.width_B = torch.full((rows,), width, dtype=torch.int64, device=device)
        self.logits_BV: Tensor | None = None
        self.graph = self._captured() if graph else None

    @property
    def positions(self) -> int:
        """What its cache holds: rows x columns (PrefillSteps keeps KEPT_POSITIONS in all)."""
        return self.cache.num_rows * self.cache.capacity

    def run(self, groups: list[PromptGroup], hits: KVCache) -> tuple[KVCache, Tensor]:
        """Prefill the prompts of `groups` (at most the bucket's rows), row g of `hits` holding
        the group.cache_hit_tokens positions the prefix cache had of group g's prompt: (the
        cache, row g holding prompt g's KV and length; the first-token logits [G, V],
        float32)."""
        tokens_BQ = torch.zeros(self.tokens_BQ.shape, dtype=torch.int64)
        starts = [g.cache_hit_tokens for g in groups]
        for row, group in enumerate(groups):
            suffix = group.prompt[starts[row] :]
            tokens_BQ[row, : len(suffix)] = torch.tensor(suffix, dtype=torch.int64)
        if cached := max(starts):
            self.cache.kv[:, :, : len(groups), :, :cached] = hits.kv[:, :, :, :, :cached]
        starts += [0] * (len(self.rows_B) - len(groups))  # padding rows: one position
        lengths = [len(g.prompt) for g in groups] + [1] * (len(starts) - len(groups))
        self.tokens_BQ.copy_(tokens_BQ)
        self.start_B.copy_(torch.tensor(starts))
        self.last_B.copy_(torch.tensor(lengths) - torch.tensor(starts) - 1)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits_BV = self._pass()
        assert self.logits_BV is not None
        self.cache.lengths_B.copy_(torch.tensor(lengths))
        return self.cache, self.logits_BV[: len(groups)]

    def _pass(self) -> Tensor:
        self.cache.lengths_B.copy_(self.start_B)
        hidden_BQH = forward_rows(
            self.gm,
            self.cache,
            self.tokens_BQ,
            self.width_B,
            self.keys,
            uniform=(self.width, self.cache.capacity),
            adapter_routing=self.routing,
        )
        last_BH = hidden_BQH[self.rows_B, self.last_B]
        return head_logits(self.gm, last_BH, self.keys, self.routing).float()

    def _captured(self) -> torch.cuda.CUDAGraph | None:
        """The captured pass, or None (eager passes) when capture fails (decode_graph.py).
        A warm-up pass on a side stream first (lazy set-up must not happen in a capture); it
        also makes the output tensor. Each pass resets the cache's lengths, so nothing of the
        warm-up needs undoing."""
        try:
            device = self.tokens_BQ.device
            # torch.cuda.Stream.__new__ carries no annotations in torch.
            side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self.logits_BV = self._pass()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits_BV.copy_(self._pass())
            return graph
        except RuntimeError as error:
            log.warning("prefill pass not captured in a CUDA graph, running it eagerly: %s", error)
            return None


class PrefillSteps:
    """The PrefillSteps of one decoding, by bucket; `start_rows` is joins.start_rows through
    them where they serve (see the module docstring)."""

    def __init__(self, graphs: bool) -> None:
        self.graphs = graphs
        self._steps: dict[tuple[str, int, int, int, int], PrefillStep] = {}

    def clear(self) -> None:
        self._steps = {}

    def start_rows(
        self, gm: GeneratorModel, generation: Generation, group_ids: list[int], row_ids: list[int]
    ) -> tuple[KVCache, LiveRows]:
        """joins.start_rows (prefill groups `group_ids`, draw the first token of rows
        `row_ids`) through a PrefillStep where one serves them, else by a prefill pass."""
        groups = [generation.groups[g] for g in group_ids]
        keys = {g.adapter_key for g in groups}
        if (
            not JOIN_PREFILL_STEPS
            or len(keys) > 1
            or any(g.wants_prompt_logprobs or g.wants_routes for g in groups)
        ):
            return start_rows(gm, generation, group_ids, row_ids)
        hits = prompt_cache(gm, groups)  # sets each group's cache_hit_tokens
        rows = power_of_two_at_least(len(groups))
        width = power_of_two_at_least(
            max(len(g.prompt) - g.cache_hit_tokens for g in groups), MIN_WIDTH
        )
        capacity = power_of_two_at_least(max(g.cache_hit_tokens for g in groups) + width)
        if rows * capacity > STEP_POSITIONS:
            return start_rows(gm, generation, group_ids, row_ids, hits)
        adapter = keys.pop()
        key = (adapter, groups[0].generation, rows, width, capacity)
        step = self._steps.pop(key, None)  # re-inserted last: the most recently used
        if step is None:
            step = PrefillStep(gm, adapter, rows, width, capacity, self.graphs)
        self._steps[key] = step
        while sum(s.positions for s in self._steps.values()) > KEPT_POSITIONS:
            del self._steps[next(iter(self._steps))]  # the least recently used
        cache, logits_GV = step.run(groups, hits)
        keep_prompts(gm, groups, cache)
        return cache, first_tokens(gm, generation, group_ids, row_ids, logits_GV)


def by_adapter(
    generation: Generation, group_ids: list[int], row_ids: list[int]
) -> list[tuple[list[int], list[int]]]:
    """A join's groups and rows split by adapter, in order of first appearance: a step prefills
    one adapter's prompts (its routing is made once), so a join of several runs a step for
    each instead of an eager pass for all."""
    parts: dict[str, tuple[list[int], list[int]]] = {}
    for g in group_ids:
        parts.setdefault(generation.groups[g].adapter_key, ([], []))[0].append(g)
    for r in row_ids:
        parts[generation.rows[r].adapter_key][1].append(r)
    return list(parts.values())
