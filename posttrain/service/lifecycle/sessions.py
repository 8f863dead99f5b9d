"""Training sessions: create, ownership checks, update, stop.

Creating a session claims a slot on the resource (max_sessions_per_resource LoRA adapters, or
the one full-weight session) and creates its adapter or full-weight state; that runs as a job
on the resource's worker so it never races a running step, and create waits for it so the
session is RUNNING (or ERROR with RESOURCE_AT_CAPACITY) by the SDK's first poll. Stopping fails
the session's queued operations (SESSION_NOT_ACTIVE, by the scheduler's status check) and
releases the slot; stopping after the queued operations lets them run first.

Imports: store, engine.interface.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from posttrain.engine.interface import Engine
from posttrain.errors import InvalidRequest, NotFound
from posttrain.records import ErrorInfo, OperationRecord, ResourceRecord, SessionRecord
from posttrain.service.durability.checkpoints import ResumePlan, plan_resume
from posttrain.service.durability.durable_sessions import EVERYTHING
from posttrain.service.ids import new_id
from posttrain.service.lifecycle.resources import ResourceService
from posttrain.service.scheduling.scheduler import Scheduler
from posttrain.statuses import SESSION_TERMINAL, ResourceStatus, SessionErrorCode, SessionStatus
from posttrain.store.repo import Repo
from posttrain.types import (
    CheckpointType,
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    LoraConfig,
    OperationRequest,
)

log = logging.getLogger("posttrain.sessions")

SETUP_WAIT_S = 30.0
STOP_WAIT_S = 5.0


class SessionService:
    def __init__(
        self, repo: Repo, engine: Engine, scheduler: Scheduler, resources: ResourceService
    ) -> None:
        self.repo = repo
        self.engine = engine
        self.scheduler = scheduler
        self.resources = resources

    def get(self, user: str, session_id: str) -> SessionRecord:
        record = self.repo.get_session(session_id)
        if record is None or record.created_by != user:
            raise NotFound(f"training session {session_id} not found", param="session_id")
        return record

    def list(
        self, user: str, *, resource_id: str | None, statuses: set[str] | None
    ) -> list[SessionRecord]:
        return [
            s
            for s in self.repo.list_sessions(user)
            if (resource_id is None or s.resource_id == resource_id)
            and (statuses is None or s.status.value in statuses)
        ]

    def create(
        self,
        user: str,
        *,
        resource_id: str,
        lora: LoraConfig | None,
        display_name: str | None,
        metadata: dict[str, dict[str, str]],
        resume_from_checkpoint_id: str | None,
        load_optimizer: bool | None = None,
        lora_given: frozenset[str] = frozenset(),
        resume_shared: bool = False,
    ) -> SessionRecord:
        """`lora_given` names the lora_config fields the request set; a resumed session takes
        the others from its checkpoint (service/checkpoints.plan_resume)."""
        resource = self.resources.get(user, resource_id)
        if resource.status != ResourceStatus.READY:
            raise InvalidRequest(
                f"model resource {resource_id} is {resource.status}, not READY",
                param="model_resources_id",
            )
        if not resource.lora_enabled and lora_given:
            raise InvalidRequest(
                f"model resource {resource_id} trains full weights (lora_enabled false);"
                " lora_config applies only to LoRA resources",
                param="lora_config",
            )
        resume: ResumePlan | None = None
        if resume_from_checkpoint_id is not None:
            resume = plan_resume(
                self.repo,
                user,
                resume_from_checkpoint_id,
                resource=resource,
                load_optimizer=load_optimizer,
                lora=lora,
                lora_given=lora_given,
                shared=resume_shared,
            )
            lora = resume.lora
        info = self.engine.model_info(resource.base_model)
        if resource.lora_enabled:
            lora = lora or LoraConfig(seed=secrets.randbelow(2**31))
            if lora.rank > info.max_lora_rank:
                raise InvalidRequest(
                    f"lora_config.rank {lora.rank} exceeds this server's maximum"
                    f" {info.max_lora_rank}",
                    param="lora_config.rank",
                )
        else:
            lora = None  # a full-weight session trains every weight of the model
        now = time.time()
        record = SessionRecord(
            id=new_id("ts"),
            resource_id=resource_id,
            base_model=resource.base_model,
            created_by=user,
            created_at=now,
            updated_at=now,
            status=SessionStatus.CREATING,
            display_name=display_name,
            metadata=metadata,
            lora_config=lora,
            step=resume.step if resume is not None else 0,
            resume_from_checkpoint_id=resume_from_checkpoint_id,
        )
        self.repo.put_session(record)
        self.resources.touch(resource_id)  # activity: the resource's expiry moves on
        setup = self.scheduler.run_job(
            resource_id,
            lambda: self._setup(record.id, resume),
            lambda exc: self._setup_failed(resource_id, record.id, exc),
        )
        try:
            setup.result(timeout=SETUP_WAIT_S)
        except FutureTimeout:
            pass  # still setting up: the session reports CREATING
        return self.get(user, record.id)

    def _setup(self, session_id: str, resume: ResumePlan | None = None) -> None:
        """Worker thread: claim a slot on the resource, load the base model if needed and
        create the session's adapter (or full-weight state), then load the checkpoint it
        resumes from, if any. Without a free slot the session ends in ERROR with
        RESOURCE_AT_CAPACITY (api.md 7.13)."""
        session = self.repo.get_session(session_id)
        assert session is not None
        if session.status != SessionStatus.CREATING:
            return  # stopped before it was set up
        resource = self.repo.get_resource(session.resource_id)
        assert resource is not None
        if not self._claim_slot(resource, session_id):
            return
        self.resources.ensure_loaded(resource)
        self.engine.create_session(resource.id, session_id, session.lora_config)
        if resume is not None:
            self._load_checkpoint(resource.id, session_id, resume)
        if self.scheduler.durability is not None:  # a RUNNING session always has its state
            self.scheduler.durability.persist(session_id, EVERYTHING)
        self.repo.update_session(
            session_id,
            lambda s: dataclasses.replace(s, status=SessionStatus.RUNNING, updated_at=time.time()),
        )

    def _setup_failed(self, resource_id: str, session_id: str, exc: Exception) -> None:
        """The setup job's failure recorder (worker thread): drop what was created of the
        session and end it in ERROR with SESSION_FAILED."""
        self.engine.drop_session(resource_id, session_id)
        error = ErrorInfo(SessionErrorCode.SESSION_FAILED.value, str(exc), time.time())
        self.repo.update_session(
            session_id,
            lambda s: dataclasses.replace(s, status=SessionStatus.ERROR, error=error),
        )

    def _claim_slot(self, resource: ResourceRecord, session_id: str) -> bool:
        """True if the resource has room for one more session; otherwise mark it ERROR.

        Runs on the resource's worker, where every slot change (setup, stop teardown, expiry)
        also happens, so counting the store here cannot race. RUNNING and STOPPING sessions
        hold a slot (api.md 2.2); CREATING ones claim theirs in this same order."""
        capacity = self.resources.session_capacity(resource)
        holders = [
            s.id
            for s in self.repo.sessions_of_resource(resource.id)
            if s.id != session_id and s.status in (SessionStatus.RUNNING, SessionStatus.STOPPING)
        ]
        if len(holders) < capacity:
            return True
        kind = "LoRA" if resource.lora_enabled else "full-weight"
        message = (
            f"{kind} model resource {resource.id} is at capacity: it hosts {len(holders)} of"
            f" {capacity} sessions ({', '.join(holders)}); stop one or use another resource"
        )
        error = ErrorInfo(SessionErrorCode.RESOURCE_AT_CAPACITY.value, message, time.time())
        self.repo.update_session(
            session_id,
            lambda s: dataclasses.replace(
                s, status=SessionStatus.ERROR, error=error, updated_at=time.time()
            ),
        )
        return False

    def _load_checkpoint(self, resource_id: str, session_id: str, resume: ResumePlan) -> None:
        directory = Path(resume.checkpoint.path)
        if resume.checkpoint.type == CheckpointType.TRAINING:
            self.engine.load_training_state(
                resource_id, session_id, directory, load_optimizer=resume.load_optimizer
            )
        else:
            self.engine.load_adapter(resource_id, session_id, directory)

    def update(
        self,
        user: str,
        session_id: str,
        *,
        display_name: str | None,
        metadata: dict[str, dict[str, str]] | None,
    ) -> SessionRecord:
        self.get(user, session_id)

        def change(s: SessionRecord) -> SessionRecord:
            name = s.display_name if display_name is None else (display_name or None)
            merged = {k: dict(v) for k, v in s.metadata.items()}
            for group, fields in (metadata or {}).items():
                target = merged.setdefault(group, {})
                for key, value in fields.items():
                    # "" clears a sub-field (api.md 1.3 update).
                    if value == "":
                        target.pop(key, None)
                    else:
                        target[key] = value
            merged = {k: v for k, v in merged.items() if v}
            return dataclasses.replace(
                s, display_name=name, metadata=merged, updated_at=time.time()
            )

        return self.repo.update_session(session_id, change)

    def stop(self, user: str, session_id: str) -> SessionRecord:
        """Idempotent: a terminal session is returned unchanged."""
        session = self.get(user, session_id)
        if session.status in SESSION_TERMINAL or session.status == SessionStatus.STOPPING:
            return session
        self._mark_stopping(session_id)
        done = self.scheduler.run_job(session.resource_id, lambda: self._teardown(session))
        try:
            done.result(timeout=STOP_WAIT_S)
        except FutureTimeout:
            pass
        return self.get(user, session_id)

    def stop_after_queued(self, user: str, session_id: str) -> Future[object]:
        """Stop the session once the operations already queued on its resource have run (stop
        fails them): a job in the resource's order marks it STOPPING and tears it down, unless
        it stopped meanwhile. The future finishes when the job has run."""
        session = self.get(user, session_id)

        def stop_now() -> None:
            current = self.repo.get_session(session_id)
            if current is None or current.status != SessionStatus.RUNNING:
                return
            self._mark_stopping(session_id)
            self._teardown(session)

        return self.scheduler.run_job(session.resource_id, stop_now)

    def _mark_stopping(self, session_id: str) -> None:
        self.repo.update_session(
            session_id,
            lambda s: dataclasses.replace(s, status=SessionStatus.STOPPING, updated_at=time.time()),
        )

    def _teardown(self, session: SessionRecord) -> None:
        """On the resource's worker: drop the session's state and mark it STOPPED."""
        self.engine.drop_session(session.resource_id, session.id)
        self.scheduler.routed_experts.drop_session(session.id)
        if self.scheduler.durability is not None:
            self.scheduler.durability.forget(session.id)
        self.repo.update_session(
            session.id,
            lambda s: dataclasses.replace(s, status=SessionStatus.STOPPED, updated_at=time.time()),
        )

    def recover_after_restart(self) -> None:
        """Live sessions come back RUNNING with the state of their last completed operation
        (service/durability/durable_sessions.py): rebuilt on their resource's worker before any new
        operation runs there, a full-weight session's journal replayed from its kept requests.
        Sessions without kept state (set up when the process died) end in ERROR saying so; their
        records and checkpoints remain."""
        message = (
            "the server restarted; this session's in-memory training state was lost."
            " Resume from a training checkpoint in a new session."
        )
        durability = self.scheduler.durability
        for user_session in self.repo.all_sessions():
            if user_session.status in SESSION_TERMINAL:
                if durability is not None:
                    durability.forget(user_session.id)  # an expired session's leftovers
                continue
            if user_session.status == SessionStatus.STOPPING:
                status, error = SessionStatus.STOPPED, None
            elif (
                user_session.status == SessionStatus.RUNNING
                and durability is not None
                and durability.reconcile(user_session)
            ):
                sid, rid = user_session.id, user_session.resource_id
                # partial, not a lambda: each job keeps its own ids from the loop.
                self.scheduler.run_job(
                    rid,
                    functools.partial(self._restore, sid),
                    functools.partial(self._setup_failed, rid, sid),
                )
                continue
            else:
                code = SessionErrorCode.SESSION_FAILED.value
                status, error = SessionStatus.ERROR, ErrorInfo(code, message, time.time())
            self.repo.update_session(user_session.id, _ending(status, error))

    def recover_worker(self, resource_id: str) -> None:
        """Worker thread, right after the resource's worker process died and the operations in
        flight failed (Scheduler._fail_group): load the resource again and give each live
        session the state of its last completed operation, as after a server restart; a
        session without kept state ends in ERROR saying why."""
        durability = self.scheduler.durability
        for session in self.repo.sessions_of_resource(resource_id):
            if session.status != SessionStatus.RUNNING:
                continue
            try:
                if durability is None or not durability.reconcile(session):
                    raise RuntimeError(
                        f"the worker process of model resource {resource_id} died and this"
                        " session's training state was not kept. Resume from a training"
                        " checkpoint in a new session."
                    )
                self._restore(session.id)
            except Exception as exc:  # noqa: BLE001 - the failure is the session's record
                log.warning("session %s not restored after its worker died: %s", session.id, exc)
                self._setup_failed(resource_id, session.id, exc)

    def _restore(self, session_id: str) -> None:
        """Worker thread: load the resource, create the session and give it its kept state."""
        session = self.repo.get_session(session_id)
        assert session is not None and self.scheduler.durability is not None
        resource = self.repo.get_resource(session.resource_id)
        assert resource is not None
        self.resources.ensure_loaded(resource)
        self.engine.create_session(resource.id, session_id, session.lora_config)
        self.scheduler.durability.restore(session, self._resolved)

    def _resolved(self, op: OperationRecord, request: OperationRequest) -> OperationRequest:
        """A journaled request with routed_experts keys resolved as at submit
        (OperationService._prepared): a key the restart forgot fails the restore, naming it."""
        if isinstance(request, ForwardBackwardRequest | CustomForwardBackwardRequest):
            samples = self.scheduler.routed_experts.resolved(op.session_id, request.samples)
            request = dataclasses.replace(request, samples=samples)
        return request


def _ending(
    status: SessionStatus, error: ErrorInfo | None
) -> Callable[[SessionRecord], SessionRecord]:
    """The change that ends a session in `status` with `error`."""
    return lambda session: dataclasses.replace(session, status=status, error=error)
