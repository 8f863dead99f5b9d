"""Records of a second API dialect (the Tinker wire surface): its client sessions, training
runs, samplers, futures and checkpoint names, each a JSON object under (kind, id).

They live beside the resources, sessions and operations they point at, in the same SQLite file
and behind the same lock (Repo), so a restart finds them with the objects they name. The
service layer owns their shapes (service/tinker/records.py); the store only keys them.

Imports: store.repo.
"""

from __future__ import annotations

import json
from typing import Any

from posttrain.store.repo import Repo


class DialectObjects:
    """Keyed JSON objects of one dialect; thread-safe through the repo's lock."""

    def __init__(self, repo: Repo) -> None:
        self._repo = repo

    def put(
        self, kind: str, object_id: str, user: str, created_at: float, data: dict[str, Any]
    ) -> None:
        self._repo._execute(
            "INSERT OR REPLACE INTO dialect_objects (kind, id, created_by, created_at, data)"
            " VALUES (?, ?, ?, ?, ?)",
            (kind, object_id, user, created_at, json.dumps(data, separators=(",", ":"))),
        )

    def insert(
        self, kind: str, object_id: str, user: str, created_at: float, data: dict[str, Any]
    ) -> bool:
        """Add the object unless one with its key exists; True when this call added it (two
        retries of one request race here, and only one of them may run)."""
        with self._repo._lock:
            cursor = self._repo._db.execute(
                "INSERT OR IGNORE INTO dialect_objects (kind, id, created_by, created_at, data)"
                " VALUES (?, ?, ?, ?, ?)",
                (kind, object_id, user, created_at, json.dumps(data, separators=(",", ":"))),
            )
            return cursor.rowcount == 1

    def get(self, kind: str, object_id: str) -> tuple[str, dict[str, Any]] | None:
        """(owner, data) of an object, or None."""
        rows = self._repo._query(
            "SELECT created_by, data FROM dialect_objects WHERE kind = ? AND id = ?",
            (kind, object_id),
        )
        return (rows[0][0], json.loads(rows[0][1])) if rows else None

    def list(self, kind: str, user: str | None = None) -> list[dict[str, Any]]:
        """The objects of a kind (of one owner), oldest first."""
        if user is None:
            rows = self._repo._query(
                "SELECT data FROM dialect_objects WHERE kind = ? ORDER BY created_at, id", (kind,)
            )
        else:
            rows = self._repo._query(
                "SELECT data FROM dialect_objects WHERE kind = ? AND created_by = ?"
                " ORDER BY created_at, id",
                (kind, user),
            )
        return [json.loads(row[0]) for row in rows]

    def delete(self, kind: str, object_id: str) -> None:
        self._repo._execute(
            "DELETE FROM dialect_objects WHERE kind = ? AND id = ?", (kind, object_id)
        )
