"""The engine's files as the service reads them without an engine call: a durable session's
directory (its record, its removal) and the files of an inference checkpoint's adapter; and the
write discipline (fsync) the service's own files follow beside them. The formats themselves
are engine/checkpoint/durable.py's and formats.py's; the service imports this module, never
those, so a format changes in one place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.engine.checkpoint import durable, formats

# Every part of a session's live state (Engine.persist_session writes some or all of them).
SESSION_PARTS: tuple[str, ...] = durable.PARTS

# The files of a LoRA checkpoint's adapter variant, as PEFT loads them.
ADAPTER_FILES: tuple[str, ...] = formats.ADAPTER_FILES


def session_record(directory: Path) -> dict[str, Any] | None:
    """The record Engine.persist_session last wrote with a session's state; None where the
    directory holds no complete state."""
    manifest = durable.read_manifest(directory)
    record = manifest.get("record") if manifest else None
    return dict(record) if isinstance(record, dict) else None


def remove_session_state(directory: Path) -> None:
    durable.remove(directory)


def fsync(path: Path) -> None:
    """Flush a file or a directory's entries to disk (what makes a rename durable)."""
    durable.fsync(path)
