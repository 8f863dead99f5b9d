"""Named `tinker://` checkpoints and the samplers that serve saved or frozen weights.

A save answers a future at once and writes a posttrain checkpoint as an operation in the run's
order (so it holds the weights of that moment); its name maps to the checkpoint once the
operation finished. A path names `tinker://{model_id}/weights/{name}` (training state, with
the optimizer) or `.../sampler_weights/{name}` (weights only).

Samplers: a base-model sampler is a fresh rank-1 adapter (its B matrix starts at zero, so it
samples the base model) on the user's resource for that model; a saved path's sampler loads
the checkpoint into an adapter of its own; a snapshot (save_weights_and_get_sampling_client)
is an inference checkpoint written in the run's order, loaded into its own adapter when the
SDK first collects the future, so training that follows never reaches it; an inflight sampler
samples on the run's own session after a weights-sync.

Every sampler but an inflight one holds an adapter slot on the user's resource of its base
model (the base weights are shared). When the slots run out, the least recently used sampler
gives its slot up and is rebuilt from its checkpoint when it samples again (_make_room): a
loop that takes a snapshot every step keeps at most --max-sessions-per-resource adapters per
resource, never another copy of the base weights.

Imports: service, types.
"""

from __future__ import annotations

import dataclasses
import time

from posttrain.errors import InvalidRequest, NotFound
from posttrain.records import OperationRecord
from posttrain.service.durability.checkpoints import CheckpointService
from posttrain.service.tinker.records import (
    ClientRecord,
    FutureRecord,
    NameRecord,
    SamplerRecord,
)
from posttrain.service.tinker.registry import Registry
from posttrain.service.tinker.runs import TinkerRuns
from posttrain.statuses import OperationStatus, SessionStatus
from posttrain.types import (
    CheckpointOutput,
    CheckpointRequest,
    CheckpointType,
    LoraConfig,
    OperationKind,
    SampleRequest,
    WeightsSyncRequest,
    WeightSyncType,
)

SEGMENTS = {"weights": "training", "sampler_weights": "sampler"}
SAMPLER_ID = "{client}:sample:{seq}"
# A base-model sampler's adapter: the smallest rank, its update zero until trained (never).
BASE_ADAPTER = LoraConfig(rank=1, alpha=1, seed=0, train_unembed=False)


def parse_path(path: str) -> tuple[str, str, str]:
    """(model_id, segment, name) of `tinker://{model_id}/{segment}/{name}`."""
    if not path.startswith("tinker://"):
        raise InvalidRequest(f"path {path!r} is not a tinker:// path", param="path")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in SEGMENTS or not parts[0] or not parts[2]:
        raise InvalidRequest(
            f"path {path!r} is not tinker://MODEL_ID/weights/NAME or"
            " tinker://MODEL_ID/sampler_weights/NAME",
            param="path",
        )
    return parts[0], parts[1], parts[2]


class TinkerWeights:
    def __init__(self, registry: Registry, runs: TinkerRuns, checkpoints: CheckpointService):
        self.registry = registry
        self.runs = runs
        self.checkpoints = checkpoints

    # ------------------------------------------------------------ saving

    def save(
        self,
        user: str,
        model_id: str,
        seq_id: int | None,
        name: str,
        *,
        sampler: bool,
        ttl_seconds: int | None,
        overwrite: bool,
        user_metadata: dict[str, str] | None,
    ) -> FutureRecord:
        if (earlier := self.registry.seq_future(model_id, seq_id)) is not None:
            return self.registry.get(FutureRecord, earlier, user)
        segment = "sampler_weights" if sampler else "weights"
        if not name or "/" in name:
            raise InvalidRequest(
                f"checkpoint name {name!r} must be non-empty, without '/'", param="path"
            )
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise InvalidRequest("ttl_seconds must be positive", param="ttl_seconds")
        path = f"tinker://{model_id}/{segment}/{name}"
        self.runs.run(user, model_id)
        existing = self.registry.find(NameRecord, path)
        if existing is not None and not overwrite:
            raise InvalidRequest(
                f"checkpoint {path} exists; send overwrite=true to replace it", param="path"
            )
        kind = OperationKind.INFERENCE_CHECKPOINT if sampler else OperationKind.TRAINING_CHECKPOINT
        ctype = CheckpointType.INFERENCE if sampler else CheckpointType.TRAINING
        future = self.runs.submit(
            user,
            model_id,
            seq_id,
            "save_weights_for_sampler" if sampler else "save_weights",
            kind,
            CheckpointRequest(ctype),
            extra={"path": path},
        )
        now = time.time()
        self.registry.put(
            NameRecord(
                path=path,
                user=user,
                model_id=model_id,
                checkpoint_type=SEGMENTS[segment],
                future_id=future.id,
                created_at=now,
                expires_at=None if ttl_seconds is None else now + ttl_seconds,
                user_metadata=user_metadata,
            )
        )
        return future

    def resolve(self, user: str, path: str, param: str = "path") -> str:
        """The posttrain checkpoint id a path names (it must have been written)."""
        return self.resolve_with_owner(user, path, param)[0]

    def resolve_with_owner(self, user: str, path: str, param: str = "path") -> tuple[str, str]:
        """(checkpoint id, its owner) of a path `user` may read: theirs, or one published."""
        parse_path(path)
        record = self.registry.find(NameRecord, path)
        if record is None or (record.user != user and not record.public):
            raise NotFound(f"checkpoint {path} not found", param=param)
        if record.expires_at is not None and record.expires_at < time.time():
            raise NotFound(f"checkpoint {path} expired", param=param)
        if record.checkpoint_id is not None:
            return record.checkpoint_id, record.user
        future = self.registry.get(FutureRecord, record.future_id, record.user)
        op = self.runs.repo.get_operation(future.operation_id or "")
        if op is None or op.status != OperationStatus.COMPLETED:
            state = (
                "failed"
                if op is not None and op.status == OperationStatus.FAILED
                else "not written yet"
            )
            raise InvalidRequest(f"checkpoint {path} is {state}", param=param)
        assert isinstance(op.output, CheckpointOutput), f"{op.id} wrote no checkpoint"
        checkpoint_id = op.output.checkpoint.id
        self.registry.put(dataclasses.replace(record, checkpoint_id=checkpoint_id))
        return checkpoint_id, record.user

    # ------------------------------------------------------------ samplers

    def create_sampler(
        self,
        user: str,
        client_id: str,
        seq: int,
        *,
        base_model: str | None,
        model_path: str | None,
    ) -> SamplerRecord:
        self.registry.get(ClientRecord, client_id, user)
        sampler_id = SAMPLER_ID.format(client=client_id, seq=seq)
        if (existing := self.registry.find(SamplerRecord, sampler_id, user)) is not None:
            return existing  # a retried create
        if model_path is not None:
            checkpoint_id, owner = self.resolve_with_owner(user, model_path, param="model_path")
            checkpoint = self.checkpoints.get(owner, checkpoint_id)
            if base_model is not None and base_model != checkpoint.base_model:
                raise InvalidRequest(
                    f"model_path {model_path} was trained from {checkpoint.base_model},"
                    f" not {base_model}",
                    param="base_model",
                )
            session_id = self._sampler_session(
                user, checkpoint.base_model, sampler_id, checkpoint_id
            )
            kind, base = "path", checkpoint.base_model
        elif base_model is not None:
            checkpoint_id = None
            session_id = self._sampler_session(user, base_model, sampler_id, None)
            kind, base = "base", base_model
        else:
            raise InvalidRequest("send base_model or model_path", param="base_model")
        record = SamplerRecord(
            id=sampler_id,
            user=user,
            client_id=client_id,
            base_model=base,
            kind=kind,
            created_at=time.time(),
            session_id=session_id,
            model_path=model_path,
            checkpoint_id=checkpoint_id,
            last_used=time.time(),
        )
        self.registry.put(record)
        return record

    def save_for_sampler(
        self, user: str, model_id: str, seq_id: int | None, sampler_seq: int, kind: str
    ) -> FutureRecord:
        """An ephemeral sampler of the run's weights as of this request: frozen (snapshot) or
        following the run (inflight)."""
        if (earlier := self.registry.seq_future(model_id, seq_id)) is not None:
            return self.registry.get(FutureRecord, earlier, user)
        run = self.runs.run(user, model_id)
        sampler_id = SAMPLER_ID.format(client=run.client_id, seq=sampler_seq)
        if kind == "inflight":
            future = self.runs.submit(
                user,
                model_id,
                seq_id,
                "save_weights_for_sampler",
                OperationKind.WEIGHTS_SYNC,
                WeightsSyncRequest(WeightSyncType.SYNCHRONOUS),
                extra={"sampling_session_id": sampler_id},
            )
            session_id: str | None = run.session_id
        elif kind == "snapshot":
            future = self.runs.submit(
                user,
                model_id,
                seq_id,
                "save_weights_for_sampler",
                OperationKind.INFERENCE_CHECKPOINT,
                CheckpointRequest(CheckpointType.INFERENCE),
                extra={"sampling_session_id": sampler_id},
            )
            session_id = None
        else:
            raise InvalidRequest(f"kind {kind!r} is not snapshot or inflight", param="kind")
        self.registry.put(
            SamplerRecord(
                id=sampler_id,
                user=user,
                client_id=run.client_id,
                base_model=run.base_model,
                kind=kind,
                created_at=time.time(),
                session_id=session_id,
                checkpoint_future=future.id if session_id is None else None,
            )
        )
        return future

    def sampler_session(self, user: str, sampler_id: str) -> str:
        """The posttrain session a sampler samples on: a snapshot's is made once its checkpoint
        is written, and one that gave its slot up is rebuilt from its checkpoint."""
        sampler = self.registry.get(SamplerRecord, sampler_id, user)
        if sampler.session_id is not None and self._is_live(user, sampler.session_id):
            return sampler.session_id
        if sampler.kind == "inflight":
            raise InvalidRequest(
                f"sampling session {sampler_id} followed a training run that stopped",
                param="sampling_session_id",
            )
        checkpoint_id = sampler.checkpoint_id
        if sampler.kind == "snapshot" and checkpoint_id is None:
            future = self.registry.get(FutureRecord, sampler.checkpoint_future or "", user)
            op = self.runs.repo.get_operation(future.operation_id or "")
            if op is None or op.status != OperationStatus.COMPLETED:
                raise InvalidRequest(
                    f"sampling session {sampler_id}'s weights are not saved yet",
                    param="sampling_session_id",
                )
            assert isinstance(op.output, CheckpointOutput), f"{op.id} wrote no checkpoint"
            checkpoint_id = op.output.checkpoint.id
        session_id = self._sampler_session(user, sampler.base_model, sampler_id, checkpoint_id)
        self.registry.put(
            dataclasses.replace(
                sampler, session_id=session_id, checkpoint_id=checkpoint_id, last_used=time.time()
            )
        )
        return session_id

    def _is_live(self, user: str, session_id: str) -> bool:
        return self.runs.sessions.get(user, session_id).status == SessionStatus.RUNNING

    def _sampler_session(
        self, user: str, base_model: str, sampler_id: str, checkpoint_id: str | None
    ) -> str:
        """A session for a sampler: a fresh base adapter, or the checkpoint's weights (the
        caller resolved it: the user's own, or one its owner published)."""
        self._make_room(user, base_model)
        if checkpoint_id is None:
            session = self.runs.new_session(user, base_model, BASE_ADAPTER, sampler_id, None, None)
            return session.id
        checkpoint = self.runs.repo.get_checkpoint(checkpoint_id)
        shared = checkpoint is not None and checkpoint.created_by != user
        session = self.runs.new_session(
            user, base_model, None, sampler_id, checkpoint_id, False, shared
        )
        return session.id

    def _make_room(self, user: str, base_model: str) -> None:
        """Samplers cost an adapter slot each on the user's resources of base_model. When every
        slot is taken, the least recently used sampler gives its slot up (its record stays; it
        is rebuilt from its checkpoint if it samples again) rather than a new resource loading
        another copy of the base weights. Training runs and inflight samplers never give up
        theirs: without a sampler to evict, a new resource is provisioned."""
        resources = [r.id for r in self.runs.provisioned(user, base_model)]
        if not resources or any(self.runs.free_slots(r) > 0 for r in resources):
            return
        live = {
            s.id
            for r in resources
            for s in self.runs.repo.sessions_of_resource(r)
            if s.status == SessionStatus.RUNNING
        }
        candidates = [
            s
            for s in self.registry.all(SamplerRecord, user)
            if s.kind != "inflight" and s.session_id in live
        ]
        if not candidates:
            return
        victim = min(candidates, key=lambda s: s.last_used or s.created_at)
        assert victim.session_id is not None
        self.runs.sessions.stop(user, victim.session_id)
        self.registry.put(dataclasses.replace(victim, session_id=None))

    def finished(self, future: FutureRecord, op: OperationRecord) -> None:
        """A future's operation completed: a snapshot's sampler gets its session now, before
        the SDK (which waits on this future) sends its first sample."""
        sampler_id = future.extra.get("sampling_session_id")
        if sampler_id is not None and op.status == OperationStatus.COMPLETED:
            self.sampler_session(future.user, sampler_id)

    def sample(
        self, user: str, sampler_id: str, seq_id: int | None, request: SampleRequest
    ) -> FutureRecord:
        session_id = self.sampler_session(user, sampler_id)
        sampler = self.registry.get(SamplerRecord, sampler_id, user)
        self.registry.put(dataclasses.replace(sampler, last_used=time.time()))
        return self.runs.submit_on(
            user,
            sampler_id,
            session_id,
            seq_id,
            "sample",
            OperationKind.SAMPLE,
            request,
            extra={"num_samples": request.num_samples},
        )
