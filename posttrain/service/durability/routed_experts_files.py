"""The routed-experts store's files: the keys one sample operation made, with their routes,
in one file (`<batch>.routes`), so that a key reported in a COMPLETED sample survives a crash
and a restart until its TTL, like the operation's record (service/durability/routed_experts.py).

A file is a JSON header line (session, wall-clock expiry, each key's shape and byte range)
followed by the routes' bytes; it is written under a temporary name, fsynced and renamed, and
the directory fsynced, so a crash leaves the whole batch or none of it. One file per operation
keeps the cost at one fsync per sample operation, not one per sequence.

Imports: types.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, cast

from posttrain.types import ExpertRoutes

log = logging.getLogger("posttrain.routed_experts")

SUFFIX = ".routes"


@dataclass(frozen=True)
class Batch:
    name: str  # the file's stem, unique per batch
    session_id: str
    expires_at: float  # wall-clock seconds
    routes: dict[str, ExpertRoutes]  # key -> routes, in the order they were made


class _KeyEntry(TypedDict):
    """One key in a file's header: its routes' shape and where their bytes lie in the body."""

    key: str
    shape: list[int]  # [num_tokens, num_layers, top_k]
    offset: int
    length: int


class _Header(TypedDict):
    session_id: str
    expires_at: float
    keys: list[_KeyEntry]


def write(directory: Path, batch: Batch) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    keys: list[_KeyEntry] = []
    offset = 0
    for key, routes in batch.routes.items():
        shape = [routes.num_tokens, routes.num_layers, routes.top_k]
        keys.append({"key": key, "shape": shape, "offset": offset, "length": len(routes.data)})
        offset += len(routes.data)
    header: _Header = {"session_id": batch.session_id, "expires_at": batch.expires_at, "keys": keys}
    temporary = directory / f"{batch.name}{SUFFIX}.tmp"
    with temporary.open("wb") as out:
        out.write(json.dumps(header).encode() + b"\n")
        for routes in batch.routes.values():
            out.write(routes.data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, directory / f"{batch.name}{SUFFIX}")
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read_all(directory: Path) -> list[Batch]:
    """Every batch on disk, oldest first; a temporary file (a crash mid-write) or an unreadable
    one is removed, since no COMPLETED record can name its keys."""
    if not directory.is_dir():
        return []
    batches = []
    for path in sorted(directory.iterdir(), key=lambda p: p.stat().st_mtime_ns):
        if path.suffix != SUFFIX:
            path.unlink(missing_ok=True)
            continue
        try:
            batches.append(_read(path))
        except (OSError, ValueError, KeyError) as exc:
            log.warning("dropping unreadable routed-experts file %s: %s", path.name, exc)
            path.unlink(missing_ok=True)
    return batches


def remove(directory: Path, name: str) -> None:
    (directory / f"{name}{SUFFIX}").unlink(missing_ok=True)


def _read(path: Path) -> Batch:
    raw = path.read_bytes()
    newline = raw.index(b"\n")
    # A header that is not this shape raises KeyError or ValueError below: read_all drops the file.
    header = cast(_Header, json.loads(raw[:newline]))
    body = raw[newline + 1 :]
    routes: dict[str, ExpertRoutes] = {}
    for entry in header["keys"]:
        start, length = entry["offset"], entry["length"]
        data = body[start : start + length]
        if len(data) != length:
            raise ValueError(f"key {entry['key']!r} is cut short")
        num_tokens, num_layers, top_k = entry["shape"]
        routes[entry["key"]] = ExpertRoutes(num_tokens, num_layers, top_k, data)
    return Batch(path.stem, header["session_id"], float(header["expires_at"]), routes)
