"""Deferred weights-sync: the publish mailbox of BACKGROUND_PUBLISH and PIPELINE (api.md 1.4.5,
2.4, 7.6).

A SYNCHRONOUS weights-sync runs at its place in the resource's FIFO like any operation and
completes once the generator serves the new weights. The deferred modes complete as soon as the
weights they publish are known, and the generator picks those weights up later:

- Ready. A weights-sync publishes the trainer's weights as of its place in the session's
  order, so it is ready once every operation of the session submitted before it that can change
  the trainer (anything but a sample or another deferred weights-sync) has finished. Usually
  that is at submit, even while a long sample runs.
- Completed. A ready deferred weights-sync completes at once: `weights_version` is the session's
  trainer_step, which becomes policy_state.target_weights_version, with pending_publish true.
- Published. BACKGROUND_PUBLISH lands between requests, at the operation's own place in the FIFO,
  so a sample submitted after the operation completed runs after the publish and uses the new
  version. PIPELINE lands sooner while a generation runs on the resource: its decode loop calls
  `publish_in_flight` between tokens, running sequences switch to the new weights at that token
  boundary and their policy_segments say where; with nothing generating, it lands at its FIFO
  place too. Publishing sets applied_weights_version; pending_publish stays true while another
  completed weights-sync of the session still waits.

A deferred weights-sync finishes through the scheduler's finish path
(service/operations/recording.py),
so the operation metrics count it like any other operation.

Every engine call here runs on the resource's worker thread (a FIFO job, or the decode loop
inside a sample job), so the engine never sees two threads. A session's deferred syncs publish
in submission order.

Imports: store, engine.interface.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

from posttrain.engine.interface import Engine
from posttrain.errors import SessionNotActive
from posttrain.records import OperationRecord
from posttrain.service.durability.durable_sessions import changed_parts
from posttrain.service.lifecycle import policy
from posttrain.service.operations.kinds import KINDS
from posttrain.service.operations.recording import OperationRecorder
from posttrain.statuses import OperationStatus, SessionStatus
from posttrain.store.repo import Repo
from posttrain.types import OperationKind, WeightsSyncOutput, WeightsSyncRequest, WeightSyncType

DEFERRED = frozenset({WeightSyncType.BACKGROUND_PUBLISH, WeightSyncType.PIPELINE})


@dataclass
class _Entry:
    """A deferred weights-sync not yet published."""

    op_id: str
    session_id: str
    mode: WeightSyncType
    ticket: int
    version: int | None = None  # set when the operation completes


@dataclass(frozen=True)
class Ticket:
    """An operation that can change its session's trainer, from enqueue until it finishes."""

    session_id: str
    number: int


def is_deferred(kind: OperationKind, request: object) -> bool:
    """A weights-sync that publishes in the background (the request's type follows `kind`)."""
    return isinstance(request, WeightsSyncRequest) and request.weight_sync_type in DEFERRED


class PublishMailbox:
    """Deferred weights-syncs per resource, and the operations they wait for."""

    def __init__(self, repo: Repo, engine: Engine, recorder: OperationRecorder) -> None:
        self.repo = repo
        self.engine = engine
        self.recorder = recorder
        # Reentrant: completing an entry reads the store while the mailbox is locked, and the
        # decode-loop hook may run while the same thread already holds it (never today, cheap).
        self._lock = threading.RLock()
        self._numbers = itertools.count()
        self._unfinished: dict[str, set[int]] = {}  # session -> tickets still queued or running
        self._entries: dict[str, list[_Entry]] = {}  # resource -> entries, submission order

    # ------------------------------------------------------------ submit side (any thread)

    def admit(self, op: OperationRecord) -> Ticket | None:
        """Register an operation being enqueued; a ticket when it can change the trainer."""
        with self._lock:
            number = next(self._numbers)
            if KINDS[op.kind].on_generator:
                return None
            self._unfinished.setdefault(op.session_id, set()).add(number)
            return Ticket(op.session_id, number)

    def post(self, resource_id: str, op: OperationRecord, mode: WeightSyncType) -> None:
        """A deferred weights-sync being enqueued: completes now if it is ready."""
        with self._lock:
            entry = _Entry(op.id, op.session_id, mode, next(self._numbers))
            self._entries.setdefault(resource_id, []).append(entry)
            self._complete_ready(resource_id)

    # ------------------------------------------------------------ worker side

    def release(self, resource_id: str, ticket: Ticket) -> None:
        """The ticket's operation finished: complete the weights-syncs that waited for it."""
        with self._lock:
            waiting = self._unfinished[ticket.session_id]
            waiting.discard(ticket.number)
            if not waiting:
                del self._unfinished[ticket.session_id]
            self._complete_ready(resource_id)

    def publish_in_flight(self, resource_id: str) -> None:
        """Decode-loop hook: publish ready PIPELINE entries now (a token boundary)."""
        with self._lock:
            entries = self._entries.get(resource_id)
            if not entries:
                return
            blocked: set[str] = set()  # sessions whose next entry cannot publish yet
            for entry in list(entries):
                if entry.session_id in blocked:
                    continue
                if entry.version is None or entry.mode != WeightSyncType.PIPELINE:
                    blocked.add(entry.session_id)
                    continue
                self._publish(resource_id, entry)

    def publish_at_place(self, resource_id: str, op_id: str) -> None:
        """The deferred weights-sync's FIFO job: publish now unless a decode loop already did;
        a sync whose session stopped publishes nothing and, if still PENDING, fails."""
        op = self.repo.get_operation(op_id)
        assert op is not None, f"queued operation {op_id} vanished from the store"
        session = self.repo.get_session(op.session_id)
        assert session is not None, f"operation {op_id} has no session"
        if session.status != SessionStatus.RUNNING:
            self.discard(resource_id, op_id)
            if op.status == OperationStatus.PENDING:
                stopped = SessionNotActive(f"session {session.id} is {session.status}")
                self.recorder.finish([(op, stopped)])
            return
        self.publish_in_order(resource_id, op_id)

    def fail(self, resource_id: str, op_id: str, exc: Exception) -> None:
        """The FIFO job's failure recorder: forget the entry; fail the sync if not completed."""
        self.discard(resource_id, op_id)
        self.recorder.fail_unfinished([op_id], exc)

    def publish_in_order(self, resource_id: str, op_id: str) -> None:
        """The deferred weights-sync's own FIFO place: every operation submitted before it has
        run, so it is ready; complete it if needed and publish it (unless already published)."""
        with self._lock:
            self._complete_ready(resource_id)
            entry = self._find(resource_id, op_id)
            if entry is None:
                return  # published in flight already
            assert entry.version is not None, f"weights-sync {op_id} not ready at its FIFO place"
            self._publish(resource_id, entry)

    def discard(self, resource_id: str, op_id: str) -> None:
        """Forget an entry whose session stopped."""
        with self._lock:
            entry = self._find(resource_id, op_id)
            if entry is not None:
                self._entries[resource_id].remove(entry)

    # ------------------------------------------------------------ internals (lock held)

    def _find(self, resource_id: str, op_id: str) -> _Entry | None:
        return next((e for e in self._entries.get(resource_id, []) if e.op_id == op_id), None)

    def _is_ready(self, entry: _Entry) -> bool:
        waiting = self._unfinished.get(entry.session_id, set())
        return not any(number < entry.ticket for number in waiting)

    def _complete_ready(self, resource_id: str) -> None:
        for entry in list(self._entries.get(resource_id, [])):
            if entry.version is None and self._is_ready(entry):
                self._complete(resource_id, entry)

    def _complete(self, resource_id: str, entry: _Entry) -> None:
        op = self.repo.get_operation(entry.op_id)
        assert op is not None, f"weights-sync {entry.op_id} vanished from the store"
        session = self.repo.get_session(entry.session_id)
        assert session is not None, f"weights-sync {entry.op_id} has no session"
        if op.status != OperationStatus.PENDING or session.status != SessionStatus.RUNNING:
            # Failed or stopping: its FIFO job records the outcome; nothing will publish.
            self._entries[resource_id].remove(entry)
            return
        version = session.policy_state.trainer_step
        entry.version = version
        now = time.time()
        self.repo.update_session(entry.session_id, lambda s: policy.targeted(s, version, now))
        self.recorder.finish(
            [(op, WeightsSyncOutput(weights_version=version))],
            {op.id: changed_parts(op.kind, None)},
        )

    def _publish(self, resource_id: str, entry: _Entry) -> None:
        assert entry.version is not None
        version = entry.version
        pipeline = entry.mode == WeightSyncType.PIPELINE
        self.engine.publish(resource_id, entry.session_id, version=version, mid_generation=pipeline)
        self._entries[resource_id].remove(entry)
        still_pending = any(
            e.session_id == entry.session_id and e.version is not None
            for e in self._entries[resource_id]
        )

        now = time.time()
        self.repo.update_session(
            entry.session_id,
            lambda s: policy.published(s, version, still_pending=still_pending, now=now),
        )
