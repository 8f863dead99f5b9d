"""One vLLM server as a generator replica (hosts/vllm/engine.py): the staged changes it has
applied, what each session's generator serves on it, and the weight-version labels it gave
those states; a resource's servers and staged changes (`Resource`), and an install's files.

A staged change (hosts/staged_changes.py) is an `Install` (a session's served weights, as files)
or a `Drop`, each applied by its own handler on a `Replica`. The server's label
moves on after each set of changes (vLLM attaches the label in force to every token it
samples), and `labels` keeps what each session served under each label, so a choice's
`weight_versions` spans become policy versions. vLLM keys its prefix cache by adapter name and
path, not by weights, and both stay through an install (an adapter's path is its session's
link; a full-weight reload keeps the base model's name). So each install gives its session a
new cache salt (`salts`, sent with every request): no prompt KV of weights served before
reaches a later request, and another session's change leaves a session's cached prompts in
place (resetting the whole cache is refused while any request runs).

Imports: types, engine (checkpoint.formats; hosts: lanes, staged_changes, vllm.server,
vllm.stream).
"""

from __future__ import annotations

import itertools
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor

from posttrain.engine.checkpoint import formats
from posttrain.engine.hosts.lanes import Lanes
from posttrain.engine.hosts.staged_changes import StagedChange
from posttrain.engine.hosts.vllm.server import ServerSpec, VllmServer
from posttrain.engine.hosts.vllm.stream import VllmStream
from posttrain.types import LoraConfig

FULL_WEIGHTS_FILE = "model.safetensors"  # a full-weight install's one file in its directory


@dataclass(frozen=True)
class Install(StagedChange["Replica"]):
    """The session's served weights, written at `path`: the directory of its adapter (`lora`)
    or of the model's one file, and their policy version."""

    lora: bool
    version: int
    path: Path
    mid_generation: bool = False  # PIPELINE: it may land between two tokens

    @property
    def pipeline(self) -> bool:
        return self.mid_generation

    def apply(self, generator: Replica) -> None:
        generator.install(self)


@dataclass(frozen=True)
class Drop(StagedChange["Replica"]):
    """The session's end (`lora`: its adapter is unloaded)."""

    lora: bool

    def apply(self, generator: Replica) -> None:
        generator.drop(self)


Change = Install | Drop


@dataclass
class Replica:
    server: VllmServer
    # Where this server's adapters are loaded from: one link per session to its install
    # (`_link`), so vLLM reads the installed weights whichever request makes it load them.
    links: Path
    applied: int = 0  # the last fence this server applied
    generating: bool = False
    labels: dict[str, dict[str, int]] = field(default_factory=lambda: {"default": {}})
    serving: dict[str, int] = field(default_factory=dict)  # session -> policy version
    files: dict[str, Path] = field(default_factory=dict)  # session -> its adapter's directory
    salts: dict[str, str] = field(default_factory=dict)  # session -> its prefix-cache salt
    # Sessions whose adapter was last loaded in place (a PIPELINE install): `settle` loads
    # each afresh once none of its requests runs here.
    inplace: set[str] = field(default_factory=set)
    counter: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    installs: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
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

    def _apply(self, change: Change) -> None:
        change.apply(self)
        self.applied = max(self.applied, change.fence)

    def drop(self, change: Drop) -> None:
        session_id = change.session_id
        if change.lora:
            self.server.call("/v1/unload_lora_adapter", {"lora_name": session_id})
            (self.links / session_id).unlink(missing_ok=True)
        self.serving.pop(session_id, None)
        self.files.pop(session_id, None)
        self.salts.pop(session_id, None)
        self.inplace.discard(session_id)

    def install(self, change: Install) -> None:
        session_id = change.session_id
        if change.lora:
            self._load(session_id, self._link(session_id, change.path), change.mid_generation)
            self.serving[session_id] = change.version
            self.files[session_id] = change.path
        else:  # the worker extension's reload (hosts/vllm/worker_extension.py)
            reload = {"method": "posttrain_reload", "args": [str(change.path / FULL_WEIGHTS_FILE)]}
            self.server.call("/collective_rpc", reload)
            self.serving[session_id] = change.version
        # Unique on this server ('@' and '/' are refused).
        self.salts[session_id] = f"install-{next(self.installs)}"

    def _link(self, session_id: str, target: Path) -> Path:
        """The session's link, now to `target` (replaced atomically: a load through it reads
        one install or the other, whole)."""
        self.links.mkdir(parents=True, exist_ok=True)
        link, new = self.links / session_id, self.links / f".{session_id}.new"
        new.unlink(missing_ok=True)
        new.symlink_to(target.resolve())
        os.replace(new, link)
        return link

    def _load(self, session_id: str, link: Path, mid_generation: bool) -> None:
        """Load the session's adapter through its link. vLLM keeps the request it was loaded
        with on every later sample request and loads the adapter again at every step of one
        that says `load_inplace` (lora/worker_manager.py `add_adapter`): from the path that
        request names, which is why it is a link. So an adapter is loaded in place only for a
        PIPELINE install, whose running requests must switch at once (and `settle` loads it
        afresh later); otherwise it is unloaded and loaded afresh (no running request of the
        session is affected: the lanes' join rule), and its requests load it once."""
        load: dict[str, str | bool] = {"lora_name": session_id, "lora_path": str(link)}
        if session_id in self.serving and mid_generation:
            load["load_inplace"] = True
            self.inplace.add(session_id)
        else:
            if session_id in self.serving:
                self.server.call("/v1/unload_lora_adapter", {"lora_name": session_id})
            self.inplace.discard(session_id)
        self.server.call("/v1/load_lora_adapter", load)

    def settle(self, busy: frozenset[str]) -> None:
        """Load afresh, through the same link (the same weights), each adapter loaded in
        place whose session has no request running here (`busy`: the sessions that have): a
        request sent after a PIPELINE install would otherwise load it from disk at every
        step, the install's running requests ended long since."""
        for session_id in sorted(self.inplace - busy):
            self._load(session_id, self.links / session_id, mid_generation=False)

    def relabel(self) -> None:
        """A new weight-version label for what the server serves now."""
        label = str(next(self.counter))
        self.labels[label] = dict(self.serving)
        self.server.call("/update_weight_version", {"new_version": label})

    def version_of(self, session_id: str) -> Callable[[str], int]:
        """label -> the session's policy version under it (0 before any install)."""
        return lambda label: self.labels.get(label, {}).get(session_id, 0)


class Resource(Lanes[Replica]):
    """A model resource's servers (hosts/vllm/engine.py) and what they must serve."""

    def __init__(self, base_model: str, spec: ServerSpec, files: Path) -> None:
        super().__init__(base_model)
        self.spec = spec
        self.files = files  # where installs are written (shared memory where there is one)
        self.changes: list[Change] = []  # staged, not yet applied by every server
        self.written: set[Path] = set()  # directories of installs not yet removed
        self.last_change: dict[str, int] = {}  # session -> the fence of its last change
        self.streams: set[VllmStream] = set()  # the lanes' open streams (wake_lanes)


def write_install(
    directory: Path, tensors: dict[str, Tensor], lora: LoraConfig | None, base_model: str
) -> None:
    """A session's served weights as files a server loads: a directory holding a PEFT adapter
    (`lora`), or one safetensors file of the whole model."""
    directory.mkdir(parents=True, exist_ok=True)
    if lora is None:  # checkpoint names: a LoRA-wrapped layer's weight is `<layer>.base.*`
        tensors = {re.sub(r"\.base(?=\.)", "", n): t.contiguous() for n, t in tensors.items()}
        save_file(tensors, str(directory / FULL_WEIGHTS_FILE))
        return
    targets = sorted({name.rsplit(".", 1)[0].rsplit(".", 1)[-1] for name in tensors})
    formats.save_peft_adapter(
        directory, tensors, lora=lora, base_model=base_model, target_modules=targets
    )
