"""SQLite connection and schema. One file under the data directory, WAL mode, so readers (the
HTTP handlers) never block on the writer (the worker thread) and a crash loses nothing that
was committed.

Imports: config.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

# An operation without an Idempotency-Key (the seed-era sample route) stores NULL: SQLite's
# UNIQUE lets NULLs repeat, so such operations are simply not deduplicated. `request`: the
# typed request a restart runs again (store/codec.py), until the operation finishes; `body`:
# the HTTP body an older server kept instead (Repo.wire_bodies).
OPERATION_COLUMNS = """
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, session_id TEXT NOT NULL,
    kind TEXT NOT NULL, idempotency_key TEXT, status TEXT NOT NULL,
    data TEXT NOT NULL, body BLOB, request TEXT, UNIQUE (session_id, kind, idempotency_key)"""

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS resources (
    id TEXT PRIMARY KEY, created_by TEXT NOT NULL, created_at REAL NOT NULL,
    status TEXT NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, resource_id TEXT NOT NULL, created_by TEXT NOT NULL,
    created_at REAL NOT NULL, status TEXT NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS operations ({OPERATION_COLUMNS});
CREATE TABLE IF NOT EXISTS checkpoints (
    id TEXT PRIMARY KEY, session_id TEXT NOT NULL, created_by TEXT NOT NULL,
    created_at REAL NOT NULL, type TEXT NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS payloads (
    id TEXT PRIMARY KEY, session_id TEXT NOT NULL, created_at REAL NOT NULL,
    path TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS dialect_objects (
    kind TEXT NOT NULL, id TEXT NOT NULL, created_by TEXT NOT NULL, created_at REAL NOT NULL,
    data TEXT NOT NULL, PRIMARY KEY (kind, id));
CREATE INDEX IF NOT EXISTS sessions_by_resource ON sessions (resource_id);
CREATE INDEX IF NOT EXISTS operations_by_session ON operations (session_id);
"""


def connect(data_dir: Path) -> sqlite3.Connection:
    """Open (creating if needed) the store under data_dir.

    One connection is shared by all threads behind the repo's lock; sqlite3 serialises its own
    use, and check_same_thread is off because the worker threads write through it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(
        data_dir / "posttrain.sqlite3", check_same_thread=False, isolation_level=None
    )
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=NORMAL")
    connection.executescript(SCHEMA)
    _migrate(connection)
    return connection


def _migrate(connection: sqlite3.Connection) -> None:
    """Columns added or relaxed since the first schema, for stores made by an older version."""
    columns = {row[1]: row for row in connection.execute("PRAGMA table_info(operations)")}
    if "body" not in columns:
        connection.execute("ALTER TABLE operations ADD COLUMN body BLOB")
    if "request" not in columns:
        connection.execute("ALTER TABLE operations ADD COLUMN request TEXT")
    if columns["idempotency_key"][3]:  # NOT NULL: SQLite relaxes it only by a table copy
        connection.executescript(
            "BEGIN;"
            f"CREATE TABLE operations_relaxed ({OPERATION_COLUMNS});"
            "INSERT INTO operations_relaxed"
            " (seq, id, session_id, kind, idempotency_key, status, data, body, request)"
            " SELECT seq, id, session_id, kind, idempotency_key, status, data, body, request"
            " FROM operations;"
            "DROP TABLE operations;"
            "ALTER TABLE operations_relaxed RENAME TO operations;"
            "CREATE INDEX operations_by_session ON operations (session_id);"
            "COMMIT;"
        )
