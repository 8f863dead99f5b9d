"""The routed-experts store: routes the sampler recorded, kept under opaque keys per session.

A sample operation with `return_routed_experts` on an MoE model returns one `routed_experts_key`
per sequence (api.md 1.4.6); a training sample naming that key replays those routes
(model/routing.py). A key belongs to the session that sampled it, and lives until its TTL
passes or the store needs its memory for newer routes (least recently used first); after that
it is unknown, and a sample naming it is refused with INVALID_INPUT (api.md 1.7.2). Routes are
small (2 bytes per token, MoE layer and expert slot).

With a `directory` (the server's: data_dir/routed_experts) the keys are durable: a sample
operation's routes are on disk before it is recorded COMPLETED (the scheduler calls `keyed`
first), and a restarted store serves every key still within its TTL and budget, so a loop that
sampled before a crash trains on its routes after it (service/durability/routed_experts_files.py).
Expiry is on the wall clock for that reason: a key outlives the process that made it.

Imports: errors, types, service (routed_experts_files).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from posttrain.errors import InvalidRequest
from posttrain.service.durability import routed_experts_files as files
from posttrain.types import ExpertRoutes, SampleResult, TrainingSample


@dataclass(frozen=True)
class _Entry:
    session_id: str
    routes: ExpertRoutes
    expires_at: float
    batch: str  # the file (or, without a directory, the put) the key was made in


class RoutedExpertsStore:
    """Thread-safe; `clock` is injectable so expiry is testable without waiting."""

    def __init__(
        self,
        *,
        ttl_s: float,
        budget_bytes: int,
        clock: Callable[[], float] = time.time,
        directory: Path | None = None,
    ) -> None:
        self.ttl_s = ttl_s
        self.budget_bytes = budget_bytes
        self.clock = clock
        self.directory = directory
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._live = Counter[str]()  # batch -> its keys still held; at 0 its file goes
        self._bytes = 0
        self._lock = threading.Lock()
        if directory is not None:
            with self._lock:
                for batch in files.read_all(directory):
                    self._add(batch)
                self._evict()

    def put(self, session_id: str, routes: ExpertRoutes) -> str:
        """Keep `routes` for `session_id`; returns the new key."""
        return self.put_many(session_id, [routes])[0]

    def put_many(self, session_id: str, many: list[ExpertRoutes]) -> list[str]:
        """Keep each of `many` for `session_id` (on disk first, where durable, in one file);
        returns their new keys, in order."""
        keys = ["re_" + secrets.token_urlsafe(16) for _ in many]
        batch = files.Batch(
            "b_" + secrets.token_hex(8),
            session_id,
            self.clock() + self.ttl_s,
            dict(zip(keys, many, strict=True)),
        )
        if self.directory is not None and keys:
            files.write(self.directory, batch)
        with self._lock:
            self._add(batch)
            self._evict()
        return keys

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
        recorded = [s.routed_experts for r in results for s in r.sequences if s.routed_experts]
        keys = iter(self.put_many(session_id, recorded))
        out = []
        for result in results:
            sequences = []
            for sequence in result.sequences:
                if sequence.routed_experts is not None:
                    sequence = replace(sequence, routed_experts=None, routed_experts_key=next(keys))
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
                self._drop(key)

    def size_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def _add(self, batch: files.Batch) -> None:
        for key, routes in batch.routes.items():
            self._entries[key] = _Entry(batch.session_id, routes, batch.expires_at, batch.name)
            self._bytes += len(routes.data)
            self._live[batch.name] += 1

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._bytes -= len(entry.routes.data)
        self._live[entry.batch] -= 1
        if self._live[entry.batch] == 0:
            del self._live[entry.batch]
            if self.directory is not None:
                files.remove(self.directory, entry.batch)

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, e in self._entries.items() if e.expires_at <= now]:
            self._drop(key)

    def _evict(self) -> None:
        self._expire()
        while self._bytes > self.budget_bytes and self._entries:
            self._drop(next(iter(self._entries)))
