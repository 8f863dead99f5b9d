"""Model resources: provisioning on the engine, status, expiry, stop.

A resource is READY once its base model is loaded. Loading runs as the first job on the
resource's worker; create waits a little for it so that small models come back READY at once
(the SDK's first poll then succeeds without a 10 s sleep), and larger ones report CREATING.

Imports: store, engine.interface.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout

from posttrain.config import ServerConfig
from posttrain.engine.interface import Engine, ModelInfo
from posttrain.errors import InvalidRequest, NotFound
from posttrain.records import ErrorInfo, ResourceRecord
from posttrain.service.ids import new_id
from posttrain.service.scheduling.scheduler import Scheduler
from posttrain.statuses import SESSION_TERMINAL, ResourceErrorCode, ResourceStatus
from posttrain.store.repo import Repo
from posttrain.types import MuonScaling

# How long create waits for the model to load before answering CREATING.
READY_WAIT_S = 30.0
MAX_INACTIVE_TIMEOUT_S = 86400


class ResourceService:
    def __init__(
        self, config: ServerConfig, repo: Repo, engine: Engine, scheduler: Scheduler
    ) -> None:
        self.config = config
        self.repo = repo
        self.engine = engine
        self.scheduler = scheduler
        self.base_models = {spec.id for spec in config.models}

    def supported_models(self) -> list[tuple[str, ModelInfo]]:
        return [(spec.id, self.model_info(spec.id)) for spec in self.config.models]

    def model_info(self, base_model: str) -> ModelInfo:
        """The engine's limits of a served base model, and the directory its tokenizer loads
        from: the one the engine loads the model from (ServerConfig.models)."""
        self.check_base_model(base_model)
        path = next(spec.path for spec in self.config.models if spec.id == base_model)
        return dataclasses.replace(self.engine.model_info(base_model), tokenizer_dir=path)

    def device_name(self) -> str:
        """The device the engine resolved (`cpu`, `NVIDIA H200`), not the configured `auto`."""
        return self.engine.device_name()

    def create(
        self,
        user: str,
        *,
        base_model: str,
        lora_enabled: bool,
        num_generator_replicas: int,
        inactive_timeout: int,
        muon_scaling: MuonScaling | None,
    ) -> ResourceRecord:
        self.check_base_model(base_model)
        self.check_inactive_timeout(inactive_timeout)
        self.check_generator_replicas(num_generator_replicas)
        if num_generator_replicas > 1 and self.config.engine.generators == "inline":
            # Honest counts: an inline generator is one, on the trainer's model, so a resource
            # gets the replicas it asks for or is refused (nothing is created).
            raise InvalidRequest(
                f"compute_config.num_generator_replicas {num_generator_replicas}: this server"
                " runs one inline generator per model resource; ask for 1, or start it with"
                " --generators process (or --generators vllm) for replicas",
                param="compute_config.num_generator_replicas",
            )
        now = time.time()
        record = ResourceRecord(
            id=new_id("mr"),
            base_model=base_model,
            created_by=user,
            created_at=now,
            updated_at=now,
            status=ResourceStatus.CREATING,
            lora_enabled=lora_enabled,
            num_generator_replicas=num_generator_replicas,
            gpu_type=self.device_name(),
            inactive_timeout=inactive_timeout,
            muon_scaling=muon_scaling,
        )
        self.repo.put_resource(record)
        self._provision_on_worker(record.id)
        return self.get(user, record.id)

    def _provision_on_worker(self, resource_id: str) -> None:
        """Queue the model load; wait a little for it (a failure is recorded on the resource
        by `_provisioning_failed`, the job's failure recorder)."""
        loading = self.scheduler.run_job(
            resource_id,
            lambda: self._provision(resource_id),
            lambda exc: self._provisioning_failed(resource_id, exc),
        )
        try:
            loading.result(timeout=READY_WAIT_S)
        except FutureTimeout:
            pass  # still loading: the resource reports CREATING

    def _provision(self, resource_id: str) -> None:
        record = self.repo.get_resource(resource_id)
        assert record is not None, f"resource {resource_id} vanished before provisioning"
        self.ensure_loaded(record)
        now = time.time()
        self.repo.update_resource(
            resource_id,
            lambda r: dataclasses.replace(
                r,
                status=ResourceStatus.READY,
                updated_at=now,
                expires_at=now + r.inactive_timeout,
            ),
        )

    def _provisioning_failed(self, resource_id: str, exc: Exception) -> None:
        error = ErrorInfo(ResourceErrorCode.PROVISIONING_FAILED, str(exc), time.time())
        self.repo.update_resource(
            resource_id,
            lambda r: dataclasses.replace(r, status=ResourceStatus.ERROR, error=error),
        )

    def check_base_model(self, base_model: str) -> None:
        if base_model not in self.base_models:
            known = ", ".join(sorted(self.base_models))
            raise InvalidRequest(
                f"base_model {base_model!r} is not supported; supported: {known}",
                param="base_model",
            )

    def check_inactive_timeout(self, seconds: int) -> None:
        """api.md 1.2: 300-86400 s; the lower bound is config.min_inactive_timeout_s."""
        low = self.config.min_inactive_timeout_s
        if not low <= seconds <= MAX_INACTIVE_TIMEOUT_S:
            raise InvalidRequest(
                f"inactive_timeout {seconds} is outside [{low}, {MAX_INACTIVE_TIMEOUT_S}] seconds",
                param="inactive_timeout",
            )

    def check_generator_replicas(self, replicas: int) -> None:
        """At most the server's --max-generator-replicas (each may be a process of its own)."""
        bound = self.config.engine.max_generator_replicas
        if replicas > bound:
            raise InvalidRequest(
                f"compute_config.num_generator_replicas {replicas} is above this server's bound"
                f" of {bound} (posttrain serve --max-generator-replicas)",
                param="compute_config.num_generator_replicas",
            )

    def session_capacity(self, record: ResourceRecord) -> int:
        """Sessions the resource hosts at once: one on a full-weight resource (api.md 1.2)."""
        return self.config.engine.max_sessions_per_resource if record.lora_enabled else 1

    def ensure_loaded(self, record: ResourceRecord) -> None:
        """Load the base model if this process has not yet (after a restart). Worker thread."""
        self.engine.load_resource(
            record.id,
            record.base_model,
            muon_scaling=record.muon_scaling,
            generator_replicas=record.num_generator_replicas,
        )

    def get(self, user: str, resource_id: str) -> ResourceRecord:
        record = self.repo.get_resource(resource_id)
        if record is None or record.created_by != user:
            raise NotFound(f"model resource {resource_id} not found", param="model_resources_id")
        return record

    def list(self, user: str, statuses: set[str] | None) -> list[ResourceRecord]:
        records = self.repo.list_resources(user)
        return [r for r in records if statuses is None or r.status.value in statuses]

    def touch(self, resource_id: str) -> None:
        """Activity: an operation was submitted; expiry moves to now + inactive_timeout.

        Only a READY resource has an expiry (a stopped one keeps expires_at None)."""
        now = time.time()

        def extend(r: ResourceRecord) -> ResourceRecord:
            if r.status != ResourceStatus.READY:
                return r
            return dataclasses.replace(
                r, expires_at=max(r.expires_at or 0.0, now + r.inactive_timeout)
            )

        self.repo.update_resource(resource_id, extend)

    def extend_expiry(self, user: str, resource_id: str, seconds: int) -> ResourceRecord:
        record = self.get(user, resource_id)
        if record.status != ResourceStatus.READY:
            raise InvalidRequest(
                f"model resource {resource_id} is {record.status}, not READY", param="seconds"
            )
        target = time.time() + seconds
        return self.repo.update_resource(
            resource_id,
            lambda r: dataclasses.replace(
                r, expires_at=max(r.expires_at or 0.0, target), updated_at=time.time()
            ),
        )

    def stop(
        self,
        user: str,
        resource_id: str,
        *,
        force: bool,
        stop_session: Callable[[str, str], object],
    ) -> ResourceRecord:
        """Stop the resource; with force, stop its active sessions first (`stop_session`,
        given the user and the session id)."""
        record = self.get(user, resource_id)
        if record.status in (ResourceStatus.STOPPED, ResourceStatus.STOPPING, ResourceStatus.ERROR):
            raise InvalidRequest(
                f"model resource {resource_id} is already {record.status}",
                param="model_resources_id",
            )
        active = [
            s
            for s in self.repo.sessions_of_resource(resource_id)
            if s.status not in SESSION_TERMINAL
        ]
        if active and not force:
            names = ", ".join(s.id for s in active)
            raise InvalidRequest(
                f"model resource {resource_id} has active sessions ({names}); stop them or"
                " pass force=true",
                param="force",
            )
        for session in active:
            stop_session(user, session.id)
        self.repo.update_resource(
            resource_id,
            lambda r: dataclasses.replace(
                r, status=ResourceStatus.STOPPING, updated_at=time.time()
            ),
        )

        def teardown() -> None:
            self.engine.unload_resource(resource_id)
            self.repo.update_resource(
                resource_id,
                lambda r: dataclasses.replace(
                    r, status=ResourceStatus.STOPPED, updated_at=time.time(), expires_at=None
                ),
            )

        done = self.scheduler.run_job(resource_id, teardown)
        try:
            done.result(timeout=5.0)
        except FutureTimeout:
            pass
        return self.get(user, resource_id)

    def recover_after_restart(self) -> None:
        """READY resources stay READY and load lazily; a half-provisioned one is provisioned
        again; one that was stopping is stopped."""
        for record in self.repo.all_resources():
            if record.status == ResourceStatus.STOPPING:
                self.repo.update_resource(
                    record.id,
                    lambda r: dataclasses.replace(
                        r, status=ResourceStatus.STOPPED, expires_at=None
                    ),
                )
            elif record.status in (ResourceStatus.CREATING, ResourceStatus.PENDING):
                # partial, not a lambda: each job keeps its own resource id from the loop.
                self.scheduler.run_job(
                    record.id,
                    functools.partial(self._provision, record.id),
                    functools.partial(self._provisioning_failed, record.id),
                )
