"""Batched generation: many prompts, samples, sessions and sampling settings in one decode loop.

One `generate` call takes a list of GenerationRequests (one prompt of one sample operation
each; every request names its own adapter and sampling params, so requests of different
operations and sessions can share passes) and runs:

1. Prefill (prefill.py), once per distinct (adapter, prompt): the longest cached prefix
   comes from the prefix cache (prefix_cache.py: prompt KV kept between requests), only the
   rest runs through the model, in passes of bounded size.
   Its last position gives the first token's logits; prompt logprobs, when asked for, come from
   the same pass.
2. Fan-out: one row per sampled sequence in a FanoutKVCache (model/fanout_kv_cache.py, the
   decode cache of this one call): the prefill's KV stays one copy per prompt, read by all of
   its num_samples rows (shared-prefix attention, model/attention.py), and each row stores only
   the tokens it generates.
3. Decode, one token per live row per pass, in blocks of K passes (DECODE_BLOCK_STEPS on an
   accelerator, 1 on the CPU): a block reads nothing back from the device but, at its end,
   the sampled tokens and logprobs of its K passes, in one transfer; what a pass needs of the
   rows is kept ready between passes (decode_rows.py). The host then records each row's K
   tokens up to its stop (draws.record: a stop token id, EOS unless the row's params turn it
   off, a stop string even when it spans tokens, its max_tokens) and drops the passes a row
   ran past it: its random stream is its own, so no other row's tokens change (their
   logprobs may in the last bits: a matrix product's rows depend on how many rows it has).
   Dynamic passes (`dynamic_block`) follow the rows' shapes: finished rows leave the batch at
   block ends and the cache is compacted (prompts no live row continues too), so long rows
   never pay for finished ones.
   Static-shape passes (decode_graph.py; on CUDA unless `--cuda-graphs off`, where they are
   captured in CUDA graphs and replayed) keep finished rows as padding until at most half the
   batch runs (a quarter in a stream, whose layouts hold placeholder rows for joins to take:
   padding_joins.py).
4. In-flight weight updates (WEIGHT_SYNC_TYPE_PIPELINE): between blocks `between_tokens` may
   publish new generator weights. Rows whose adapter changed get their KV recomputed with the new
   weights (their prompt's once, then each row's tokens so far), and their result gains a policy
   segment starting at the next generated token, so every token after the switch is exactly what
   the new weights give.
5. Joins: between blocks (after `between_tokens`) `admit` may return new requests. They are
   planned, prefilled and drawn their first token like the first batch's (joins.py; beside
   dynamic passes their prompts ride in the block's first decode pass: joining_pass.py), and
   their live rows are appended to the batch and the cache (FanoutKVCache.join). A joined
   row's own part starts empty: the host keeps every row's own length, so dynamic passes
   build per-row own masks without reading anything back (the `uniform` fast path while all
   are equal); static passes keep one own length per row (a join takes padding rows of the
   layout, or makes a new one: padding_joins.py). A request
   completed at a block end is reported then (`finished`). The loop is a Decoding, run one
   block at a time; `generate` drives it with callbacks, a scheduler may drive it directly.

Sampling (sampling_math.py): temperature, top-k, top-p, then one inverse-CDF draw per row from
its own torch.Generator. Sample j of a prompt seeds its generator from (seed, j), so the same
seed, prompt and weights give the same tokens whatever else is in the batch and however many
samples were asked for (two identical prompts in one request with one seed therefore get
identical samples). Unseeded rows draw their seed from the OS. Draws happen on the CPU
generator so a seed means the same on every device.

Logprobs. A sampled token's logprob is the untempered float32 log-softmax (train/logprobs.py) of the
logits it was drawn from, the model's own distribution: what forward-backward computes for the
same token. Prompt logprobs use the same function. A sampled token's logprob is finite whenever
the logits are (the draw never picks a token of probability 0); non-finite logits fail the pass
with NON_FINITE_LOSS instead of answering a null logprob.

Legend: G = prefill groups (distinct prompts), R = rows (sequences), B = rows in a pass,
Q = new positions per row in a pass, V = vocab, H = hidden size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from posttrain.engine.generate.decode_graph import DecodeStep, static_passes_supported
from posttrain.engine.generate.decode_rows import LiveRows
from posttrain.engine.generate.draws import draw, record_steps
from posttrain.engine.generate.joining_pass import Joining, decode_and_prefill, joins_in_pass
from posttrain.engine.generate.joins import (
    Generation,
    GenerationRequest,
    pooled_prefixes,
    start_rows,
    switch_weights,
)
from posttrain.engine.generate.padding_joins import (
    add_placeholders,
    join_into_padding,
    keeps_layout,
    rewind_padding,
)
from posttrain.engine.generate.prefill import (
    GeneratorModel,
    forward_rows,
    head_logits,
    new_cache,
)
from posttrain.engine.generate.prefill_graph import PrefillSteps, by_adapter
from posttrain.engine.state import WeightsVersion
from posttrain.model import attention
from posttrain.model.fanout_kv_cache import FanoutKVCache
from posttrain.model.kv_cache import KVCache, fill_holes
from posttrain.model.static_decode_cache import StaticDecodeCache
from posttrain.types import SampleResult

# Decode positions allocated at a time: memory follows the longest live row instead of being
# reserved for every row's max_tokens up front.
DECODE_POSITIONS_PER_GROWTH = 256

# Decode passes per block on an accelerator: the block's tokens and logprobs come back in one
# transfer (one device synchronisation per 8 tokens instead of per token), for at most 7
# discarded passes of a row that stops early and a PIPELINE weights switch up to 8 tokens
# later. On the CPU a read-back costs nothing and each pass of a stopped row costs its full
# compute, so blocks are CPU_BLOCK_STEPS = 1 pass there (the per-token path).
DECODE_BLOCK_STEPS = 8
CPU_BLOCK_STEPS = 1

# Static-shape decode passes (generate/decode_graph.py), captured in a CUDA graph on CUDA,
# where a small model's step is hundreds of kernel launches: asked for by EngineConfig.cuda_graphs
# (on by default, `posttrain serve --cuda-graphs off` turns it off; config.py gives the GPU
# run's numbers) or by STATIC_DECODE (benchmarks). On the CPU a static pass
# attends over the own part's whole capacity and keeps finished rows as padding for nothing a
# graph gives back, so it runs only when CPU_STATIC_DECODE asks (the tests check it there).
STATIC_DECODE = False
CPU_STATIC_DECODE = False
CUDA_GRAPHS = True


def peak_own_positions(max_tokens: int) -> int:
    """Peak positions per row of the generated (own) part of the decode cache, for a row of
    `max_tokens` new tokens: twice its final capacity (Decoding allocates it in steps of
    DECODE_POSITIONS_PER_GROWTH), since grow() holds the old buffer beside the new one and
    keep() gathers the rows it moves into a temporary copy. The memory estimate counts it
    (engine/memory/estimate.py)."""
    step = DECODE_POSITIONS_PER_GROWTH
    final = max_tokens if max_tokens <= step else step * math.ceil(max_tokens / step)
    return 2 * final


def default_block_steps(device: torch.device) -> int:
    """Decode passes per block on `device` (see DECODE_BLOCK_STEPS)."""
    return CPU_BLOCK_STEPS if device.type == "cpu" else DECODE_BLOCK_STEPS


# ---------------------------------------------------------------- the decode loop


def generate(
    gm: GeneratorModel,
    requests: list[GenerationRequest],
    *,
    versions: Mapping[str, WeightsVersion],
    between_tokens: Callable[[], None] | None = None,
    block_steps: int | None = None,
    admit: Callable[[], list[GenerationRequest]] | None = None,
    finished: Callable[[int, SampleResult], None] | None = None,
) -> list[SampleResult]:
    """Sample every request; results align with `requests`, then the admitted ones in order.

    `versions` maps each adapter key to what it serves now and is read again after every
    `between_tokens()` call, which may publish new weights (PIPELINE weights-sync).
    `block_steps`: decode passes per host read (None: default_block_steps of the device).
    `admit`: called at every block boundary (after `between_tokens`); the requests it returns
    are prefilled and their rows join the running decode batch (joins.py).
    `finished(index, result)`: called at the block end where a request's last row ended (index
    into the returned list), so its operation can complete while the generation runs on."""

    def report() -> None:
        for index, result in decoding.take_finished():
            if finished is not None:
                finished(index, result)

    with torch.no_grad():
        decoding = Decoding(gm, requests, versions, block_steps)
        report()
        while decoding.running:
            if between_tokens is not None:
                served = {key: v.generation for key, v in versions.items()}
                between_tokens()
                changed = served != {key: v.generation for key, v in versions.items()}
                decoding.weights_published(changed)
            if admit is not None and (joining := admit()):
                decoding.admit(joining)
                report()
            decoding.block()
            report()
        return decoding.results()


class Decoding:
    """A generation one decode block at a time: started with requests, `admit` adds requests
    between blocks (their rows join the running batch), `block` runs one block, and
    `take_finished` hands over the requests completed since it was last asked. `generate`
    drives it with callbacks; a caller that interleaves other work between blocks (another
    session's training step, a process host answering step by step) drives it directly.
    Every method runs under torch.no_grad with the generator's attention installed."""

    def __init__(
        self,
        gm: GeneratorModel,
        requests: list[GenerationRequest],
        versions: Mapping[str, WeightsVersion],
        block_steps: int | None = None,
    ) -> None:
        attention.install(gm.model)
        self.gm = gm
        self.versions = versions
        self.device = gm.embedding.device
        self.generation = Generation()
        self.steps_per_block = (
            block_steps if block_steps is not None else default_block_steps(self.device)
        )
        self.static = use_static_passes(gm, self.device)
        self._finished: list[tuple[int, SampleResult]] = []
        self.batch: LiveRows | None = None
        self.cache: FanoutKVCache | None = None
        # Own positions of every batch position, known on the host: each pass adds one to
        # every row (a weights update recomputes them to the same count), a joining row starts
        # at 0. While all are equal (no join, or the joined rows caught up by the others
        # leaving), passes take the `uniform` fast path and nothing is read back.
        self.own_lengths: list[int] = []
        # Batch positions of the rows still running; with static passes, finished rows may
        # stay in the batch as padding (padding_joins.keeps_layout).
        self.running: list[int] = []
        self.step: DecodeStep | None = None  # the static pass of the current layout
        # Rows the decode cache of a new batch is allocated for (its own and prompt parts): a
        # sample stream's pool, so rows joining later take free rows and the running rows'
        # KV is never copied for them (joins.pooled_prefixes). 0: the batch's rows exactly.
        # With a pool, static layouts hold placeholder rows for joins (padding_joins.py).
        self.pool_rows = 0
        # Requests admitted whose prompts run inside the next decode pass (joining_pass.py).
        self._joining: Joining | None = None
        self._prefills = PrefillSteps(_use_graphs(self.device))  # joins' beside static passes
        self.admit(requests)

    def close(self) -> None:
        """Drop the decode state (rows, decode cache and its pool, the static pass): a
        sample stream's pass ended. An `admit` after it starts a new batch."""
        self.batch = self.cache = self.step = self._joining = None
        self.running, self.own_lengths = [], []
        self._prefills.clear()  # weights may be published before the next pass

    def joining(self) -> tuple[int, int]:
        """(rows, prompts) admitted whose prompts run in the next block's first pass."""
        if self._joining is None:
            return 0, 0
        return len(self._joining.row_ids), len(self._joining.group_ids)

    def padding(self) -> tuple[int, int]:
        """(rows, prompt rows) of the decode cache that no running row uses: a static
        layout's finished rows and placeholders, which a join takes (padding_joins.py) or,
        appending, frees first (_start), so they are as free as the pool's free rows."""
        if self.batch is None or self.cache is None:
            return 0, 0
        rows = self.generation.rows
        read = {rows[self.batch.live[b]].group for b in self.running}
        return len(self.batch.live) - len(self.running), self.cache.prefix.num_rows - len(read)

    def take_finished(self) -> list[tuple[int, SampleResult]]:
        """(index, result) of the requests completed since the last call."""
        done, self._finished = self._finished, []
        return done

    def results(self) -> list[SampleResult]:
        """Every request's result, in arrival order (all must have finished)."""
        return self.generation.results()

    def _settle(self, row_ids: list[int]) -> None:
        for r in self.generation.settle(row_ids):
            self._finished.append((r, self.generation.result(r)))

    def admit(self, requests: list[GenerationRequest]) -> None:
        """Requests joining between blocks: planned, prefilled and drawn their first token;
        their live rows join the batch and the cache (a new batch when none runs). Beside a
        running dynamic batch the prefill rides in the next block's first pass, the rows join
        for its other passes, and admits before it share it (joining_pass.py); beside a
        static one it runs now through a reused step (prefill_graph.py), and the rows take
        padding rows where they fit (padding_joins.py); else now (joins.start_rows)."""
        if not requests:
            return
        with torch.no_grad():
            gm, generation = self.gm, self.generation
            group_ids, row_ids = generation.add(gm, requests, self.versions)
            if self._joining is not None:  # an earlier admit's, waiting for the next pass
                group_ids = self._joining.group_ids + group_ids
                row_ids = self._joining.row_ids + row_ids
                self._joining = None
                generation.renew(group_ids, row_ids, self.versions)  # a publish since?
            dynamic = None if self.static or not self.running else self.batch
            if joins_in_pass(gm, generation, group_ids, dynamic):
                self._joining = Joining(group_ids, row_ids)
                return
            if self.static and self.running:  # beside static passes: steps, one per adapter
                for groups, rows in by_adapter(generation, group_ids, row_ids):
                    self._start(
                        groups, rows, *self._prefills.start_rows(gm, generation, groups, rows)
                    )
                return
            self._start(group_ids, row_ids, *start_rows(gm, generation, group_ids, row_ids))

    def _start(
        self, group_ids: list[int], row_ids: list[int], prefill_cache: KVCache, fresh: LiveRows
    ) -> None:
        """Rows `row_ids` drew their first token (`fresh` the live ones, groups `group_ids`
        prefilled in rows of `prefill_cache`): they start a batch, or join the running one."""
        gm, generation = self.gm, self.generation
        self._settle(row_ids)
        if not fresh.live:
            return
        rows = generation.rows
        if not self.running:
            longest = max(rows[r].max_tokens for r in fresh.live)
            capacity = min(longest, DECODE_POSITIONS_PER_GROWTH)
            own = new_cache(gm, len(fresh.live), capacity, self.pool_rows)
            if self.pool_rows:
                prefill_cache = pooled_prefixes(gm, prefill_cache, self.pool_rows)
            groups_B = [rows[r].group for r in fresh.live]
            self.cache = FanoutKVCache(prefill_cache, group_ids, own, groups_B)
            # Frees the prompts whose every sample already ended on its first token.
            self.cache.keep(torch.arange(len(fresh.live), device=self.device))
            self.batch, self.own_lengths = fresh, [0] * len(fresh.live)
            self.running = list(range(len(fresh.live)))
            self.step = None
            return
        assert self.batch is not None and self.cache is not None
        if self.step is not None and (
            placed := join_into_padding(
                generation,
                self.batch,
                self.cache,
                self.step,
                self.running,
                group_ids,
                prefill_cache,
                fresh,
            )
        ):  # static passes: the rows took padding rows of the layout, whose pass stays
            for b in placed[1]:
                self.own_lengths[b] = 0
            self.running = sorted({*self.running, *placed[0]})
            return
        if len(self.running) < len(self.batch.live):  # static padding: made again anyway
            self._keep_running()
        live_groups = sorted({rows[r].group for r in fresh.live})
        cache_row = {g: i for i, g in enumerate(group_ids)}
        self.cache.join(
            prefill_cache,
            [cache_row[g] for g in live_groups],
            live_groups,
            [rows[r].group for r in fresh.live],
        )
        start = len(self.batch.live)
        self.batch.join(fresh)
        self.own_lengths += [0] * len(fresh.live)
        self.running += range(start, len(self.batch.live))
        self.step = None

    def weights_published(self, served_changed: bool) -> None:
        """After a possible publish (PIPELINE weights-sync): running rows whose adapter's
        weights changed continue on the new ones (joins.switch_weights). `served_changed`:
        whether any adapter's weights changed, even of rows no longer running: a captured
        pass may hold the addresses of the weights they replaced, so it is made again."""
        assert self.batch is not None and self.cache is not None
        with torch.no_grad():
            gm, batch, cache = self.gm, self.batch, self.cache
            if served_changed:
                self._prefills.clear()
            if switch_weights(gm, batch, cache, self.generation, self.versions) or served_changed:
                self.step = None

    def block(self) -> None:
        """One decode block of every running row; requests completed by it go to
        take_finished."""
        assert self.running and self.batch is not None and self.cache is not None
        with torch.no_grad():
            self._block(self.gm, self.batch, self.cache)

    def _block(self, gm: GeneratorModel, batch: LiveRows, cache: FanoutKVCache) -> None:
        rows, running = self.generation.rows, self.running
        # No row runs past the longest max_tokens still wanted: the last block is shortened.
        steps = min(
            self.steps_per_block,
            max(rows[batch.live[i]].max_tokens - len(rows[batch.live[i]].tokens) for i in running),
        )
        if self.step is not None:
            rewind_padding(self.step, self.own_lengths, running, steps)
        longest = max(self.own_lengths)
        if longest + steps > cache.capacity:
            cache.grow(max(cache.capacity + DECODE_POSITIONS_PER_GROWTH, longest + steps))
            self.step = None
        routes_K: list[Tensor] | None = [] if batch.wants_routes else None
        joining, self._joining = self._joining, None  # never beside static passes
        if joining is not None:  # the block's first pass prefills them too
            longest = self._join_in_first_pass(joining, batch, cache, longest)
            steps -= 1
        if self.static:
            if self.step is None:
                if self.pool_rows:  # a stream's: rows for joins to take (padding_joins.py)
                    added = add_placeholders(self.generation, batch, cache, running)
                    self.own_lengths += [0] * added
                graphs = _use_graphs(self.device)
                static_cache = StaticDecodeCache(cache, self.own_lengths)
                self.step = DecodeStep(gm, static_cache, batch, graphs)
            tokens_KB, logprobs_KB = self.step.block(batch, steps)
        else:
            ragged = len(set(self.own_lengths)) > 1  # rows joined: per-row own masks
            tokens_KB, logprobs_KB = dynamic_block(
                gm, batch, cache, steps, longest, ragged, routes_K
            )
        self.own_lengths = [length + steps for length in self.own_lengths]
        if tokens_KB:
            tokens, logprobs = batch.to_host(torch.stack(tokens_KB), torch.stack(logprobs_KB))
            record_steps(gm, batch, tokens, logprobs, routes_K)
        self.running = [i for i, r in enumerate(batch.live) if rows[r].stop_reason is None]
        self._settle(batch.live)
        still = len(self.running)
        if 0 < still < len(batch.live) and not (
            self.static and keeps_layout(still, len(batch.live), stream=bool(self.pool_rows))
        ):
            self._keep_running()

    def _keep_running(self) -> None:
        """The running rows stay, in as few row moves as may be; finished rows (and a
        stream's placeholders, padding_joins.py) leave. A new layout follows."""
        assert self.batch is not None and self.cache is not None
        order = fill_holes(self.running)
        self.cache.keep(torch.tensor(order, dtype=torch.int64, device=self.device))
        self.batch.keep(order)
        self.own_lengths = [self.own_lengths[i] for i in order]
        self.running = list(range(len(order)))
        self.step = None

    def _join_in_first_pass(
        self, joining: Joining, batch: LiveRows, cache: FanoutKVCache, longest: int
    ) -> int:
        """The block's first pass, which also prefills the joining prompts (joining_pass.py):
        the running rows' tokens are recorded now (a row that stopped rides along until the
        block ends, as within any block) and the joining rows join for the block's other
        passes (it keeps the length it was given). Returns the longest own part after it."""
        ragged = len(set(self.own_lengths)) > 1
        token_B, logprob_B, prompts, fresh = decode_and_prefill(
            self.gm, batch, cache, longest, ragged, self.generation, joining, self.versions
        )
        tokens, logprobs = batch.to_host(token_B[None], logprob_B[None])
        record_steps(self.gm, batch, tokens, logprobs)
        self.own_lengths = [length + 1 for length in self.own_lengths]
        self._start(joining.group_ids, joining.row_ids, prompts, fresh)
        return max(self.own_lengths)


def use_static_passes(gm: GeneratorModel, device: torch.device) -> bool:
    """Static-shape decode passes (decode_graph.py) for this model on this device."""
    wanted = CPU_STATIC_DECODE if device.type == "cpu" else (STATIC_DECODE or gm.cuda_graphs)
    return wanted and static_passes_supported(gm)


def _use_graphs(device: torch.device) -> bool:
    return device.type == "cuda" and CUDA_GRAPHS


def dynamic_block(
    gm: GeneratorModel,
    batch: LiveRows,
    cache: FanoutKVCache,
    steps: int,
    own_positions: int,
    ragged: bool,
    routes_K: list[Tensor] | None,
) -> tuple[list[Tensor], list[Tensor]]:
    """`steps` decode passes of every row of the batch, shapes following the rows: each runs
    the live rows through the FanoutKVCache at the own length they reached, so it reads only
    the columns in use and finished rows have already left (the static-shape counterpart,
    whose pass a CUDA graph can replay, is decode_graph.py). Each step's tokens and logprobs
    [B] stay on the device (routes appended to routes_K). `own_positions`: what every row
    holds, or with `ragged` (rows that joined) the longest."""
    tokens_KB: list[Tensor] = []
    logprobs_KB: list[Tensor] = []
    for k in range(steps):
        assert batch.last_tokens_B is not None
        routes_out: list[Tensor] | None = [] if routes_K is not None else None
        hidden_B1H = forward_rows(
            gm,
            cache,
            batch.last_tokens_B[:, None],
            batch.ones_B,
            batch.keys,
            routes_out,
            uniform=(1, own_positions + k + 1),
            ragged=ragged,
        )
        if routes_K is not None:
            assert routes_out is not None
            routes_K.append(routes_out[0])
        tokens_B, logprobs_B = draw(batch, head_logits(gm, hidden_B1H[:, -1], batch.keys))
        tokens_KB.append(tokens_B)
        logprobs_KB.append(logprobs_B)
    return tokens_KB, logprobs_KB
