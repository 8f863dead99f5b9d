"""Inactivity expiry of model resources (api.md 1.2 `inactive_timeout`, 2.1).

A READY resource's `expires_at` is last activity + inactive_timeout: creation, each session
create and each operation submit move it (ResourceService.touch), and extend-expiry moves it
on request. A daemon thread looks every `interval_s` for READY resources past their
`expires_at` and expires each one on its own worker (service/scheduling/scheduler.py), in line with
its jobs: the resource goes STOPPING, its CREATING and RUNNING sessions go EXPIRED, its state
leaves the engine, and it ends STOPPED. The same thread runs the other expiry sweeps it is
given (add_sweep: the Tinker surface's checkpoint names past their TTL).

A resource with an operation PENDING or RUNNING is never expired: that operation is activity,
so its expiry moves to now + inactive_timeout instead. The job on the worker checks again,
because an operation or an extend-expiry may arrive between the scan and the job.

Does not own explicit stops (service/lifecycle/resources.py) or the sessions' own stop
(sessions.py). Imports: store, engine.interface.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable

from posttrain.engine.interface import Engine
from posttrain.records import ErrorInfo, ResourceRecord, SessionRecord
from posttrain.service.lifecycle.resources import ResourceService
from posttrain.service.scheduling.scheduler import Scheduler
from posttrain.statuses import ResourceStatus, SessionErrorCode, SessionStatus
from posttrain.store.repo import Repo

log = logging.getLogger("posttrain.expiry")

CLOSE_WAIT_S = 5.0


class ExpiryReaper:
    """Finds expired READY resources and stops them; `scan` also runs without the thread."""

    def __init__(
        self,
        repo: Repo,
        engine: Engine,
        scheduler: Scheduler,
        resources: ResourceService,
        *,
        interval_s: float,
    ) -> None:
        self.repo = repo
        self.engine = engine
        self.scheduler = scheduler
        self.resources = resources
        self.interval_s = interval_s
        self._sweeps: list[Callable[[float], object]] = []
        self._queued: set[str] = set()
        self._queued_lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="expiry", daemon=True)

    def add_sweep(self, sweep: Callable[[float], object]) -> None:
        """Run sweep(now) on this thread after each scan (e.g. expired checkpoint names)."""
        self._sweeps.append(sweep)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=CLOSE_WAIT_S)

    def _loop(self) -> None:
        while not self._closed.wait(self.interval_s):
            for scan in (self.scan, *self._sweeps):
                try:
                    scan(time.time())
                except Exception:  # noqa: BLE001 - a loop boundary like the scheduler's
                    log.exception("expiry scan failed; retrying in %.1fs", self.interval_s)

    def scan(self, now: float) -> list[str]:
        """Queue an expiry job for each READY resource past its expires_at; returns their ids.

        A busy resource (an operation PENDING or RUNNING) has its expiry moved instead."""
        queued = []
        for record in self.repo.all_resources():
            if not _is_due(record, now):
                continue
            if self._has_unfinished_operations(record.id):
                self.resources.touch(record.id)
                continue
            with self._queued_lock:
                if record.id in self._queued:
                    continue
                self._queued.add(record.id)
            # partial, not a lambda: each job keeps its own resource id from the loop.
            self.scheduler.run_job(record.id, functools.partial(self._expire, record.id))
            queued.append(record.id)
        return queued

    def _has_unfinished_operations(self, resource_id: str) -> bool:
        return any(
            self.repo.unfinished_operations(session.id)
            for session in self.repo.sessions_of_resource(resource_id)
        )

    def _expire(self, resource_id: str) -> None:
        """Worker thread: no operation of this resource runs now; expire it if still due."""
        try:
            record = self.repo.get_resource(resource_id)
            if record is None or not _is_due(record, time.time()):
                return  # stopped, or extended since the scan
            if self._has_unfinished_operations(resource_id):
                return  # submitted since the scan; the submit moved expires_at as well
            self._stop_expired(record)
        finally:
            with self._queued_lock:
                self._queued.discard(resource_id)

    def _stop_expired(self, record: ResourceRecord) -> None:
        log.info(
            "model resource %s expired after %ds without activity",
            record.id,
            record.inactive_timeout,
        )
        self.repo.update_resource(
            record.id,
            lambda r: dataclasses.replace(
                r, status=ResourceStatus.STOPPING, updated_at=time.time()
            ),
        )
        for session in self.repo.sessions_of_resource(record.id):
            self.repo.update_session(session.id, _expired)
        # Drops every session's adapters and optimizer state with the model.
        self.engine.unload_resource(record.id)
        self.repo.update_resource(
            record.id,
            lambda r: dataclasses.replace(
                r, status=ResourceStatus.STOPPED, updated_at=time.time(), expires_at=None
            ),
        )


def _expired(session: SessionRecord) -> SessionRecord:
    """A RUNNING session becomes EXPIRED; one still CREATING never ran and ends in ERROR with
    RESOURCE_UNAVAILABLE (api.md 2.2). STOPPING ones finish their own stop; terminal ones stay."""
    now = time.time()
    if session.status == SessionStatus.RUNNING:
        return dataclasses.replace(session, status=SessionStatus.EXPIRED, updated_at=now)
    if session.status == SessionStatus.CREATING:
        message = "the model resource expired (inactive_timeout) before this session started"
        error = ErrorInfo(SessionErrorCode.RESOURCE_UNAVAILABLE.value, message, now)
        return dataclasses.replace(session, status=SessionStatus.ERROR, error=error, updated_at=now)
    return session


def _is_due(record: ResourceRecord, now: float) -> bool:
    return (
        record.status == ResourceStatus.READY
        and record.expires_at is not None
        and record.expires_at <= now
    )
