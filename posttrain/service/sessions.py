"""Training sessions: create, ownership checks, update, stop.

Creating a session claims a LoRA adapter on the resource's model; that runs as a job on the
resource's worker so it never races a running step, and create waits for it so the session is
RUNNING by the SDK's first poll. Stopping fails the session's queued operations
(SESSION_NOT_ACTIVE, by the scheduler's status check) and releases the adapter.

Imports: store, engine.interface.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from concurrent.futures import TimeoutError as FutureTimeout

from posttrain.engine.interface import Engine
from posttrain.errors import InvalidRequest, NotFound
from posttrain.service.ids import new_id
from posttrain.service.resources import ResourceService
from posttrain.service.scheduler import Scheduler
from posttrain.store.repo import Repo
from posttrain.types import (
    SESSION_TERMINAL,
    ErrorInfo,
    LoraConfig,
    ResourceStatus,
    SessionErrorCode,
    SessionRecord,
    SessionStatus,
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
    ) -> SessionRecord:
        resource = self.resources.get(user, resource_id)
        if resource.status != ResourceStatus.READY:
            raise InvalidRequest(
                f"model resource {resource_id} is {resource.status}, not READY",
                param="model_resources_id",
            )
        if resume_from_checkpoint_id is not None:
            raise InvalidRequest(
                "resume_from_checkpoint_id is not supported yet", param="resume_from_checkpoint_id"
            )
        info = self.engine.model_info(resource.base_model)
        lora = lora or LoraConfig(seed=secrets.randbelow(2**31))
        if lora.rank > info.max_lora_rank:
            raise InvalidRequest(
                f"lora_config.rank {lora.rank} exceeds this server's maximum {info.max_lora_rank}",
                param="lora_config.rank",
            )
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
        )
        self.repo.put_session(record)
        setup = self.scheduler.run_job(resource_id, lambda: self._setup(record.id))
        try:
            setup.result(timeout=SETUP_WAIT_S)
        except FutureTimeout:
            pass
        except Exception:  # noqa: BLE001 - _setup recorded the error on the session
            pass
        return self.get(user, record.id)

    def _setup(self, session_id: str) -> None:
        """Worker thread: load the base model if needed and create the session's adapter."""
        session = self.repo.get_session(session_id)
        assert session is not None and session.lora_config is not None
        if session.status != SessionStatus.CREATING:
            return  # stopped before it was set up
        resource = self.repo.get_resource(session.resource_id)
        assert resource is not None
        try:
            self.resources.ensure_loaded(resource)
            self.engine.create_session(resource.id, session_id, session.lora_config)
        except Exception as exc:
            log.exception("session %s setup failed", session_id)
            error = ErrorInfo(SessionErrorCode.SESSION_FAILED.value, str(exc), time.time())
            self.repo.update_session(
                session_id,
                lambda s: dataclasses.replace(s, status=SessionStatus.ERROR, error=error),
            )
            raise
        self.repo.update_session(
            session_id,
            lambda s: dataclasses.replace(s, status=SessionStatus.RUNNING, updated_at=time.time()),
        )

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
        self.repo.update_session(
            session_id,
            lambda s: dataclasses.replace(s, status=SessionStatus.STOPPING, updated_at=time.time()),
        )

        def teardown() -> None:
            self.engine.drop_session(session.resource_id, session_id)
            self.repo.update_session(
                session_id,
                lambda s: dataclasses.replace(
                    s, status=SessionStatus.STOPPED, updated_at=time.time()
                ),
            )

        done = self.scheduler.run_job(session.resource_id, teardown)
        try:
            done.result(timeout=STOP_WAIT_S)
        except FutureTimeout:
            pass
        return self.get(user, session_id)

    def recover_after_restart(self) -> None:
        """Sessions that were alive when the process died lost their in-memory adapter and
        optimizer state: they end in ERROR saying so (their records and checkpoints remain)."""
        message = (
            "the server restarted; this session's in-memory training state was lost."
            " Resume from a training checkpoint in a new session."
        )
        for user_session in self.repo.all_sessions():
            if user_session.status in SESSION_TERMINAL:
                continue
            if user_session.status == SessionStatus.STOPPING:
                status, error = SessionStatus.STOPPED, None
            else:
                code = SessionErrorCode.SESSION_FAILED.value
                status, error = SessionStatus.ERROR, ErrorInfo(code, message, time.time())
            self.repo.update_session(
                user_session.id,
                lambda s, st=status, er=error: dataclasses.replace(s, status=st, error=er),
            )
