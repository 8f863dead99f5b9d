"""A Hugging Face hub cache that holds a model, laid out as huggingface_hub lays out its own:
`models--ORG--NAME/blobs/<sha256>` (the files), `snapshots/<commit>/<file>` (relative links to
the blobs) and `refs/main` (the commit), so that huggingface_hub's own lookups
(`snapshot_download(local_files_only=True)`, `scan_cache_dir`) find it with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # 40 hex digits, as a commit hash


def seed_hub_model(
    hub_cache: Path, repo_id: str, model_dir: Path, *, names: Iterable[str] | None = None
) -> Path:
    """Cache the files of `model_dir` (or only `names` of them) as `repo_id`'s main revision
    under `hub_cache` (HF_HOME/hub); the snapshot directory."""
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    chosen = set(names) if names is not None else None
    for file in sorted(model_dir.iterdir()):
        if not file.is_file() or (chosen is not None and file.name not in chosen):
            continue
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot
