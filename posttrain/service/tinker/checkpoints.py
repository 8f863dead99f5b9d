"""Named checkpoints and training runs as the Tinker REST views show them, and what an owner may
do to a name: delete it, set or clear its TTL, publish or unpublish it.

A name (`tinker://{model_id}/{segment}/{name}`, records.NameRecord) is listed once the
operation that writes its posttrain checkpoint completed, until it expires or is deleted; a
name still being written, or whose save failed, is not. Lists are newest first. Deleting a
name deletes its checkpoint's record and files (CheckpointService.delete); a name whose TTL
passed stops resolving at once (weights.resolve) and `sweep`, run by the expiry thread, deletes
it and its files later.

Ownership: a run or name of another user reads as absent (404), except that a name its owner
published can be read through weights_info and a run with a published checkpoint is visible
to `access_scope=accessible` (showing only the published checkpoints).

Imports: service, types.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

from posttrain.errors import Conflict, InvalidRequest, NotFound
from posttrain.records import CheckpointRecord
from posttrain.service.durability.checkpoints import CheckpointService
from posttrain.service.tinker.records import FutureRecord, NameRecord, RunRecord
from posttrain.service.tinker.registry import Registry
from posttrain.service.tinker.runs import TinkerRuns
from posttrain.service.tinker.weights import SEGMENTS, TinkerWeights
from posttrain.statuses import OperationStatus, SessionStatus
from posttrain.types import CheckpointOutput, OperationKind

log = logging.getLogger("posttrain.tinker")

T = TypeVar("T")
MAX_TTL_S = 10 * 365 * 24 * 3600  # the SDK documents 1 hour to 10 years
SCOPES = ("owned", "accessible")
WRITTEN, PENDING, FAILED = "written", "pending", "failed"


@dataclass(frozen=True)
class CheckpointView:
    checkpoint_id: str  # "weights/NAME" or "sampler_weights/NAME"
    checkpoint_type: str  # "training" or "sampler"
    time: float
    tinker_path: str
    size_bytes: int
    public: bool
    user_metadata: dict[str, str] | None
    expires_at: float | None


@dataclass(frozen=True)
class RunView:
    run: RunRecord
    corrupted: bool
    last_request_time: float
    last_checkpoint: CheckpointView | None
    last_sampler_checkpoint: CheckpointView | None


@dataclass(frozen=True)
class Page(Generic[T]):
    items: list[T]
    offset: int
    limit: int
    total_count: int


@dataclass(frozen=True)
class WeightsInfo:
    base_model: str
    is_lora: bool
    lora_rank: int | None
    train_unembed: bool | None


def _page(items: list[T], limit: int, offset: int) -> tuple[list[T], int]:
    if limit < 1:
        raise InvalidRequest("limit must be at least 1", param="limit")
    if offset < 0:
        raise InvalidRequest("offset must not be negative", param="offset")
    return items[offset : offset + limit], len(items)


def _scope(access_scope: str) -> None:
    if access_scope not in SCOPES:
        raise InvalidRequest(
            f"access_scope {access_scope!r} is not owned or accessible", param="access_scope"
        )


class TinkerCheckpoints:
    def __init__(
        self,
        registry: Registry,
        runs: TinkerRuns,
        weights: TinkerWeights,
        checkpoints: CheckpointService,
    ) -> None:
        self.registry = registry
        self.runs = runs
        self.weights = weights
        self.checkpoints = checkpoints
        self.repo = runs.repo

    # ------------------------------------------------------------ training runs

    def _run(self, user: str, model_id: str) -> RunRecord:
        run = self.registry.find(RunRecord, model_id, user)
        if run is None:
            raise NotFound(f"training run {model_id} not found", param="training_run_id")
        return run

    def training_run(self, user: str, model_id: str, access_scope: str = "owned") -> RunView:
        """The caller's run; with access_scope accessible, also another user's run that has a
        published checkpoint (shown with its published checkpoints only)."""
        _scope(access_scope)
        run = self.registry.find(RunRecord, model_id)
        if run is not None and run.user != user:
            if access_scope != "accessible" or not self._listed(model_id, public_only=True):
                run = None
        if run is None:
            raise NotFound(f"training run {model_id} not found", param="training_run_id")
        return self._run_view(run, public_only=run.user != user)

    def training_runs(
        self, user: str, limit: int, offset: int, access_scope: str = "owned"
    ) -> Page[RunView]:
        """The caller's runs (and, accessible, others' with a published checkpoint), newest
        first."""
        _scope(access_scope)
        runs = self.registry.all(RunRecord, user)
        if access_scope == "accessible":
            shared = {n.model_id for n in self.registry.all(NameRecord) if n.public}
            for model_id in sorted(shared - {r.model_id for r in runs}):
                other = self.registry.find(RunRecord, model_id)
                if other is not None and self._listed(model_id, public_only=True):
                    runs.append(other)
        runs.sort(key=lambda r: (r.created_at, r.model_id), reverse=True)
        page, total = _page(runs, limit, offset)
        views = [self._run_view(r, public_only=r.user != user) for r in page]
        return Page(views, offset, limit, total)

    def _run_view(self, run: RunRecord, *, public_only: bool) -> RunView:
        listed = self._listed(run.model_id, owner=run.user, public_only=public_only)
        latest: dict[str, tuple[NameRecord, CheckpointRecord]] = {}
        for name, checkpoint in listed:  # newest first: keep the first of each type
            latest.setdefault(name.checkpoint_type, (name, checkpoint))
        session = self.repo.get_session(run.session_id)
        last_ops = self.repo.session_operations(run.session_id, tuple(OperationKind), 1)
        last = max([run.created_at, *(op.created_at for op in last_ops)])
        return RunView(
            run=run,
            corrupted=session is not None and session.status == SessionStatus.ERROR,
            last_request_time=last,
            last_checkpoint=self._view(*latest["training"]) if "training" in latest else None,
            last_sampler_checkpoint=(
                self._view(*latest["sampler"]) if "sampler" in latest else None
            ),
        )

    # ------------------------------------------------------------ checkpoints

    def run_checkpoints(self, user: str, model_id: str) -> list[CheckpointView]:
        """The run's listed checkpoints, training and sampler, newest first."""
        self._run(user, model_id)
        return [self._view(n, c) for n, c in self._listed(model_id, owner=user)]

    def user_checkpoints(self, user: str, limit: int, offset: int) -> Page[CheckpointView]:
        """Every listed checkpoint of the user's runs, newest first."""
        page, total = _page(self._listed(None, owner=user), limit, offset)
        return Page([self._view(n, c) for n, c in page], offset, limit, total)

    def readable_names(self, user: str) -> list[NameRecord]:
        """The written, unexpired names `user` may read (load, sample, name as an OpenAI
        `model`): their own, then those other users published; each newest first."""
        own = [name for name, _ in self._listed(None, owner=user)]
        shared = [n for n, _ in self._listed(None, public_only=True) if n.user != user]
        return own + shared

    def weights_info(self, user: str, tinker_path: str) -> WeightsInfo:
        """What loading the checkpoint at tinker_path needs (the caller's, or a published one)."""
        record = self.repo.get_checkpoint(
            self.weights.resolve(user, tinker_path, param="tinker_path")
        )
        if record is None:
            raise NotFound(f"checkpoint {tinker_path} not found", param="tinker_path")
        lora = record.lora_config
        return WeightsInfo(
            base_model=record.base_model,
            is_lora=lora is not None,
            lora_rank=lora.rank if lora is not None else None,
            train_unembed=lora.train_unembed if lora is not None else None,
        )

    def _listed(
        self, model_id: str | None, *, owner: str | None = None, public_only: bool = False
    ) -> list[tuple[NameRecord, CheckpointRecord]]:
        """Written, unexpired names (of one run, or all the owner's), newest first."""
        now = time.time()
        found = []
        for name in self.registry.all(NameRecord, owner):
            if (model_id is not None and name.model_id != model_id) or (
                public_only and not name.public
            ):
                continue
            if name.expires_at is not None and name.expires_at <= now:
                continue
            state, checkpoint = self._state(name)
            if state == WRITTEN:
                assert checkpoint is not None
                found.append((name, checkpoint))
        found.sort(key=lambda nc: (nc[1].created_at, nc[0].path), reverse=True)
        return found

    def _state(self, name: NameRecord) -> tuple[str, CheckpointRecord | None]:
        """Whether the name's checkpoint is written (and which), still pending, or failed
        (or deleted underneath)."""
        checkpoint_id = name.checkpoint_id
        if checkpoint_id is None:
            future = self.registry.find(FutureRecord, name.future_id)
            op = self.repo.get_operation(future.operation_id or "") if future else None
            if op is None or op.status == OperationStatus.FAILED:
                return FAILED, None
            if op.status != OperationStatus.COMPLETED:
                return PENDING, None
            assert isinstance(op.output, CheckpointOutput), f"{op.id} wrote no checkpoint"
            checkpoint_id = op.output.checkpoint.id
        checkpoint = self.repo.get_checkpoint(checkpoint_id)
        return (WRITTEN, checkpoint) if checkpoint is not None else (FAILED, None)

    def _view(self, name: NameRecord, checkpoint: CheckpointRecord) -> CheckpointView:
        _, segment, short = name.path[len("tinker://") :].split("/")
        return CheckpointView(
            checkpoint_id=f"{segment}/{short}",
            checkpoint_type=name.checkpoint_type,
            time=checkpoint.created_at,
            tinker_path=name.path,
            size_bytes=self.checkpoints.size_bytes(checkpoint),
            public=name.public,
            user_metadata=name.user_metadata,
            expires_at=name.expires_at,
        )

    # ------------------------------------------------------------ changing a name

    def delete(self, user: str, model_id: str, checkpoint_id: str) -> None:
        """The name, and its checkpoint's record and files. A save still running is refused
        (Conflict): its checkpoint would appear after the name is gone."""
        name = self._name(user, model_id, checkpoint_id)
        state, checkpoint = self._state(name)
        if state == PENDING:
            raise Conflict(
                f"checkpoint {name.path} is still being written; delete it once saved",
                param="checkpoint_id",
            )
        if checkpoint is not None:
            self.checkpoints.delete(name.user, checkpoint.id, param="checkpoint_id")
        self.registry.delete(NameRecord, name.path)

    def set_ttl(
        self, user: str, model_id: str, checkpoint_id: str, ttl_seconds: int | None
    ) -> NameRecord:
        """Expire the name ttl_seconds from now; None: never."""
        if ttl_seconds is not None and not 1 <= ttl_seconds <= MAX_TTL_S:
            raise InvalidRequest(
                f"ttl_seconds must be between 1 and {MAX_TTL_S} (10 years), or null",
                param="ttl_seconds",
            )
        name = self._name(user, model_id, checkpoint_id)
        expires = None if ttl_seconds is None else time.time() + ttl_seconds
        updated = dataclasses.replace(name, expires_at=expires)
        self.registry.put(updated)
        return updated

    def publish(self, user: str, model_id: str, checkpoint_id: str, public: bool) -> NameRecord:
        """Make the name loadable by every user, or only its owner again; idempotent."""
        name = self._name(user, model_id, checkpoint_id)
        updated = dataclasses.replace(name, public=public)
        if updated != name:
            self.registry.put(updated)
        return updated

    def _name(self, user: str, model_id: str, checkpoint_id: str) -> NameRecord:
        """The caller's unexpired name `checkpoint_id` ("weights/NAME") of run model_id."""
        self._run(user, model_id)
        segment, _, short = checkpoint_id.partition("/")
        if not short or "/" in short or segment not in (*SEGMENTS, "external_weights"):
            raise InvalidRequest(
                f"checkpoint id {checkpoint_id!r} is not weights/NAME or sampler_weights/NAME",
                param="checkpoint_id",
            )
        path = f"tinker://{model_id}/{checkpoint_id}"
        name = self.registry.find(NameRecord, path, user)
        if name is None or (name.expires_at is not None and name.expires_at <= time.time()):
            raise NotFound(f"checkpoint {path} not found", param="checkpoint_id")
        return name

    # ------------------------------------------------------------ expiry

    def sweep(self, now: float) -> list[str]:
        """Delete every name whose TTL passed, with its checkpoint; returns their paths. A
        name whose save still runs, or whose checkpoint a session is loading, waits for a
        later sweep."""
        swept = []
        for name in self.registry.all(NameRecord):
            if name.expires_at is None or name.expires_at > now:
                continue
            state, checkpoint = self._state(name)
            if state == PENDING:
                continue
            current = self.registry.find(NameRecord, name.path)
            if current is None or current.future_id != name.future_id:
                continue  # deleted or saved again since the scan
            try:
                if checkpoint is not None:
                    self.checkpoints.delete(name.user, checkpoint.id, param="checkpoint_id")
            except Conflict:
                continue  # a session is loading it: the next sweep deletes it
            except NotFound:
                pass  # deleted underneath since the scan
            self.registry.delete(NameRecord, name.path)
            log.info("checkpoint %s expired and was deleted", name.path)
            swept.append(name.path)
        return swept
