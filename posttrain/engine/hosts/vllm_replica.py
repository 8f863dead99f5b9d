"""One vLLM server as a generator replica (hosts/vllm_engine.py): the staged changes it has
applied, what each session's generator serves on it, and the weight-version labels it gave
those states.

A change is an install (a session's served weights, as files) or a drop. The server's label
moves on after each set of changes (vLLM attaches the label in force to every token it
samples), and `labels` keeps what each session served under each label, so a choice's
`weight_versions` spans become policy versions. The prefix cache is reset before the next
generation after any change: vLLM keys it by adapter, not by the adapter's weights.

Imports: engine.hosts.vllm_server.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.engine.hosts.vllm_server import VllmServer

FULL_WEIGHTS_FILE = "model.safetensors"  # a full-weight install's one file in its directory


@dataclass(frozen=True)
class Change:
    fence: int
    what: str  # "install" | "drop"
    session_id: str
    lora: bool
    version: int = 0
    path: Path | None = None  # install: the directory of the adapter or the model file
    mid_generation: bool = False


@dataclass
class Replica:
    server: VllmServer
    applied: int = 0  # the last fence this server applied
    generating: bool = False
    cache_stale: bool = False
    labels: dict[str, dict[str, int]] = field(default_factory=lambda: {"default": {}})
    serving: dict[str, int] = field(default_factory=dict)  # session -> policy version
    files: dict[str, Path] = field(default_factory=dict)  # session -> its adapter's directory
    counter: itertools.count = field(default_factory=lambda: itertools.count(1))
    # Held while changes apply or a generation starts (never across a generation).
    lock: threading.Lock = field(default_factory=threading.Lock)

    def apply(self, changes: list[Change]) -> None:
        """Apply `changes` in order, then label the new state."""
        for change in changes:
            self._apply(change)
        if changes:
            self.relabel()

    def apply_between_tokens(self, changes: list[Change]) -> None:
        """PIPELINE: pause the running generation at a token boundary (requests kept),
        apply, resume; its sequences go on under the new label."""
        self.server.call("/pause", params={"mode": "keep"})
        try:
            self.apply(changes)
        finally:
            self.server.call("/resume")

    def fresh_cache(self) -> None:
        """Before a generation: no prompt KV of weights served before the last change."""
        if self.cache_stale:
            self.server.call("/reset_prefix_cache")
            self.cache_stale = False

    def _apply(self, change: Change) -> None:
        server, session_id = self.server, change.session_id
        if change.what == "drop":
            if change.lora:
                server.call("/v1/unload_lora_adapter", {"lora_name": session_id})
            self.serving.pop(session_id, None)
            self.files.pop(session_id, None)
        elif change.lora:
            assert change.path is not None
            load = {"lora_name": session_id, "lora_path": str(change.path), "load_inplace": True}
            server.call("/v1/load_lora_adapter", load)
            self.serving[session_id] = change.version
            self.files[session_id] = change.path
        else:  # the worker extension's reload (hosts/vllm_worker_extension.py)
            assert change.path is not None
            reload = {"method": "posttrain_reload", "args": [str(change.path / FULL_WEIGHTS_FILE)]}
            server.call("/collective_rpc", reload)
            self.serving[session_id] = change.version
        self.applied = max(self.applied, change.fence)
        self.cache_stale = True

    def relabel(self) -> None:
        """A new weight-version label for what the server serves now."""
        label = str(next(self.counter))
        self.labels[label] = dict(self.serving)
        self.server.call("/update_weight_version", {"new_version": label})

    def version_of(self, session_id: str):
        """label -> the session's policy version under it (0 before any install)."""
        return lambda label: self.labels.get(label, {}).get(session_id, 0)
