"""Sample operations decoded as a stream on one resource: operations join a running generation
between decode blocks and leave it, each as soon as its every sequence ended.

A SampleStream is a sampler.Decoding in terms of sample operations ((session, SampleRequest)
items, as generator.sample_batch takes them): `admit` turns an operation's prompts into
GenerationRequests routed to its session's generator, `block` runs one decode block, and
`take_finished` hands over the operations completed since (one result per prompt, as
sample_batch gives); `take_progress` the tokens the followed operations drew since (a streamed
reply shows them as they come). Its caller (the scheduler's sample pass,
service/scheduling/sample_streams.py, through SessionSampleStream: the engine's DecodeStream)
decides what joins when, and may run other work between blocks. A weights change published
between blocks (a PIPELINE publish, or another session's weights-sync) is picked up at the next
`admit` or `block`: running rows whose weights changed continue on the new ones
(sampler.Decoding.weights_published), as generate does after its `between_tokens`.

One generation runs on one model: a full-weight session samples its own model copy, so only
operations whose sessions sample the stream's model may join (`can_join`).

Memory: the stream sizes its own decode cache. At a start (`admit` with no row running) it is
a pool (own and prompt parts, sampler.Decoding.pool_rows) of up to the caller's row limit, as
many rows as POOL_SHARE of the memory spare beside the first operations holds (`pool_rows`): a
join within its free rows (and prompts no longer than its prompt width) appends there and
copies none of the running rows' KV; past it the cache reallocates with twice the rows
(KVCache.add_rows). `fits` tells the caller whether a join allocates no more than what is spare
beside its own estimate (nothing within the pool), so the caller's memory admission never
needs the pool's sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

from transformers import PreTrainedModel

from posttrain.config import EngineConfig
from posttrain.engine.generate.decode_rows import max_tokens_of
from posttrain.engine.generate.generator import generator_model, sampling_model, served
from posttrain.engine.generate.joins import PREFIX_POOL_POSITIONS, GenerationRequest
from posttrain.engine.generate.sampler import Decoding, peak_own_positions
from posttrain.engine.state import ResourceState, SessionState
from posttrain.types import SampleRequest, SampleResult

# Of the memory free beside a stream's first operations, the share its pool may take: the rest
# stays for what runs between its blocks (other sessions' training) and the joins' own passes.
POOL_SHARE = 0.5


def pool_rows(limit: int, rows: int, free_bytes: int, row_bytes: int) -> int:
    """Rows a sample stream's decode cache is allocated for at its start (its pool: joins within
    it copy none of the running rows' KV): the stream's row `limit`, fewer where POOL_SHARE of
    what is free beside the first operations' estimate (`free_bytes`) holds fewer rows of
    `row_bytes` each beyond their own `rows`; never fewer than those. Joins past the pool still
    run, at the cost of a copy their admission counts (JoinRoom.reserve_bytes)."""
    if row_bytes <= 0:
        return max(rows, limit)
    spare = int(max(0, free_bytes) * POOL_SHARE) // row_bytes
    return max(rows, min(limit, rows + spare))


def pool_row_bytes(kv_per_position: int, prompt_positions: int, max_tokens: int) -> int:
    """What one row of a stream's pool (sampler.Decoding.pool_rows: its decode cache allocated
    at the start for the rows that may join) may hold: a prompt row of `prompt_positions`
    rounded up to the pool's prompt width (joins.pooled_prefixes), and the generated part of
    `max_tokens` new tokens, grown in steps and counted twice as any sample's
    (sampler.peak_own_positions)."""
    step = PREFIX_POOL_POSITIONS
    prompt = step * math.ceil(prompt_positions / step)
    return kv_per_position * (prompt + peak_own_positions(max_tokens))


@dataclass(frozen=True)
class JoinRoom:
    """The running stream's decode cache as a join finds it, between two steps (only `admit`
    and `block` change it): a stream in another process sends it with each step's answer, so
    its caller weighs each candidate join without a round trip (hosts/remote_streams.py)."""

    running: bool = False  # not running: the next admit starts a fresh pool
    own_free_rows: int = 0
    prefix_free_rows: int = 0
    prefix_capacity: int = 0  # the longest prompt a pool's prompt row holds
    kv_bytes: int = 0  # what the cache holds now
    pool_rows: int = 0
    pool_tokens: int = 0  # the longest max_tokens the pool's rows were admitted for
    kv_per_position: int = 0

    def reserve_bytes(self, requests: list[SampleRequest]) -> int:
        """What `requests` joining now may allocate beyond their own estimate: nothing within
        the pool's free rows; past them a cache of twice the rows beside the old one (up to
        twice what it holds now, transiently); and where they decode longer than the pool's
        rows were admitted for, the pool's growth to that length."""
        if not self.running:
            return 0  # a new start: a fresh pool
        rows = sum(len(request.prompts) * request.num_samples for request in requests)
        prompts = [len(p) for request in requests for p in request.prompts]
        fits = (
            rows <= self.own_free_rows
            and len(prompts) <= self.prefix_free_rows
            and max(prompts, default=0) <= self.prefix_capacity
        )
        copy = 0 if fits else 2 * self.kv_bytes
        tokens = max((max_tokens_of(request.sampling_params) for request in requests), default=0)
        longer = 0
        if self.pool_rows and tokens > self.pool_tokens:
            per_position = self.kv_per_position
            longer = self.pool_rows * (
                pool_row_bytes(per_position, 0, tokens)
                - pool_row_bytes(per_position, 0, self.pool_tokens)
            )
        return copy + longer


class SampleStream:
    """Sample operations of one resource sharing decode passes as they come and go."""

    def __init__(
        self,
        config: EngineConfig,
        resource: ResourceState,
        model: PreTrainedModel,
        *,
        block_steps: int | None = None,
    ) -> None:
        """An idle stream sampling `model` (generator.sampling_model of its sessions)."""
        self.resource = resource
        self.model = model
        self.decoding = Decoding(
            generator_model(config, resource, model), [], resource.served, block_steps
        )
        self._item_of_request: list[int] = []
        self._results: list[list[SampleResult | None]] = []  # per item, per prompt
        self._open: list[int] = []  # per item, prompts not finished
        self._first_request: list[int] = []  # per item, its first request's index
        self._num_prompts: list[int] = []  # per item
        self._followed: set[int] = set()  # items whose progress take_progress reports
        self._reported: dict[int, list[int]] = {}  # per followed item, tokens reported per row
        self._served = self._generations()  # what the running rows were decoded with
        self._pool_tokens = 0  # the longest max_tokens the pool's rows were admitted for

    def _generations(self) -> dict[str, int]:
        return {key: version.generation for key, version in self.resource.served.items()}

    def _catch_up(self) -> None:
        """Running rows continue on weights published since the last block (PIPELINE). A
        session served for the first time (its first operation joining) changes no weights a
        running row or a captured pass reads: the layout and the prefill steps stay."""
        served = self._generations()
        changed = any(served.get(key) != generation for key, generation in self._served.items())
        if changed and self.running:
            self.decoding.weights_published(True)
        self._served = served

    def running_rows(self) -> int:
        """Rows decoding, and rows admitted that join in the next block (joining_pass.py)."""
        return len(self.decoding.running) + self.decoding.joining()[0]

    def kv_bytes(self) -> int:
        """Bytes the decode cache holds now (prompts' and generated KV)."""
        cache = self.decoding.cache
        if cache is None or not self.running:
            return 0
        return sum(part.kv.nbytes + part.recurrent_bytes() for part in (cache.own, cache.prefix))

    @property
    def running(self) -> bool:
        return bool(self.decoding.running)

    def reserve_rows(self, rows: int) -> None:
        """The decode cache of the next start (no row running) is a pool of `rows` rows."""
        self.decoding.pool_rows = rows

    def _kv_per_position(self) -> int:
        kv, weight = self.decoding.gm.kv, self.decoding.gm.embedding
        return kv.num_layers * 2 * kv.num_kv_heads * kv.head_dim * weight.element_size()

    def pool_row_bytes(self, items: list[tuple[SessionState, SampleRequest]]) -> int:
        """Bytes one pool row may hold when the stream starts with `items`."""
        longest = max(len(p) for _, request in items for p in request.prompts)
        tokens = max(max_tokens_of(request.sampling_params) for _, request in items)
        # A hybrid's pool row holds a recurrent state in its prompt row and its own row.
        recurrent = self.decoding.gm.kv.recurrent
        element = self.decoding.gm.embedding.element_size()
        states = 0 if recurrent is None else 2 * recurrent.bytes_per_row(element)
        return pool_row_bytes(self._kv_per_position(), longest, tokens) + states

    def join_reserve_bytes(self, items: list[tuple[SessionState, SampleRequest]]) -> int:
        return self.room().reserve_bytes([request for _, request in items])

    def fits(self, items: list[tuple[SessionState, SampleRequest]], spare_bytes: int) -> bool:
        """Whether `items` joining now allocate at most `spare_bytes` beyond their own
        estimate (JoinRoom.reserve_bytes)."""
        return self.join_reserve_bytes(items) <= spare_bytes

    def room(self) -> JoinRoom:
        """What a join finds now (JoinRoom)."""
        cache = self.decoding.cache
        if cache is None or not self.running:
            return JoinRoom()
        rows, prompts = self.decoding.joining()  # admitted, not in the cache until the block
        padding_rows, padding_prompts = self.decoding.padding()  # joins take or free them
        return JoinRoom(
            running=True,
            own_free_rows=max(0, cache.own.free_rows + padding_rows - rows),
            prefix_free_rows=max(0, cache.prefix.free_rows + padding_prompts - prompts),
            prefix_capacity=cache.prefix.capacity,
            kv_bytes=self.kv_bytes(),
            pool_rows=self.decoding.pool_rows,
            pool_tokens=self._pool_tokens,
            kv_per_position=self._kv_per_position(),
        )

    def can_join(self, session: SessionState) -> bool:
        return sampling_model(self.resource, session) is self.model

    def admit(
        self,
        items: list[tuple[SessionState, SampleRequest]],
        *,
        row_limit: int = 0,
        spare_bytes: int = 0,
    ) -> list[int]:
        """Operations joining at this block boundary; returns their ids in this stream (in
        order from 0, as take_finished names them). At a start (no row running) with a
        `row_limit`, the decode cache is a pool of up to that many rows, as many as a share of
        `spare_bytes` (what is free beside the items' own estimate) holds (`pool_rows`)."""
        self._catch_up()
        if not self.running:
            self._pool_tokens = 0
            if row_limit:
                rows = sum(len(r.prompts) * r.num_samples for _, r in items)
                self.reserve_rows(
                    pool_rows(row_limit, rows, spare_bytes, self.pool_row_bytes(items))
                )
        ids, requests = [], []
        for session, request in items:
            self._pool_tokens = max(self._pool_tokens, max_tokens_of(request.sampling_params))
            assert self.can_join(session), "one generation runs on one model"
            served(self.resource, session)
            item = len(self._results)
            ids.append(item)
            self._results.append([None] * len(request.prompts))
            self._open.append(len(request.prompts))
            self._first_request.append(len(self._item_of_request))
            self._num_prompts.append(len(request.prompts))
            for index, prompt in enumerate(request.prompts):
                self._item_of_request.append(item)
                requests.append(
                    GenerationRequest(
                        prompt,
                        request.num_samples,
                        request.sampling_params,
                        session.generator_key,
                        prompt_logprobs=request.prompt_logprobs,
                        topk_prompt_logprobs=request.topk_prompt_logprobs,
                        return_routed_experts=request.return_routed_experts,
                        images=request.images_of(index),
                    )
                )
        self.decoding.admit(requests)
        # What the admitted rows were planned with, sessions served for the first time included:
        # a publish of theirs before the next block is a change (_catch_up), not a new key.
        self._served = self._generations()
        return ids

    def weights_published(self, served_changed: bool) -> None:
        """After a PIPELINE weights-sync between blocks (sampler.Decoding.weights_published)."""
        if self.running:
            self.decoding.weights_published(served_changed)
        self._served = self._generations()

    def block(self) -> None:
        """One decode block of every running sequence."""
        self._catch_up()
        self.decoding.block()

    def close(self) -> None:
        """The stream's pass ended: its decode cache (the pool) and rows are dropped now, not
        when the last reference goes (a process host keeps its streams by id)."""
        self.decoding.close()

    def take_finished(self) -> list[tuple[int, list[SampleResult]]]:
        """(id, one result per prompt) of the operations completed since the last call."""
        done = []
        for index, result in self.decoding.take_finished():
            item = self._item_of_request[index]
            self._results[item][index - self._first_request[item]] = result
            self._open[item] -= 1
            if self._open[item] == 0:
                results = self._results[item]
                assert all(r is not None for r in results)
                done.append((item, [r for r in results if r is not None]))
                self._results[item] = []  # handed over: the stream keeps no copy
                self._reported.pop(item, None)
        return done

    def follow(self, items: Collection[int]) -> None:
        """The items whose tokens take_progress reports from now on (DecodeStream.follow)."""
        self._followed = set(items)
        for item in list(self._reported):
            if item not in self._followed:
                del self._reported[item]

    def take_progress(self) -> list[tuple[int, list[list[int]]]]:
        """(item, per sequence the tokens drawn since the last report) of the followed items
        still running that drew any since; a newly followed item reports from its start."""
        progress = []
        generation = self.decoding.generation
        for item in sorted(self._followed):
            if item >= len(self._open) or self._open[item] == 0:
                continue  # unknown, or finished: its result carries every token
            first = self._first_request[item]
            rows = [
                row
                for r in range(first, first + self._num_prompts[item])
                for row in generation.rows_of(r)
            ]
            reported = self._reported.setdefault(item, [0] * len(rows))
            drawn = [row.tokens[n:] for row, n in zip(rows, reported, strict=True)]
            if any(drawn):
                self._reported[item] = [len(row.tokens) for row in rows]
                progress.append((item, drawn))
        return progress


class SessionSampleStream:
    """A SampleStream by session id: the DecodeStream (engine/interface.py) an in-process
    engine hands out; `session` finds a session's state on the stream's resource."""

    def __init__(self, stream: SampleStream, session: Callable[[str], SessionState]) -> None:
        self.stream = stream
        self.session = session  # a session's state by id, on the stream's resource

    def can_join(self, session_id: str) -> bool:
        return self.stream.can_join(self.session(session_id))

    def admit(
        self,
        items: list[tuple[str, SampleRequest]],
        fence: int = 0,
        *,
        row_limit: int = 0,
        spare_bytes: int = 0,
    ) -> list[int]:
        """`fence`: nothing is staged for an engine's own generators (a replica's stream
        applies its staged changes first: hosts/replicas/worker.py)."""
        return self.stream.admit(
            self._sessions(items), row_limit=row_limit, spare_bytes=spare_bytes
        )

    def fits(self, items: list[tuple[str, SampleRequest]], spare_bytes: int) -> bool:
        return self.stream.fits(self._sessions(items), spare_bytes)

    def block(
        self,
        most: int = 1,
        *,
        between: Callable[[], None] | None = None,
        woken: Callable[[], bool] = bool,
    ) -> None:
        """Up to `most` blocks (DecodeStream.block), `between` before each; they stop after
        one where a sequence ended (its operation may have finished) or `woken()` says a
        sample waits to join (a replica's, hosts/replicas/worker.py)."""
        for _ in range(most):
            if between is not None:
                between()
            rows = self.stream.running_rows()
            self.stream.block()
            if self.stream.running_rows() < rows or woken():
                return

    def take_finished(self) -> list[tuple[int, list[SampleResult]]]:
        return self.stream.take_finished()

    def follow(self, ids: Collection[int]) -> None:
        self.stream.follow(ids)

    def take_progress(self) -> list[tuple[int, list[list[int]]]]:
        return self.stream.take_progress()

    def running_rows(self) -> int:
        return self.stream.running_rows()

    def room(self) -> JoinRoom:
        return self.stream.room()

    def close(self) -> None:
        self.stream.close()

    def _sessions(
        self, items: list[tuple[str, SampleRequest]]
    ) -> list[tuple[SessionState, SampleRequest]]:
        return [(self.session(sid), request) for sid, request in items]


def open_stream(
    config: EngineConfig,
    resource: ResourceState,
    session: SessionState,
    lookup: Callable[[str], SessionState],
) -> SessionSampleStream:
    """An idle stream on the model `session` samples; `lookup` finds sessions by id."""
    return SessionSampleStream(
        SampleStream(config, resource, sampling_model(resource, session)), lookup
    )
