"""Checkpoints: saving them, listing and retrieving them, planning a resume from one, signed
downloads of their files (api.md 1.4.7, 1.4.8, 1.5, 3.6, 7.15), and deleting them (the Tinker
surface's checkpoint delete and TTL).

Each checkpoint lives in <data_dir>/checkpoints/<id>/ (file formats: engine/checkpoint/formats.py).
It is written under a `.partial-` name, flushed, renamed into place, and only then recorded in the
store, so a process killed mid-save leaves no record pointing at partial files; leftovers are
removed at startup. A delete goes the other way, the record first and then the files, so a kill
in between leaves a directory without a record, which startup removes as well. The merged model
of a LoRA inference checkpoint is built on its first MERGED download into <id>/merged, the same
way (a full-weight session writes <id>/merged when it saves). Records and files survive
restarts.

Imports: store, engine.interface.
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from posttrain.engine.files import ADAPTER_FILES, fsync
from posttrain.engine.interface import Engine
from posttrain.errors import Conflict, InvalidRequest, NotFound
from posttrain.records import CheckpointRecord, ResourceRecord, SessionRecord
from posttrain.service.ids import new_id
from posttrain.service.signing import UrlSigner
from posttrain.statuses import SessionStatus
from posttrain.store.repo import Repo
from posttrain.types import CheckpointOutput, CheckpointRef, CheckpointType, LoraConfig

log = logging.getLogger("posttrain.checkpoints")

PARTIAL_PREFIX = ".partial-"
MERGED_DIR = "merged"
VARIANT_ADAPTER = "CHECKPOINT_VARIANT_ADAPTER"
VARIANT_MERGED = "CHECKPOINT_VARIANT_MERGED"
# URL segment per variant: where the signed file route looks for the file.
FILE_PARTS = {VARIANT_ADAPTER: "adapter", VARIANT_MERGED: "merged"}


@dataclass(frozen=True)
class CheckpointFile:
    filename: str
    size: int
    url: str


@dataclass(frozen=True)
class ResumePlan:
    """What a session resumed from a checkpoint starts with."""

    checkpoint: CheckpointRecord
    lora: LoraConfig | None  # None: a full-weight session
    load_optimizer: bool
    step: int


def file_url_path(checkpoint_id: str, part: str, filename: str) -> str:
    return f"/v1/rl/checkpoints/{checkpoint_id}/files/{part}/{filename}"


def plan_resume(
    repo: Repo,
    user: str,
    checkpoint_id: str,
    *,
    resource: ResourceRecord,
    load_optimizer: bool | None,
    lora: LoraConfig | None,
    lora_given: frozenset[str],
    shared: bool = False,
) -> ResumePlan:
    """Check that `checkpoint_id` can start a session on `resource`; raises NotFound (404) or
    InvalidRequest (400) naming the reason.

    A LoRA checkpoint resumes on a LoRA resource, a full-weight one on a full-weight resource,
    both of the same base model. The LoRA config comes from the checkpoint; fields in
    `lora_given` (those the request set) must agree with it, except dropout, which only shapes
    future training. The seed is ignored (api.md 1.3). `load_optimizer` None means true for a
    training checkpoint; an inference checkpoint holds weights only, so an explicit true is an
    error. `shared`: another user's checkpoint its owner published (the caller checked that)."""
    checkpoint = repo.get_checkpoint(checkpoint_id)
    if checkpoint is None or (checkpoint.created_by != user and not shared):
        raise NotFound(f"checkpoint {checkpoint_id} not found", param="resume_from_checkpoint_id")
    if checkpoint.type == CheckpointType.INFERENCE:
        if load_optimizer:
            raise InvalidRequest(
                f"checkpoint {checkpoint_id} is an inference checkpoint (weights only);"
                " load_optimizer true needs a training checkpoint",
                param="load_optimizer",
            )
        load = False
    else:
        load = load_optimizer is not False
    if checkpoint.base_model != resource.base_model:
        raise InvalidRequest(
            f"checkpoint {checkpoint_id} was trained from base model {checkpoint.base_model!r};"
            f" model resource {resource.id} serves {resource.base_model!r}",
            param="resume_from_checkpoint_id",
        )
    saved = checkpoint.lora_config
    if (saved is not None) != resource.lora_enabled:
        raise InvalidRequest(
            f"checkpoint {checkpoint_id} is a"
            f" {'full-weight' if saved is None else 'LoRA'} checkpoint; model resource"
            f" {resource.id} is {'a LoRA' if resource.lora_enabled else 'a full-weight'} resource",
            param="resume_from_checkpoint_id",
        )
    if load:
        _check_optimizer_family(repo, checkpoint, resource)
    effective = None if saved is None else _resumed_lora(checkpoint_id, saved, lora, lora_given)
    return ResumePlan(checkpoint, effective, load, checkpoint.step if load else 0)


def _resumed_lora(
    checkpoint_id: str, saved: LoraConfig, lora: LoraConfig | None, lora_given: frozenset[str]
) -> LoraConfig:
    requested = lora or saved
    fields: tuple[tuple[str, object, object], ...] = (
        ("rank", requested.rank, saved.rank),
        ("alpha", requested.alpha, saved.alpha),
        ("train_unembed", requested.train_unembed, saved.train_unembed),
    )
    for name, wanted, held in fields:
        if name in lora_given and wanted != held:
            raise InvalidRequest(
                f"lora_config.{name} {wanted} does not fit checkpoint {checkpoint_id}, whose"
                f" adapter has {name} {held}",
                param=f"lora_config.{name}",
            )
    dropout = requested.dropout if "dropout" in lora_given else saved.dropout
    return dataclasses.replace(saved, dropout=dropout)


def _check_optimizer_family(
    repo: Repo, checkpoint: CheckpointRecord, resource: ResourceRecord
) -> None:
    producer = repo.get_session(checkpoint.session_id)
    origin = repo.get_resource(producer.resource_id) if producer is not None else None
    # Muon's two scaling strategies keep the same state (momentum buffers); only the family
    # decides which tensors exist.
    if origin is None or (origin.muon_scaling is None) == (resource.muon_scaling is None):
        return
    raise InvalidRequest(
        f"checkpoint {checkpoint.id} holds {_family(origin)} optimizer state; model resource"
        f" {resource.id} uses {_family(resource)}. Send load_optimizer false to load weights only",
        param="load_optimizer",
    )


def _family(resource: ResourceRecord) -> str:
    return "AdamW" if resource.muon_scaling is None else "Muon"


class CheckpointService:
    def __init__(self, data_dir: Path, repo: Repo, engine: Engine, signer: UrlSigner) -> None:
        self.directory = data_dir / "checkpoints"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.repo = repo
        self.engine = engine
        self.signer = signer
        self._merge_lock = threading.Lock()

    # ------------------------------------------------------------ saving (worker thread)

    def save(self, session: SessionRecord, kind: CheckpointType) -> CheckpointOutput:
        """Write, rename into place, then record a checkpoint of the session as it is now.

        Runs on the resource's worker between the session's operations, so the saved weights,
        optimizer state and `step` belong to one moment. Returns the operation output."""
        checkpoint_id = new_id("ckpt")
        partial = self.directory / f"{PARTIAL_PREFIX}{checkpoint_id}"
        final = self.directory / checkpoint_id
        partial.mkdir()
        try:
            self._write(session, kind, partial)
            fsync(partial)
            os.replace(partial, final)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        fsync(self.directory)
        now = time.time()
        lora = session.lora_config
        record = CheckpointRecord(
            id=checkpoint_id,
            session_id=session.id,
            base_model=session.base_model,
            created_by=session.created_by,
            created_at=now,
            type=kind,
            step=session.step,
            path=str(final),
            lora_rank=lora.rank if lora is not None else None,
            lora_config=lora,
        )
        self.repo.put_checkpoint(record)
        ref = CheckpointRef(checkpoint_id, now, session.step)
        self.repo.update_session(session.id, lambda s: _with(s, kind, ref, now))
        return CheckpointOutput(checkpoint=ref)

    def _write(self, session: SessionRecord, kind: CheckpointType, directory: Path) -> None:
        if kind == CheckpointType.TRAINING:
            self.engine.save_training_state(session.resource_id, session.id, directory)
            return
        if session.lora_config is None:  # full weights: the merged model is all there is
            self.engine.save_full_model(
                session.resource_id,
                session.id,
                directory / MERGED_DIR,
                base_model=session.base_model,
            )
            return
        self.engine.save_adapter(
            session.resource_id,
            session.id,
            directory,
            lora=session.lora_config,
            base_model=session.base_model,
        )

    def remove_partial(self) -> int:
        """Startup: delete what interrupted saves left behind; returns how many.

        That is every `.partial-` directory, and any checkpoint directory without a record (a
        kill between the rename and the store write). Neither was ever listed."""
        removed = 0
        recorded = {Path(c.path).name for c in self.repo.all_checkpoints()}
        for entry in self.directory.iterdir():
            if entry.name.startswith(PARTIAL_PREFIX) or entry.name not in recorded:
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink()
                removed += 1
                continue
            for inner in entry.glob(f"{PARTIAL_PREFIX}*"):
                shutil.rmtree(inner, ignore_errors=True)
                removed += 1
        if removed:
            log.warning("removed %d partial checkpoint directories after a restart", removed)
        return removed

    # ------------------------------------------------------------ reading

    def get(self, user: str, checkpoint_id: str) -> CheckpointRecord:
        record = self.repo.get_checkpoint(checkpoint_id)
        if record is None or record.created_by != user:
            raise NotFound(f"checkpoint {checkpoint_id} not found", param="id")
        return record

    def list(
        self,
        user: str,
        *,
        base_model: str | None,
        session_id: str | None,
        checkpoint_type: str | None,
    ) -> list[CheckpointRecord]:
        """The caller's checkpoints, newest first, filtered by exact matches."""
        wanted: CheckpointType | None = None
        if checkpoint_type is not None:
            try:
                wanted = CheckpointType(checkpoint_type)
            except ValueError:
                known = ", ".join(t.value for t in CheckpointType)
                raise InvalidRequest(
                    f"unknown checkpoint type {checkpoint_type!r}; known: {known}", param="type"
                ) from None
        return [
            c
            for c in self.repo.list_checkpoints(user)
            if (base_model is None or c.base_model == base_model)
            and (session_id is None or c.session_id == session_id)
            and (wanted is None or c.type == wanted)
        ]

    def size_bytes(self, record: CheckpointRecord) -> int:
        """The bytes its directory's files hold (a built merged model included)."""
        root = Path(record.path)
        return sum(
            p.stat().st_size
            for p in root.rglob("*")
            if p.is_file()
            and not any(part.startswith(PARTIAL_PREFIX) for part in p.relative_to(root).parts)
        )

    # ------------------------------------------------------------ deleting

    def delete(self, user: str, checkpoint_id: str, *, param: str = "id") -> None:
        """Remove a checkpoint: its record, its ref on the session that saved it, its files.

        A session still being set up from it (CREATING, resuming from it) is reading its files:
        the delete is refused (Conflict) until that session is running. A MERGED download
        being built holds the merge lock, so the files go after it. Signed URLs for its files
        stop resolving with the record."""
        record = self.get(user, checkpoint_id)
        loading = [
            s.id
            for s in self.repo.list_sessions(user)
            if s.status == SessionStatus.CREATING and s.resume_from_checkpoint_id == checkpoint_id
        ]
        if loading:
            raise Conflict(
                f"checkpoint {checkpoint_id} is being loaded by session {loading[0]}; delete it"
                " once that session is running",
                param=param,
            )
        self.repo.delete_checkpoint(checkpoint_id)
        if self.repo.get_session(record.session_id) is not None:
            self.repo.update_session(record.session_id, lambda s: _without(s, checkpoint_id))
        with self._merge_lock:
            shutil.rmtree(record.path, ignore_errors=True)
        log.debug("deleted checkpoint %s", checkpoint_id)

    # ------------------------------------------------------------ downloads

    # builtins.list: inside this class `list` names the method above.
    def download(
        self, user: str, checkpoint_id: str, variant: str | None
    ) -> builtins.list[CheckpointFile]:
        """Signed, expiring URLs for each file of one variant of an inference checkpoint."""
        record = self.get(user, checkpoint_id)
        if variant not in FILE_PARTS:
            raise InvalidRequest(
                f"variant must be {VARIANT_ADAPTER} or {VARIANT_MERGED}, got {variant!r}",
                param="variant",
            )
        if record.type != CheckpointType.INFERENCE:
            raise InvalidRequest(
                f"checkpoint {checkpoint_id} is a training checkpoint; only inference"
                " checkpoints are downloadable",
                param="id",
            )
        if record.lora_config is None and variant == VARIANT_ADAPTER:
            raise InvalidRequest(
                f"checkpoint {checkpoint_id} has full weights; it has no adapter variant",
                param="variant",
            )
        part = FILE_PARTS[variant]
        directory = self._variant_directory(record, variant)
        names = (
            ADAPTER_FILES
            if variant == VARIANT_ADAPTER
            else sorted(p.name for p in directory.iterdir() if p.is_file())
        )
        return [
            CheckpointFile(
                filename=name,
                size=(directory / name).stat().st_size,
                url=self.signer.sign("GET", file_url_path(checkpoint_id, part, name)),
            )
            for name in names
        ]

    def _variant_directory(self, record: CheckpointRecord, variant: str) -> Path:
        root = Path(record.path)
        if variant == VARIANT_ADAPTER:
            return root
        merged = root / MERGED_DIR
        with self._merge_lock:
            if not merged.is_dir():
                partial = root / f"{PARTIAL_PREFIX}{MERGED_DIR}-{new_id('m')}"
                try:
                    self.engine.export_merged(record.base_model, root, partial)
                    os.replace(partial, merged)
                except BaseException:
                    shutil.rmtree(partial, ignore_errors=True)
                    raise
                fsync(root)
        return merged

    def authorize(
        self, checkpoint_id: str, part: str, filename: str, expires: str | None, sig: str | None
    ) -> Path:
        """The file behind a signed URL; NotFound when the signature is bad or expired."""
        path = file_url_path(checkpoint_id, part, filename)
        record = self.repo.get_checkpoint(checkpoint_id)
        if record is None or not self.signer.verify("GET", path, expires, sig):
            raise NotFound("checkpoint file URL is unknown or expired", param="sig")
        directory = Path(record.path) if part == "adapter" else Path(record.path) / MERGED_DIR
        file = directory / filename
        # The signature already binds the name; a bare name keeps the lookup inside directory.
        if "/" in filename or filename.startswith(".") or not file.is_file():
            raise NotFound(f"checkpoint file {filename} not found", param="filename")
        return file


def _with(
    session: SessionRecord, kind: CheckpointType, ref: CheckpointRef, now: float
) -> SessionRecord:
    """The session with `ref` appended to its checkpoints of `kind`."""
    if kind == CheckpointType.TRAINING:
        training = (*session.training_checkpoints, ref)
        return dataclasses.replace(session, training_checkpoints=training, updated_at=now)
    inference = (*session.inference_checkpoints, ref)
    return dataclasses.replace(session, inference_checkpoints=inference, updated_at=now)


def _without(session: SessionRecord, checkpoint_id: str) -> SessionRecord:
    training = tuple(c for c in session.training_checkpoints if c.id != checkpoint_id)
    inference = tuple(c for c in session.inference_checkpoints if c.id != checkpoint_id)
    return dataclasses.replace(
        session, training_checkpoints=training, inference_checkpoints=inference
    )
