"""Tinker client sessions and training runs over posttrain's resources and sessions.

A client session is one SDK process: it owns the runs and samplers it creates, and its
heartbeats keep their model resources alive (the resources' inactivity expiry moves on, as an
operation would move it). A run is one LoRA training session on a model resource the dialect
finds or provisions for (user, base model): one with a free slot and a generator, else a new
one, so a user's runs and samplers on one base model share its weights. Only resources the
dialect provisioned are used: one the user made on the Together surface stays theirs alone.

Every run request that becomes an operation goes through OperationService.submit, keyed by the
run's seq_id: a retried POST (the SDK resends a failed POST with a new X-Idempotency-Key but
the same seq_id) answers the first one's future and never runs twice.

Imports: service, store, types.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from concurrent import futures
from typing import Any

from posttrain.errors import InvalidRequest, posttrainError
from posttrain.records import CheckpointRecord, ResourceRecord, SessionRecord
from posttrain.service.ids import new_id
from posttrain.service.lifecycle.resources import ResourceService
from posttrain.service.lifecycle.sessions import SessionService
from posttrain.service.operations.submit import OperationService
from posttrain.service.tinker.records import (
    ClientRecord,
    FutureExtra,
    FutureRecord,
    ProvisionedRecord,
    RunRecord,
    SamplerRecord,
)
from posttrain.service.tinker.registry import Registry
from posttrain.statuses import ResourceStatus, SessionStatus
from posttrain.store.repo import Repo
from posttrain.types import LoraConfig, OperationKind, OperationRequest

# Tinker's wire carries no LoRA alpha; this is the scale its peers use (SkyRL: 32), so a rank-r
# adapter's update is scaled by 32/r as in their runs.
LORA_ALPHA = 32
# A provisioned resource outlives its last request by this long; heartbeats move it on.
RESOURCE_IDLE_S = 3600
# How long finish waits for its sessions to stop (a long queue stops them later).
FINISH_WAIT_S = 30.0
# How long loading a state into a run waits for the run's earlier requests to finish.
DRAIN_S = 600.0
# The ids a user's objects are named under: the SDK derives a created-via-load run's id itself.
RUN_ID = "{client}:train:{seq}"


def fingerprint(request: OperationRequest) -> str:
    """The same request gives the same fingerprint: a retry with the same seq_id must match."""
    return hashlib.sha256(repr(request).encode()).hexdigest()


class TinkerRuns:
    def __init__(
        self,
        repo: Repo,
        registry: Registry,
        resources: ResourceService,
        sessions: SessionService,
        operations: OperationService,
    ) -> None:
        self.repo = repo
        self.registry = registry
        self.resources = resources
        self.sessions = sessions
        self.operations = operations

    # ------------------------------------------------------------ client sessions

    def create_client(
        self, user: str, tags: list[str], user_metadata: dict[str, Any] | None
    ) -> ClientRecord:
        now = time.time()
        record = ClientRecord(new_id("tc"), user, now, now, tags, user_metadata)
        self.registry.put(record)
        return record

    def heartbeat(self, user: str, client_id: str) -> bool:
        """Keep the client's resources alive; False once the client finished (the SDK stops
        its heartbeat on 410)."""
        client = self.registry.get(ClientRecord, client_id, user)
        if client.finished:
            return False
        for resource_id in self._resources_of(user, client_id):
            self.resources.touch(resource_id)
        return True

    def finish(self, user: str, client_id: str) -> None:
        """The SDK's close(): the client ends, and so do the posttrain sessions of its runs and
        samplers, once the requests it sent have run (a save it did not wait on is still
        written), freeing their adapter slots. Their records stay readable and every saved
        path stays usable: it names a checkpoint, which a new client loads into a new session.
        The resources stay loaded for the user's next client and expire when idle. Waits up to
        FINISH_WAIT_S for the sessions to stop; later ones stop when their queue has run."""
        client = self.registry.get(ClientRecord, client_id, user)
        self.registry.put(dataclasses.replace(client, finished=True))
        runs = [
            r.session_id for r in self.registry.all(RunRecord, user) if r.client_id == client_id
        ]
        samplers = [
            s.session_id
            for s in self.registry.all(SamplerRecord, user)
            if s.client_id == client_id and s.session_id is not None
        ]
        stopping = [self.sessions.stop_after_queued(user, sid) for sid in {*runs, *samplers}]
        futures.wait(stopping, timeout=FINISH_WAIT_S)

    def _resources_of(self, user: str, client_id: str) -> set[str]:
        runs = self.registry.all(RunRecord, user)
        return {run.resource_id for run in runs if run.client_id == client_id}

    # ------------------------------------------------------------ runs

    def create_run(
        self,
        user: str,
        client_id: str,
        model_seq_id: int,
        base_model: str,
        lora: LoraConfig,
        user_metadata: dict[str, Any] | None,
        resume_from: str | None = None,
        load_optimizer: bool | None = None,
        shared: bool = False,
    ) -> FutureRecord:
        """A run's session, set up before this returns (as SessionService.create waits); the
        future carries the model id, or the reason it failed. A retry of the same
        (client, model_seq_id) answers the first future."""
        self.registry.get(ClientRecord, client_id, user)
        model_id = RUN_ID.format(client=client_id, seq=model_seq_id)
        if (earlier := self.registry.seq_future(model_id, 0)) is not None:
            return self.registry.get(FutureRecord, earlier, user)
        future_type = "load_weights" if resume_from is not None else "create_model"
        future = FutureRecord(new_id("req"), user, future_type, time.time())
        if (claimed := self.registry.claim_seq(model_id, 0, user, future.id)) != future.id:
            return self.registry.get(FutureRecord, claimed, user)
        try:
            session = self.new_session(
                user, base_model, lora, model_id, resume_from, load_optimizer, shared
            )
        except posttrainError as exc:
            future = dataclasses.replace(future, error=exc.message)
            self.registry.put(future)
            return future
        assert session.lora_config is not None
        run = RunRecord(
            model_id=model_id,
            user=user,
            client_id=client_id,
            session_id=session.id,
            resource_id=session.resource_id,
            base_model=base_model,
            lora_rank=session.lora_config.rank,
            train_unembed=session.lora_config.train_unembed,
            created_at=time.time(),
            user_metadata=user_metadata,
        )
        self.registry.put(run)
        result: dict[str, Any] = {"model_id": model_id}
        future = dataclasses.replace(future, result=result, session_id=session.id)
        self.registry.put(future)
        return future

    def load_into_run(
        self,
        user: str,
        model_id: str,
        seq_id: int | None,
        checkpoint: CheckpointRecord,
        *,
        load_optimizer: bool,
        shared: bool,
    ) -> FutureRecord:
        """TrainingClient.load_state(_with_optimizer): the run goes on from `checkpoint`.

        The run's session is replaced by one resumed from the checkpoint, exactly as
        create_run resumes one (the same weights and, with `load_optimizer`, the same optimizer
        state; without, a fresh optimizer, as Tinker documents). The requests the run sent
        before this one finish on the old session first (the SDK sends this only after
        sending them), then the old session stops, freeing its adapter slot for the new one.
        Inflight samplers that followed the old session follow the new one. A retry of the
        same seq_id answers the first future."""
        if (earlier := self.registry.seq_future(model_id, seq_id)) is not None:
            return self.registry.get(FutureRecord, earlier, user)
        run = self.run(user, model_id)
        lora = checkpoint.lora_config
        assert lora is not None, f"a Tinker checkpoint {checkpoint.id} without a LoRA config"
        is_same = (checkpoint.base_model, lora.rank, lora.train_unembed) == (
            run.base_model,
            run.lora_rank,
            run.train_unembed,
        )
        if not is_same:
            raise InvalidRequest(
                f"the checkpoint holds a rank-{lora.rank} adapter of {checkpoint.base_model}"
                f" (train_unembed={lora.train_unembed}); run {model_id} trains a"
                f" rank-{run.lora_rank} adapter of {run.base_model}"
                f" (train_unembed={run.train_unembed})",
                param="path",
            )
        future = FutureRecord(new_id("req"), user, "load_weights", time.time())
        if (claimed := self.registry.claim_seq(model_id, seq_id, user, future.id)) != future.id:
            return self.registry.get(FutureRecord, claimed, user)
        try:
            self._drain(run.session_id)
            self.sessions.stop(user, run.session_id)
            session = self.new_session(
                user, run.base_model, lora, model_id, checkpoint.id, load_optimizer, shared
            )
        except posttrainError as exc:
            future = dataclasses.replace(future, error=exc.message)
            self.registry.put(future)
            return future
        self.registry.put(dataclasses.replace(run, session_id=session.id))
        for sampler in self.registry.all(SamplerRecord, user):
            if sampler.kind == "inflight" and sampler.session_id == run.session_id:
                self.registry.put(dataclasses.replace(sampler, session_id=session.id))
        result: dict[str, Any] = {"model_id": model_id}
        future = dataclasses.replace(future, result=result, session_id=session.id)
        self.registry.put(future)
        return future

    def _drain(self, session_id: str) -> None:
        """Wait until the session's operations have all finished."""
        deadline = time.time() + DRAIN_S
        while self.repo.unfinished_operations(session_id):
            if time.time() > deadline:
                raise InvalidRequest(
                    f"the run's earlier requests did not finish within {DRAIN_S:.0f} s;"
                    " nothing was loaded"
                )
            time.sleep(0.05)

    def run(self, user: str, model_id: str) -> RunRecord:
        return self.registry.get(RunRecord, model_id, user)

    def submit(
        self,
        user: str,
        model_id: str,
        seq_id: int | None,
        future_type: str,
        kind: OperationKind,
        request: OperationRequest,
        extra: FutureExtra | None = None,
    ) -> FutureRecord:
        """An operation on the run's session, as its request number seq_id."""
        run = self.run(user, model_id)
        return self.submit_on(
            user, model_id, run.session_id, seq_id, future_type, kind, request, extra
        )

    def submit_on(
        self,
        user: str,
        owner: str,
        session_id: str,
        seq_id: int | None,
        future_type: str,
        kind: OperationKind,
        request: OperationRequest,
        extra: FutureExtra | None = None,
    ) -> FutureRecord:
        """An operation on a posttrain session for the run or sampler `owner`, whose request
        number seq_id deduplicates retries."""
        if (earlier := self.registry.seq_future(owner, seq_id)) is not None:
            return self.registry.get(FutureRecord, earlier, user)
        session = self.sessions.get(user, session_id)
        key = None if seq_id is None else f"tinker-{owner}-{seq_id}"
        op = self.operations.submit(
            user,
            session,
            kind,
            idempotency_key=key,
            fingerprint=fingerprint(request),
            request=request,
        )
        future = FutureRecord(
            id=f"req-{op.id}",
            user=user,
            type=future_type,
            created_at=time.time(),
            session_id=session_id,
            operation_id=op.id,
            operation_kind=kind.value,
            extra=extra or {},
        )
        self.registry.put(future)
        self.registry.claim_seq(owner, seq_id, user, future.id)
        return future

    # ------------------------------------------------------------ provisioning

    def new_session(
        self,
        user: str,
        base_model: str,
        lora: LoraConfig | None,
        display_name: str,
        resume_from: str | None,
        load_optimizer: bool | None,
        shared: bool = False,
    ) -> SessionRecord:
        """A RUNNING session for a run or a sampler; `lora` None: the checkpoint's adapter;
        `shared`: resume_from is another user's published checkpoint."""
        resource = self.resource_for(user, base_model)
        given = frozenset() if resume_from is not None else frozenset({"rank", "train_unembed"})
        session = self.sessions.create(
            user,
            resource_id=resource.id,
            lora=lora,
            display_name=display_name,
            metadata={},
            resume_from_checkpoint_id=resume_from,
            load_optimizer=load_optimizer,
            lora_given=given,
            resume_shared=shared,
        )
        session = self._settled(user, session)
        if session.status != SessionStatus.RUNNING:
            message = session.error.message if session.error else f"session is {session.status}"
            raise InvalidRequest(f"could not start a training session: {message}")
        return session

    def _settled(self, user: str, session: SessionRecord) -> SessionRecord:
        deadline = time.time() + 120.0
        while session.status == SessionStatus.CREATING and time.time() < deadline:
            time.sleep(0.05)
            session = self.sessions.get(user, session.id)
        return session

    def provisioned(self, user: str, base_model: str) -> list[ResourceRecord]:
        """The READY resources this dialect provisioned for (user, base_model)."""
        ids = {
            p.id for p in self.registry.all(ProvisionedRecord, user) if p.base_model == base_model
        }
        return [r for r in self.resources.list(user, {ResourceStatus.READY.value}) if r.id in ids]

    def resource_for(self, user: str, base_model: str) -> ResourceRecord:
        """One of the dialect's READY resources for (user, base_model) with a free slot, else a
        new one (LoRA, one generator)."""
        self.resources.check_base_model(base_model)
        for record in self.provisioned(user, base_model):
            if self.free_slots(record.id) > 0:
                return record
        created = self.resources.create(
            user,
            base_model=base_model,
            lora_enabled=True,
            num_generator_replicas=1,
            inactive_timeout=RESOURCE_IDLE_S,
            muon_scaling=None,
        )
        self.registry.put(ProvisionedRecord(created.id, user, base_model, time.time()))
        deadline = time.time() + 300.0
        while created.status == ResourceStatus.CREATING and time.time() < deadline:
            time.sleep(0.05)
            created = self.resources.get(user, created.id)
        if created.status != ResourceStatus.READY:
            message = created.error.message if created.error else str(created.status)
            raise InvalidRequest(f"could not load base model {base_model}: {message}")
        return created

    def free_slots(self, resource_id: str) -> int:
        record = self.repo.get_resource(resource_id)
        assert record is not None
        held = [
            s
            for s in self.repo.sessions_of_resource(resource_id)
            if s.status in (SessionStatus.CREATING, SessionStatus.RUNNING, SessionStatus.STOPPING)
        ]
        return self.resources.session_capacity(record) - len(held)
