"""Typed reads and writes of the store. Rows convert to and from domain records here only.

Each table keeps the columns that queries filter on plus the whole record as JSON
(store/codec.py), so adding a record field needs no migration. An operation's output is stored
as the JSON object of its output dataclass (the wire's field names) and read back as the type
its kind has, so records written before outputs were typed read back unchanged. An unfinished
operation keeps its typed request beside it, for a restart to run it again.
Imports: types, store.codec.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
from collections.abc import Callable, Collection

from posttrain.records import CheckpointRecord, OperationRecord, ResourceRecord, SessionRecord
from posttrain.statuses import OPERATION_TERMINAL, OperationStatus
from posttrain.store.codec import (
    from_dict,
    operation_from_dict,
    request_from_json,
    request_to_json,
    to_json,
)
from posttrain.types import OperationKind, OperationRequest

__all__ = ["OperationDigest", "Repo", "to_json"]

# The values a query binds to its `?` placeholders.
SqlArgs = tuple[str | int | float | bytes | None, ...]


class Repo:
    """All store access. Thread-safe: one lock around the shared connection."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self._db = connection
        self._lock = threading.Lock()
        # Called with every operation record after it is written (held polls wake on it,
        # service/operations/completion.py); called outside the lock, so a listener may read the
        # store.
        self._operation_listeners: list[Callable[[OperationRecord], None]] = []

    def add_operation_listener(self, listener: Callable[[OperationRecord], None]) -> None:
        self._operation_listeners.append(listener)

    def _query(self, sql: str, args: SqlArgs = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _execute(self, sql: str, args: SqlArgs = ()) -> None:
        with self._lock:
            self._db.execute(sql, args)

    # ------------------------------------------------------------ resources

    def put_resource(self, r: ResourceRecord) -> None:
        self._execute(
            "INSERT OR REPLACE INTO resources (id, created_by, created_at, status, data)"
            " VALUES (?, ?, ?, ?, ?)",
            (r.id, r.created_by, r.created_at, r.status.value, to_json(r)),
        )

    def get_resource(self, resource_id: str) -> ResourceRecord | None:
        rows = self._query("SELECT data FROM resources WHERE id = ?", (resource_id,))
        return from_dict(ResourceRecord, json.loads(rows[0][0])) if rows else None

    def list_resources(self, created_by: str) -> list[ResourceRecord]:
        rows = self._query(
            "SELECT data FROM resources WHERE created_by = ? ORDER BY created_at DESC, id DESC",
            (created_by,),
        )
        return [from_dict(ResourceRecord, json.loads(row[0])) for row in rows]

    # ------------------------------------------------------------ sessions

    def put_session(self, s: SessionRecord) -> None:
        self._execute(
            "INSERT OR REPLACE INTO sessions"
            " (id, resource_id, created_by, created_at, status, data) VALUES (?, ?, ?, ?, ?, ?)",
            (s.id, s.resource_id, s.created_by, s.created_at, s.status.value, to_json(s)),
        )

    def update_session(
        self, session_id: str, change: Callable[[SessionRecord], SessionRecord]
    ) -> SessionRecord:
        """Read-modify-write one session atomically (the worker and handlers both write)."""
        with self._lock:
            rows = self._db.execute("SELECT data FROM sessions WHERE id = ?", (session_id,))
            current = from_dict(SessionRecord, json.loads(rows.fetchall()[0][0]))
            updated = change(current)
            self._db.execute(
                "UPDATE sessions SET status = ?, data = ? WHERE id = ?",
                (updated.status.value, to_json(updated), session_id),
            )
        return updated

    def update_resource(
        self, resource_id: str, change: Callable[[ResourceRecord], ResourceRecord]
    ) -> ResourceRecord:
        with self._lock:
            rows = self._db.execute("SELECT data FROM resources WHERE id = ?", (resource_id,))
            current = from_dict(ResourceRecord, json.loads(rows.fetchall()[0][0]))
            updated = change(current)
            self._db.execute(
                "UPDATE resources SET status = ?, data = ? WHERE id = ?",
                (updated.status.value, to_json(updated), resource_id),
            )
        return updated

    def get_session(self, session_id: str) -> SessionRecord | None:
        rows = self._query("SELECT data FROM sessions WHERE id = ?", (session_id,))
        return from_dict(SessionRecord, json.loads(rows[0][0])) if rows else None

    def list_sessions(self, created_by: str) -> list[SessionRecord]:
        rows = self._query(
            "SELECT data FROM sessions WHERE created_by = ? ORDER BY created_at DESC, id DESC",
            (created_by,),
        )
        return [from_dict(SessionRecord, json.loads(row[0])) for row in rows]

    def all_sessions(self) -> list[SessionRecord]:
        rows = self._query("SELECT data FROM sessions")
        return [from_dict(SessionRecord, json.loads(row[0])) for row in rows]

    def all_resources(self) -> list[ResourceRecord]:
        rows = self._query("SELECT data FROM resources")
        return [from_dict(ResourceRecord, json.loads(row[0])) for row in rows]

    def sessions_of_resource(self, resource_id: str) -> list[SessionRecord]:
        rows = self._query("SELECT data FROM sessions WHERE resource_id = ?", (resource_id,))
        return [from_dict(SessionRecord, json.loads(row[0])) for row in rows]

    # ------------------------------------------------------------ operations

    def insert_operation(
        self, op: OperationRecord, request: OperationRequest | None = None
    ) -> OperationRecord:
        """Register an operation under its Idempotency-Key atomically, with its typed `request`
        (kept until it finishes: it runs again after a restart).

        Returns the stored record: `op` itself, or the one that already holds the key (an
        operation without a key never finds one)."""
        stored_request = None if request is None else request_to_json(request)
        with self._lock:
            try:
                self._db.execute(
                    "INSERT INTO operations"
                    " (id, session_id, kind, idempotency_key, status, data, request)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        op.id,
                        op.session_id,
                        op.kind.value,
                        op.idempotency_key,
                        op.status.value,
                        to_json(op),
                        stored_request,
                    ),
                )
                return op
            except sqlite3.IntegrityError:
                # The key is taken; operations are never deleted, so it is still there.
                assert op.idempotency_key is not None, f"operation id {op.id} inserted twice"
        stored = self.find_operation(op.session_id, op.kind, op.idempotency_key)
        assert stored is not None, f"Idempotency-Key {op.idempotency_key!r} vanished"
        return stored

    def find_operation(
        self, session_id: str, kind: OperationKind, idempotency_key: str
    ) -> OperationRecord | None:
        rows = self._query(
            "SELECT data FROM operations WHERE session_id = ? AND kind = ? AND idempotency_key = ?",
            (session_id, kind.value, idempotency_key),
        )
        return operation_from_dict(json.loads(rows[0][0])) if rows else None

    def put_operation(self, op: OperationRecord) -> None:
        self.put_operations([op])

    def put_operations(
        self, ops: list[OperationRecord], keep_requests: Collection[str] = ()
    ) -> None:
        """Several operation updates in one transaction (a shared pass's operations start and
        finish together: one commit). `keep_requests`: finished ones that keep their request."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                # A finished operation will not run again: its request goes, unless a restart
                # must replay it (service/durability/full_weight.py).
                self._db.executemany(
                    "UPDATE operations SET status = ?, data = ?,"
                    " request = CASE WHEN ? THEN NULL ELSE request END,"
                    " body = CASE WHEN ? THEN NULL ELSE body END WHERE id = ?",
                    [
                        (op.status.value, to_json(op), drop, drop, op.id)
                        for op in ops
                        for drop in [op.status in OPERATION_TERMINAL and op.id not in keep_requests]
                    ],
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        for op in ops:
            for listener in self._operation_listeners:
                listener(op)

    def get_operation(self, operation_id: str) -> OperationRecord | None:
        rows = self._query("SELECT data FROM operations WHERE id = ?", (operation_id,))
        return operation_from_dict(json.loads(rows[0][0])) if rows else None

    def unfinished_operations(self, session_id: str | None = None) -> list[OperationRecord]:
        sql = "SELECT data FROM operations WHERE status IN (?, ?)"
        args: SqlArgs = (OperationStatus.PENDING.value, OperationStatus.RUNNING.value)
        if session_id is not None:
            sql += " AND session_id = ?"
            args += (session_id,)
        rows = self._query(sql + " ORDER BY seq", args)
        return [operation_from_dict(json.loads(row[0])) for row in rows]

    def unfinished_with_requests(self) -> list[tuple[OperationRecord, OperationRequest | None]]:
        """Every PENDING/RUNNING operation, in submission order, with its typed request (None
        where none was kept, or only an older server's wire body: wire_bodies)."""
        rows = self._query(
            "SELECT data, request FROM operations WHERE status IN (?, ?) ORDER BY seq",
            (OperationStatus.PENDING.value, OperationStatus.RUNNING.value),
        )
        return [_with_request(row) for row in rows]

    def journal(
        self, session_id: str, after: str | None
    ) -> list[tuple[OperationRecord, OperationRequest | None]]:
        """The session's COMPLETED operations that kept their request (put_operations'
        keep_requests), submitted after operation `after` (None: all), in submission order;
        None for one that kept only an older server's wire body (wire_bodies)."""
        sql, args = self._kept(session_id, after, ">")
        rows = self._query(f"SELECT data, request FROM operations WHERE {sql} ORDER BY seq", args)
        return [_with_request(row) for row in rows]

    def clear_requests(self, session_id: str, through: str | None) -> None:
        """Drop the kept requests up to and including operation `through` (None: all)."""
        sql, args = self._kept(session_id, through, "<=")
        self._execute(f"UPDATE operations SET request = NULL, body = NULL WHERE {sql}", args)

    def _kept(self, session_id: str, op_id: str | None, compare: str) -> tuple[str, SqlArgs]:
        sql = "session_id = ? AND status = ? AND (request IS NOT NULL OR body IS NOT NULL)"
        args: SqlArgs = (session_id, OperationStatus.COMPLETED.value)
        if op_id is None:
            return sql, args
        return f"{sql} AND seq {compare} (SELECT seq FROM operations WHERE id = ?)", (*args, op_id)

    def wire_bodies(self) -> list[tuple[OperationRecord, bytes]]:
        """Operations an older server kept as the HTTP body they arrived with, not as a typed
        request: the api layer parses them once at startup and stores them with put_request."""
        rows = self._query(
            "SELECT data, body FROM operations WHERE body IS NOT NULL AND request IS NULL"
            " ORDER BY seq"
        )
        return [(operation_from_dict(json.loads(row[0])), row[1]) for row in rows]

    def put_request(self, operation_id: str, request: OperationRequest) -> None:
        """Keep `request` in place of the wire body an older server kept."""
        self._execute(
            "UPDATE operations SET request = ?, body = NULL WHERE id = ?",
            (request_to_json(request), operation_id),
        )

    # ------------------------------------------------------------ checkpoints

    def put_checkpoint(self, c: CheckpointRecord) -> None:
        self._execute(
            "INSERT OR REPLACE INTO checkpoints (id, session_id, created_by, created_at, type,"
            " data) VALUES (?, ?, ?, ?, ?, ?)",
            (c.id, c.session_id, c.created_by, c.created_at, c.type.value, to_json(c)),
        )

    def get_checkpoint(self, checkpoint_id: str) -> CheckpointRecord | None:
        rows = self._query("SELECT data FROM checkpoints WHERE id = ?", (checkpoint_id,))
        return from_dict(CheckpointRecord, json.loads(rows[0][0])) if rows else None

    def list_checkpoints(self, created_by: str) -> list[CheckpointRecord]:
        rows = self._query(
            "SELECT data FROM checkpoints WHERE created_by = ? ORDER BY created_at DESC, id DESC",
            (created_by,),
        )
        return [from_dict(CheckpointRecord, json.loads(row[0])) for row in rows]

    def delete_checkpoint(self, checkpoint_id: str) -> None:
        self._execute("DELETE FROM checkpoints WHERE id = ?", (checkpoint_id,))

    def all_checkpoints(self) -> list[CheckpointRecord]:
        rows = self._query("SELECT data FROM checkpoints")
        return [from_dict(CheckpointRecord, json.loads(row[0])) for row in rows]

    # ------------------------------------------------------------ payloads

    def put_payload(self, payload_id: str, session_id: str, created_at: float, path: str) -> None:
        self._execute(
            "INSERT OR REPLACE INTO payloads (id, session_id, created_at, path) VALUES (?,?,?,?)",
            (payload_id, session_id, created_at, path),
        )

    def get_payload(self, payload_id: str) -> tuple[str, str] | None:
        """(session_id, path) of a payload, or None."""
        rows = self._query("SELECT session_id, path FROM payloads WHERE id = ?", (payload_id,))
        return (rows[0][0], rows[0][1]) if rows else None

    # ------------------------------------------------------------ read-only digests
    # For the dashboard and /metrics: counts, and operations without their (possibly large)
    # outputs, extracted inside SQLite so sample results are never parsed.

    def count_operations(self) -> list[tuple[str, str, int]]:
        """(kind, status, count) over every stored operation."""
        rows = self._query(
            "SELECT kind, status, COUNT(*) FROM operations GROUP BY kind, status"
            " ORDER BY kind, status"
        )
        return [(row[0], row[1], row[2]) for row in rows]

    def count_sessions(self) -> list[tuple[str, int]]:
        """(status, count) over every stored session."""
        rows = self._query("SELECT status, COUNT(*) FROM sessions GROUP BY status ORDER BY status")
        return [(row[0], row[1]) for row in rows]

    def count_resources(self) -> list[tuple[str, int]]:
        """(status, count) over every stored model resource."""
        rows = self._query("SELECT status, COUNT(*) FROM resources GROUP BY status ORDER BY status")
        return [(row[0], row[1]) for row in rows]

    def recent_operations(self, created_by: str, limit: int) -> list[OperationDigest]:
        """The newest `limit` operations of `created_by`'s sessions, newest first."""
        rows = self._query(
            f"SELECT {_DIGEST_COLUMNS} FROM operations o JOIN sessions s ON o.session_id = s.id"
            " WHERE s.created_by = ? ORDER BY o.seq DESC LIMIT ?",
            (created_by, limit),
        )
        return [_digest(row) for row in rows]

    def session_operations(
        self, session_id: str, kinds: tuple[OperationKind, ...], limit: int
    ) -> list[OperationDigest]:
        """The last `limit` operations of these kinds in one session, in submission order."""
        marks = ",".join("?" * len(kinds))
        rows = self._query(
            f"SELECT * FROM (SELECT {_DIGEST_COLUMNS}, o.seq FROM operations o"
            f" WHERE o.session_id = ? AND o.kind IN ({marks}) ORDER BY o.seq DESC LIMIT ?)"
            " ORDER BY seq",
            (session_id, *(k.value for k in kinds), limit),
        )
        return [_digest(row) for row in rows]


@dataclasses.dataclass(frozen=True)
class OperationDigest(OperationRecord):
    """An operation record without its output (always None here), plus the loss and metrics a
    forward-backward stored."""

    loss: float | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


# The record without its output, then the output's loss and metrics, extracted inside SQLite.
_DIGEST_COLUMNS = (
    "json_remove(o.data, '$.output'), json_extract(o.data, '$.output.loss'),"
    " json_extract(o.data, '$.output.metrics')"
)


def _digest(row: sqlite3.Row) -> OperationDigest:
    metrics = json.loads(row[2]) if row[2] else {}
    return from_dict(OperationDigest, {**json.loads(row[0]), "loss": row[1], "metrics": metrics})


def _with_request(row: sqlite3.Row) -> tuple[OperationRecord, OperationRequest | None]:
    op = operation_from_dict(json.loads(row[0]))
    return op, None if row[1] is None else request_from_json(op.kind, row[1])
