"""The routed-experts store: routes the sampler recorded, kept under opaque keys per session.

A sample operation with `return_routed_experts` on an MoE model returns one `routed_experts_key`
per sequence (api.md 1.4.6); a training sample naming that key replays those routes
(model/routing.py). A key belongs to the session that sampled it, and lives until its TTL
passes or the store needs its memory for newer routes (least recently used first); after that
it is unknown, and a sample naming it is refused with INVALID_INPUT (api.md 1.7.2). Routes are
small (2 bytes per token, MoE layer and expert slot) and live in memory only: a restart
forgets them, as it would a sampler's cache.

Imports: errors, types.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

from posttrain.errors import InvalidRequest
from posttrain.types import ExpertRoutes, SampleResult, TrainingSample


@dataclass(frozen=True)
class _Entry:
    session_id: str
    routes: ExpertRoutes
    expires_at: float


class RoutedExpertsStore:
    """Thread-safe; `clock` is injectable so expiry is testable without waiting."""

    def __init__(
        self, *, ttl_s: float, budget_bytes: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self.budget_bytes = budget_bytes
        self.clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, session_id: str, routes: ExpertRoutes) -> str:
        """Keep `routes` for `session_id`; returns the new key."""
        key = "re_" + secrets.token_urlsafe(16)
        with self._lock:
            self._entries[key] = _Entry(session_id, routes, self.clock() + self.ttl_s)
            self._bytes += len(routes.data)
            self._evict()
        return key

    def get(self, session_id: str, key: str, param: str) -> ExpertRoutes:
        """The routes under `key`, if the key is alive and the session's; else InvalidRequest
        naming `param`. A hit renews the key's place in the LRU order, not its TTL."""
        with self._lock:
            self._expire()
            entry = self._entries.get(key)
            if entry is None or entry.session_id != session_id:
                raise InvalidRequest(
                    f"routed_experts_key {key!r} is unknown or expired (keys live"
                    f" {self.ttl_s:g} s and only as long as the store's memory budget allows)",
                    param=param,
                )
            self._entries.move_to_end(key)
            return entry.routes

    def keyed(self, session_id: str, results: list[SampleResult]) -> tuple[SampleResult, ...]:
        """A sample operation's results as it is recorded and answered: each sequence's
        routes kept here, and the sequence carrying their key instead."""
        out = []
        for result in results:
            sequences = []
            for sequence in result.sequences:
                if sequence.routed_experts is not None:
                    key = self.put(session_id, sequence.routed_experts)
                    sequence = replace(sequence, routed_experts=None, routed_experts_key=key)
                sequences.append(sequence)
            out.append(replace(result, sequences=sequences))
        return tuple(out)

    def resolved(
        self, session_id: str, samples: tuple[TrainingSample, ...]
    ) -> tuple[TrainingSample, ...]:
        """Training samples with each routed_experts_key replaced by the routes it names;
        InvalidRequest naming the sample's field for a key that is unknown, expired or
        another session's."""
        out = []
        for index, sample in enumerate(samples):
            if sample.routed_experts_key is not None:
                param = f"samples[{index}].routed_experts_key"
                routes = self.get(session_id, sample.routed_experts_key, param)
                sample = replace(sample, routed_experts=routes)
            out.append(sample)
        return tuple(out)

    def drop_session(self, session_id: str) -> None:
        """A session that ended has no routes to replay."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.session_id == session_id]:
                self._bytes -= len(self._entries.pop(key).routes.data)

    def size_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, e in self._entries.items() if e.expires_at <= now]:
            self._bytes -= len(self._entries.pop(key).routes.data)

    def _evict(self) -> None:
        self._expire()
        while self._bytes > self.budget_bytes and self._entries:
            _, entry = self._entries.popitem(last=False)
            self._bytes -= len(entry.routes.data)
