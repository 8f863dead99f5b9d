"""Typed reads and writes of the dialect's records (records.py) over the store, with the one
ownership rule: an object another user owns reads as absent (404), as on the Together surface.

Imports: store.dialect, errors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from posttrain.errors import NotFound
from posttrain.service.tinker import records as r
from posttrain.service.tinker.records import R, Record
from posttrain.store.dialect import DialectObjects

_KINDS: dict[type, str] = {
    r.ClientRecord: r.CLIENT,
    r.RunRecord: r.RUN,
    r.SamplerRecord: r.SAMPLER,
    r.FutureRecord: r.FUTURE,
    r.NameRecord: r.NAME,
    r.ProvisionedRecord: r.PROVISIONED,
}
# Each function reads the key of its own class's records: a table keyed by class cannot say so.
_KEYS: dict[type, Callable[[Any], str]] = {
    r.ClientRecord: lambda x: x.id,
    r.RunRecord: lambda x: x.model_id,
    r.SamplerRecord: lambda x: x.id,
    r.FutureRecord: lambda x: x.id,
    r.NameRecord: lambda x: x.path,
    r.ProvisionedRecord: lambda x: x.id,
}
_NOUNS: dict[type, tuple[str, str]] = {
    r.ClientRecord: ("session", "session_id"),
    r.RunRecord: ("model", "model_id"),
    r.SamplerRecord: ("sampling session", "sampling_session_id"),
    r.FutureRecord: ("request", "request_id"),
    r.NameRecord: ("checkpoint", "path"),
    r.ProvisionedRecord: ("model resource", "model_resources_id"),
}


class Registry:
    def __init__(self, objects: DialectObjects) -> None:
        self.objects = objects

    def put(self, record: Record) -> None:
        cls = type(record)
        self.objects.put(
            _KINDS[cls], _KEYS[cls](record), record.user, record.created_at, r.as_dict(record)
        )

    def insert(self, record: Record) -> bool:
        cls = type(record)
        return self.objects.insert(
            _KINDS[cls], _KEYS[cls](record), record.user, record.created_at, r.as_dict(record)
        )

    def find(self, cls: type[R], key: str, user: str | None = None) -> R | None:
        found = self.objects.get(_KINDS[cls], key)
        if found is None or (user is not None and found[0] != user):
            return None
        return r.from_dict(cls, found[1])

    def get(self, cls: type[R], key: str, user: str) -> R:
        record = self.find(cls, key, user)
        if record is None:
            noun, param = _NOUNS[cls]
            raise NotFound(f"{noun} {key} not found", param=param)
        return record

    def all(self, cls: type[R], user: str | None = None) -> list[R]:
        return [r.from_dict(cls, data) for data in self.objects.list(_KINDS[cls], user)]

    def delete(self, cls: type[Record], key: str) -> None:
        self.objects.delete(_KINDS[cls], key)

    def seq_future(self, owner: str, seq_id: int | None) -> str | None:
        """The request id an earlier POST with this (run or sampler, seq_id) answered."""
        if seq_id is None:
            return None
        found = self.objects.get(r.SEQ, f"{owner}#{seq_id}")
        if found is None:
            return None
        future_id: str = found[1]["future"]
        return future_id

    def claim_seq(self, owner: str, seq_id: int | None, user: str, future_id: str) -> str:
        """Bind (owner, seq_id) to future_id unless a concurrent retry bound it first; the
        request id that owns the pair."""
        if seq_id is None:
            return future_id
        key = f"{owner}#{seq_id}"
        if self.objects.insert(r.SEQ, key, user, time.time(), {"future": future_id}):
            return future_id
        found = self.objects.get(r.SEQ, key)
        assert found is not None
        bound: str = found[1]["future"]
        return bound
