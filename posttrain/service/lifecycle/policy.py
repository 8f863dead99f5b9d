"""Policy-state transitions (api.md 1.4.4, 1.4.5): pure functions from a session record to the
next, applied through Repo.update_session so each is one atomic read-modify-write.

trainer_step counts optimizer steps; target_weights_version is the version the last completed
weights-sync asked for; applied_weights_version is the version the generator serves;
pending_publish is true while a completed weights-sync has not been published yet.

Imports: types.
"""

from __future__ import annotations

import dataclasses

from posttrain.records import PolicyState, SessionRecord


def _with_policy(session: SessionRecord, policy: PolicyState, now: float) -> SessionRecord:
    return dataclasses.replace(session, policy_state=policy, updated_at=now)


def stepped(session: SessionRecord, now: float) -> SessionRecord:
    """An optim-step ran: the session's step and the trainer's version move on by one."""
    policy = dataclasses.replace(
        session.policy_state, trainer_step=session.policy_state.trainer_step + 1
    )
    return dataclasses.replace(_with_policy(session, policy, now), step=session.step + 1)


def synced(session: SessionRecord, now: float) -> SessionRecord:
    """A SYNCHRONOUS weights-sync ran: the generator serves the trainer's version, and nothing
    is left to publish."""
    version = session.policy_state.trainer_step
    policy = PolicyState(
        trainer_step=version,
        target_weights_version=version,
        applied_weights_version=version,
        pending_publish=False,
    )
    return _with_policy(session, policy, now)


def targeted(session: SessionRecord, version: int, now: float) -> SessionRecord:
    """A deferred weights-sync completed for `version`; the generator picks it up later."""
    policy = dataclasses.replace(
        session.policy_state, target_weights_version=version, pending_publish=True
    )
    return _with_policy(session, policy, now)


def published(
    session: SessionRecord, version: int, *, still_pending: bool, now: float
) -> SessionRecord:
    """A deferred weights-sync's `version` reached the generator; pending_publish stays true
    while another completed one of the session still waits (`still_pending`)."""
    policy = dataclasses.replace(
        session.policy_state, applied_weights_version=version, pending_publish=still_pending
    )
    return _with_policy(session, policy, now)
