"""What an OpenAI-surface `model` names, as the posttrain session whose weights sample it.

A `model` is one of:
- a served base model id: a base-model sampler (a fresh rank-1 adapter whose update is zero,
  as a Tinker base sampler: service/tinker/weights.py) on the caller's resource of that model;
- a Together training session id: the session itself, so its latest published weights
  (weights-sync) answer, and evaluating never changes what it trains;
- an inference checkpoint id: a sampler that loads the checkpoint into an adapter of its own;
- a `tinker://MODEL_ID/sampler_weights/NAME` (or `.../weights/NAME`) path, the caller's or
  one another user published (Tinker's publish_checkpoint; the Together surface publishes
  none), resolved as Tinker's create_sampling_session resolves it; `<base>;<path>` also checks
  that the path was trained from `<base>`;
- a `tinker://MODEL_ID` training-run path: the run's own session, as an inflight sampler.

Samplers are kept as Tinker SamplerRecords keyed by (user, model), so a model name resolves to
one adapter slot however many requests name it, and one evicted for room (the least recently
used gives its slot up: TinkerWeights._make_room) is rebuilt from its checkpoint on its next
request.

Not here: tokenizing, sampling, the wire shapes (service/openai/completions.py, api/openai/).

Imports: service, types.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

from posttrain.errors import InvalidRequest, NotFound
from posttrain.service.durability.checkpoints import CheckpointService
from posttrain.service.lifecycle.resources import ResourceService
from posttrain.service.lifecycle.sessions import SessionService
from posttrain.service.tinker.records import RunRecord, SamplerRecord
from posttrain.service.tinker.service import TinkerService
from posttrain.statuses import SessionStatus
from posttrain.types import CheckpointType

CLIENT = "openai"  # the client id the surface's samplers carry (no Tinker client owns them)
TINKER = "tinker://"


@dataclass(frozen=True)
class Target:
    session_id: str
    base_model: str


@dataclass(frozen=True)
class ListedModel:
    id: str
    created: int
    owned_by: str


class ModelTargets:
    def __init__(
        self,
        resources: ResourceService,
        sessions: SessionService,
        checkpoints: CheckpointService,
        tinker: TinkerService,
    ) -> None:
        self.resources = resources
        self.sessions = sessions
        self.checkpoints = checkpoints
        self.tinker = tinker
        # Requests resolve on worker threads: two first requests naming one model must not
        # each build a sampler (the loser's session would hold an adapter slot for nothing).
        self._samplers_lock = threading.Lock()

    def resolve(self, user: str, model: str) -> Target:
        """The session that samples `model` for `user`; blocking (a new sampler loads its
        weights first). NotFound names `model` when nothing the caller may read has the name."""
        if model.startswith(TINKER) or ";" in model:
            return self._tinker(user, model)
        if model in {spec_id for spec_id, _ in self.resources.supported_models()}:
            return self._sampler(user, model, "base", model, None)
        session = self.sessions.repo.get_session(model)
        if session is not None and session.created_by == user:
            if session.status != SessionStatus.RUNNING:
                raise InvalidRequest(
                    f"training session {model} is {session.status}, not RUNNING", param="model"
                )
            return Target(session.id, session.base_model)
        checkpoint = self.checkpoints.repo.get_checkpoint(model)
        if checkpoint is not None and checkpoint.created_by == user:
            if checkpoint.type != CheckpointType.INFERENCE:
                raise InvalidRequest(
                    f"checkpoint {model} is {checkpoint.type}; name an inference checkpoint",
                    param="model",
                )
            return self._sampler(user, model, "path", checkpoint.base_model, checkpoint.id)
        raise NotFound(f"model {model!r} not found", param="model")

    def _tinker(self, user: str, model: str) -> Target:
        base, _, path = model.rpartition(";")
        if not path.startswith(TINKER):
            raise InvalidRequest(
                f"model {model!r}: {path!r} is not a tinker:// path", param="model"
            )
        if "/" not in path[len(TINKER) :]:  # a training-run path: the run's own session
            run = self.tinker.registry.find(RunRecord, path[len(TINKER) :], user)
            if run is None:
                raise NotFound(f"training run {path} not found", param="model")
            target = Target(run.session_id, run.base_model)
        else:
            weights = self.tinker.weights
            checkpoint_id, owner = weights.resolve_with_owner(user, path, param="model")
            checkpoint = self.checkpoints.get(owner, checkpoint_id)
            target = self._sampler(user, path, "path", checkpoint.base_model, checkpoint_id)
        if base and base != target.base_model:
            raise InvalidRequest(
                f"{path} was trained from {target.base_model}, not {base}", param="model"
            )
        return target

    def _sampler(
        self, user: str, model: str, kind: str, base_model: str, checkpoint_id: str | None
    ) -> Target:
        sampler_id = f"{CLIENT}:{user}:{model}"
        registry = self.tinker.registry
        with self._samplers_lock:
            if registry.find(SamplerRecord, sampler_id, user) is None:
                now = time.time()
                registry.put(
                    SamplerRecord(
                        id=sampler_id,
                        user=user,
                        client_id=CLIENT,
                        base_model=base_model,
                        kind=kind,
                        created_at=now,
                        model_path=model if model.startswith(TINKER) else None,
                        checkpoint_id=checkpoint_id,
                        last_used=now,
                    )
                )
            session_id = self.tinker.weights.sampler_session(user, sampler_id)
            sampler = registry.get(SamplerRecord, sampler_id, user)
            registry.put(dataclasses.replace(sampler, last_used=time.time()))
        return Target(session_id, base_model)

    def listed(self, user: str) -> list[ListedModel]:
        """What `user` may name: the served base models, their RUNNING training sessions, their
        inference checkpoints, and the written tinker:// paths they may read (their own, then
        those other users published, owned_by their owner)."""
        served = self.resources.supported_models()
        models = [ListedModel(spec_id, 0, "posttrain") for spec_id, _ in served]
        for session in self.sessions.list(
            user, resource_id=None, statuses={SessionStatus.RUNNING.value}
        ):
            models.append(ListedModel(session.id, int(session.created_at), user))
        inference = CheckpointType.INFERENCE.value
        for checkpoint in self.checkpoints.list(
            user, base_model=None, session_id=None, checkpoint_type=inference
        ):
            models.append(ListedModel(checkpoint.id, int(checkpoint.created_at), user))
        for name in self.tinker.checkpoints.readable_names(user):
            models.append(ListedModel(name.path, int(name.created_at), name.user))
        return models
