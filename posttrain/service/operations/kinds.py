"""The operation-kind table: per kind, how the service schedules and runs it, what durable
state it changes and what a restart does with it.

Its typed request and output come from types.OPERATION_TYPES (the store reads those too); the
api layer's half, api/kinds.py, adds the wire body and reply. Whoever needs to know something
about a kind reads it here instead of branching on the kind:

- `run`: the engine pass over a group of its operations (service/scheduling/scheduler.py): the
engine
  call, what it does to the session's record, and each member's output.
- `sharing`: how the resource worker groups queued operations of this kind into one engine
  pass (service/scheduling/worker.py). A kind that runs alone is a barrier: nothing is grouped
  across it.
- `on_generator`: it runs on the generator and leaves the trainer alone, so it may move to a
  generator lane (service/scheduling/worker.py) and a deferred weights-sync never waits for it
  (service/scheduling/publishing.py).
- `between_blocks`: it may run at a decode block boundary of a sample stream on the trainer's
  lane (service/scheduling/sample_streams.py), ahead of the stream's end, when no row of its session
  decodes: the training, weights-sync and checkpoint kinds (another session's training waits a
  block, not a generation; a session's own operations keep their order, so a weights-sync
  keeps its SYNCHRONOUS meaning for the samples before it). A sample joins the stream instead.
- `changes`: the parts of a session's durable state it changes
(service/durability/durable_sessions.py).
- `transition`: what it does to the session's step and policy versions: applied when it runs
  (`run`), and again when a full-weight session's journal is folded after a restart
  (service/durability/full_weight.py).
- `replay`: the engine call that runs one operation of it from its request, given the trainer's
  policy version when it ran: a pass of one runs it (`run`), and a restart runs it again from
  the kept request on a restored full-weight snapshot; None: it is not journaled (it changes
  nothing the snapshot holds).
- `snapshots`: a full-weight snapshot may follow it (each persist_every-th optimizer step).

Imports: engine.interface, store (for type checking only), types.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

from posttrain.engine.interface import Engine, LanedEngine
from posttrain.records import OperationRecord, SessionRecord
from posttrain.service.lifecycle import policy
from posttrain.types import (
    OPERATION_TYPES,
    CheckpointRequest,
    CustomForwardBackwardOutput,
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    OperationKind,
    OperationOutput,
    OperationRequest,
    OperationTypes,
    OptimStepOutput,
    OptimStepRequest,
    SampleOutput,
    SampleRequest,
    WeightsSyncOutput,
)

if TYPE_CHECKING:
    from posttrain.service.durability.checkpoints import CheckpointService
    from posttrain.service.durability.routed_experts import RoutedExpertsStore
    from posttrain.store.repo import Repo


class Sharing(Enum):
    ALONE = "alone"  # one operation per engine pass
    # Operations of other sessions (at most SchedulerConfig.max_batch): each session's
    # gradients accumulate in order, so two of one session never share a pass.
    ACROSS_SESSIONS = "across sessions"
    # Operations of any sessions, its own included (at most max_sample_rows sequences): it
    # changes no state.
    ANY = "any"


class InFlight(Protocol):
    """service/scheduling/publishing.py's PublishMailbox, as a sample pass on the trainer's lane
    sees it."""

    def publish_in_flight(self, resource_id: str) -> None: ...


class Runner(Protocol):
    """What a pass runs with: the scheduler's parts (service/scheduling/scheduler.py), read
    only (so the scheduler's own PublishMailbox serves as the InFlight it needs)."""

    @property
    def repo(self) -> Repo: ...
    @property
    def engine(self) -> Engine: ...
    @property
    def checkpoints(self) -> CheckpointService | None: ...
    @property
    def routed_experts(self) -> RoutedExpertsStore: ...
    @property
    def mailbox(self) -> InFlight: ...


@dataclass(frozen=True)
class Lane:
    """A generator lane's pass (service/scheduling/worker.py): the generator of lane `index` serves
    what was staged up to `fence`, the place of the group's samples in the resource's FIFO."""

    index: int
    fence: int


R = TypeVar("R")
Outcome = OperationOutput | Exception
# A group member ready to run: its RUNNING record, its session, its request.
Ready = tuple[OperationRecord, SessionRecord, OperationRequest]
# (runner, resource, the group's members, its generator lane; None: the trainer's lane)
# -> per member, in order, an output or an error.
Run = Callable[[Runner, str, list[Ready], Lane | None], list[Outcome]]
Transition = Callable[[SessionRecord, float], SessionRecord]
# (engine, session, request, trainer policy version when it first ran) -> None
Replay = Callable[[Engine, SessionRecord, OperationRequest, int], None]


@dataclass(frozen=True)
class KindRules:
    types: OperationTypes
    run: Run
    sharing: Sharing = Sharing.ALONE
    on_generator: bool = False
    between_blocks: bool = False
    # None: a request the caller does not hold (a deferred weights-sync's completion).
    changes: Callable[[OperationRequest | None], tuple[str, ...]] = lambda _: ()
    transition: Transition | None = None
    replay: Replay | None = None
    snapshots: bool = False


def _trains(request: OperationRequest | None) -> tuple[str, ...]:
    """A forward-backward changes the gradients unless it only scores (forward_only)."""
    scoring = isinstance(request, ForwardBackwardRequest) and request.forward_only
    return () if scoring else ("gradients",)


# ------------------------------------------------------------ runs: one engine pass each


def _requests(ready: list[Ready], cls: type[R]) -> list[tuple[str, R]]:
    """(session id, request) per member; the kind fixed the request type at the api edge."""
    pairs: list[tuple[str, R]] = []
    for _, session, request in ready:
        assert isinstance(request, cls), f"{type(request).__name__} is not {cls.__name__}"
        pairs.append((session.id, request))
    return pairs


def _run_forward_backward(
    runner: Runner, resource_id: str, ready: list[Ready], _: Lane | None
) -> list[Outcome]:
    items = _requests(ready, ForwardBackwardRequest)
    return list(runner.engine.forward_backward_batch(resource_id, items))


def _run_sample(
    runner: Runner, resource_id: str, ready: list[Ready], lane: Lane | None
) -> list[Outcome]:
    items = _requests(ready, SampleRequest)
    if lane is None:
        # The trainer's lane: between tokens, PIPELINE weights-syncs submitted meanwhile
        # publish in flight.
        results = runner.engine.sample_batch(
            resource_id, items, between_tokens=lambda: runner.mailbox.publish_in_flight(resource_id)
        )
    else:
        # A generator lane exists only where the generators run apart (generator_lanes() > 0):
        # publishes run on the trainer's lane and reach the running generation as staged
        # changes, at a token boundary (engine/hosts/replicas/engine.py).
        laned = cast(LanedEngine, runner.engine)
        results = laned.sample_batch(resource_id, items, fence=lane.fence, lane=lane.index)
    return [
        SampleOutput(runner.routed_experts.keyed(session.id, per_op))
        for (_, session, _), per_op in zip(ready, results, strict=True)
    ]


def _alone(output: Callable[[SessionRecord], OperationOutput]) -> Run:
    """The run of a journaled kind that runs alone: its `replay` call (the same call a restart
    replays), then its `transition` of the session's record; `output` reads the session after."""

    def run(runner: Runner, _: str, ready: list[Ready], __: Lane | None) -> list[Outcome]:
        ((op, session, request),) = ready
        rules = KINDS[op.kind]
        assert rules.replay is not None, f"{op.kind} has no engine call"
        rules.replay(runner.engine, session, request, session.policy_state.trainer_step)
        if (transition := rules.transition) is not None:
            now = time.time()
            session = runner.repo.update_session(session.id, lambda s: transition(s, now))
        return [output(session)]

    return run


def _run_checkpoint(
    runner: Runner, _resource_id: str, ready: list[Ready], _lane: Lane | None
) -> list[Outcome]:
    ((_, session, request),) = ready
    assert isinstance(request, CheckpointRequest), type(request).__name__
    assert runner.checkpoints is not None, "scheduler built without a CheckpointService"
    return [runner.checkpoints.save(session, request.type)]


# ------------------------------------------------------------ replays: one operation each


def _replay_forward_backward(
    engine: Engine, session: SessionRecord, request: OperationRequest, _: int
) -> None:
    assert isinstance(request, ForwardBackwardRequest), type(request).__name__
    (outcome,) = engine.forward_backward_batch(session.resource_id, [(session.id, request)])
    if isinstance(outcome, Exception):
        raise outcome


def _replay_custom_forward_backward(
    engine: Engine, session: SessionRecord, request: OperationRequest, _: int
) -> None:
    assert isinstance(request, CustomForwardBackwardRequest), type(request).__name__
    engine.custom_forward_backward(session.resource_id, session.id, request)


def _replay_optim_step(
    engine: Engine, session: SessionRecord, request: OperationRequest, _: int
) -> None:
    assert isinstance(request, OptimStepRequest), type(request).__name__
    engine.optim_step(session.resource_id, session.id, request)


def _replay_weights_sync(
    engine: Engine, session: SessionRecord, _: OperationRequest, version: int
) -> None:
    # SYNCHRONOUS when run: publish at this operation's place in the FIFO, and complete once
    # the generator serves it. The deferred modes never run here (service/scheduling/publishing.py).
    engine.publish(session.resource_id, session.id, version=version)


_TYPES = OPERATION_TYPES
KINDS: dict[OperationKind, KindRules] = {
    OperationKind.FORWARD_BACKWARD: KindRules(
        _TYPES[OperationKind.FORWARD_BACKWARD],
        _run_forward_backward,
        sharing=Sharing.ACROSS_SESSIONS,
        between_blocks=True,
        changes=_trains,
        replay=_replay_forward_backward,
    ),
    OperationKind.CUSTOM_FORWARD_BACKWARD: KindRules(
        _TYPES[OperationKind.CUSTOM_FORWARD_BACKWARD],
        _alone(lambda _: CustomForwardBackwardOutput()),
        between_blocks=True,
        changes=lambda _: ("gradients",),
        replay=_replay_custom_forward_backward,
    ),
    OperationKind.OPTIM_STEP: KindRules(
        _TYPES[OperationKind.OPTIM_STEP],
        _alone(lambda session: OptimStepOutput(step=session.step)),
        between_blocks=True,
        changes=lambda _: ("trainer", "optimizer", "gradients"),
        transition=policy.stepped,
        replay=_replay_optim_step,
        snapshots=True,
    ),
    OperationKind.WEIGHTS_SYNC: KindRules(
        _TYPES[OperationKind.WEIGHTS_SYNC],
        _alone(
            lambda session: WeightsSyncOutput(
                weights_version=session.policy_state.applied_weights_version
            )
        ),
        between_blocks=True,
        changes=lambda _: ("generator",),
        transition=policy.synced,
        replay=_replay_weights_sync,
    ),
    OperationKind.SAMPLE: KindRules(
        _TYPES[OperationKind.SAMPLE], _run_sample, sharing=Sharing.ANY, on_generator=True
    ),
    OperationKind.TRAINING_CHECKPOINT: KindRules(
        _TYPES[OperationKind.TRAINING_CHECKPOINT], _run_checkpoint, between_blocks=True
    ),
    OperationKind.INFERENCE_CHECKPOINT: KindRules(
        _TYPES[OperationKind.INFERENCE_CHECKPOINT],
        _run_checkpoint,
        between_blocks=True,
    ),
}
