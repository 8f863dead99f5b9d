"""Service layer: business rules between the HTTP api and the engine.

build_services(config) wires the store, the engine and the scheduler, then recovers what a
previous process left in the data directory. wire_services and Services.recover_after_restart
are its two halves, for a caller with work in between (the api keeps an older server's kept
HTTP bodies as typed requests: api/routes/operations.py). Imports: store, engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from posttrain.config import ServerConfig
from posttrain.engine.build import build_engine, cpu_threads
from posttrain.engine.interface import Engine
from posttrain.service.dashboard import DashboardService
from posttrain.service.durability.checkpoints import CheckpointService
from posttrain.service.durability.durable_sessions import SessionDurability
from posttrain.service.durability.routed_experts import RoutedExpertsStore
from posttrain.service.lifecycle.expiry import ExpiryReaper
from posttrain.service.lifecycle.resources import ResourceService
from posttrain.service.lifecycle.sessions import SessionService
from posttrain.service.metrics import MetricsService
from posttrain.service.openai import OpenAIService
from posttrain.service.openai.completions import Completions
from posttrain.service.openai.targets import ModelTargets
from posttrain.service.operations.arrivals import Arrivals
from posttrain.service.operations.completion import CompletionWatch
from posttrain.service.operations.payloads import PayloadService
from posttrain.service.operations.polls import PollHold
from posttrain.service.operations.progress import SampleProgress
from posttrain.service.operations.submit import OperationService
from posttrain.service.scheduling.scheduler import Scheduler
from posttrain.service.signing import UrlSigner, signing_key
from posttrain.service.tinker.service import TinkerService, build_tinker
from posttrain.store.db import connect
from posttrain.store.repo import Repo

log = logging.getLogger("posttrain")


@dataclass
class Services:
    config: ServerConfig
    repo: Repo
    engine: Engine
    scheduler: Scheduler
    resources: ResourceService
    sessions: SessionService
    operations: OperationService
    payloads: PayloadService
    signer: UrlSigner
    checkpoints: CheckpointService
    expiry: ExpiryReaper
    dashboard: DashboardService
    metrics: MetricsService
    watch: CompletionWatch
    polls: PollHold
    tinker: TinkerService
    openai: OpenAIService

    @property
    def arrivals(self) -> Arrivals:
        return self.scheduler.arrivals

    def recover_after_restart(self) -> None:
        """First the sessions (an operation whose state reached the disk completes from it; a
        full-weight session's journal replays), then the operations that had not finished:
        they run again behind the sessions' restores."""
        self.sessions.recover_after_restart()
        self.operations.resume_after_restart()
        self.checkpoints.remove_partial()
        self.resources.recover_after_restart()
        self.expiry.start()

    def close(self) -> None:
        self.watch.close()
        self.scheduler.progress.close()
        self.expiry.close()
        self.scheduler.close()
        self.engine.close()  # after the threads that call it: no orphan worker processes


def build_services(config: ServerConfig) -> Services:
    """Every service over config.data_dir, recovered from what a previous process left there."""
    services = wire_services(config)
    services.recover_after_restart()
    return services


def wire_services(config: ServerConfig) -> Services:
    """Every service over config.data_dir, before any recovery (recover_after_restart)."""
    repo = Repo(connect(config.data_dir))
    watch = CompletionWatch()
    repo.add_operation_listener(watch.operation_written)
    progress = SampleProgress()  # watchers of running samples, closed as they finish
    repo.add_operation_listener(progress.operation_written)
    model_paths = {spec.id: spec.path for spec in config.models}
    engine = build_engine(config.engine, model_paths)
    signer = UrlSigner(signing_key(config.signing_key, config.data_dir), config.url_ttl_s)
    checkpoints = CheckpointService(config.data_dir, repo, engine, signer)
    routed_experts = RoutedExpertsStore(
        ttl_s=config.routed_experts.ttl_s,
        budget_bytes=config.routed_experts.memory_mib << 20,
        directory=config.data_dir / "routed_experts",
    )
    scheduler = Scheduler(
        repo,
        engine,
        checkpoints=checkpoints,
        limits=config.scheduler,
        routed_experts=routed_experts,
        durability=SessionDurability(
            config.data_dir, repo, engine, persist_every=config.persist_every
        ),
        progress=progress,
    )
    resources = ResourceService(config, repo, engine, scheduler)
    sessions = SessionService(repo, engine, scheduler, resources)
    operations = OperationService(repo, scheduler, sessions, resources, config.limits)
    payloads = PayloadService(config.data_dir, repo, sessions, signer)
    expiry = ExpiryReaper(
        repo, engine, scheduler, resources, interval_s=config.expiry_check_interval_s
    )
    scheduler.on_worker_lost = sessions.recover_worker
    tinker = build_tinker(repo, resources, sessions, operations, checkpoints)
    expiry.add_sweep(tinker.checkpoints.sweep)  # checkpoint names past their TTL
    polls = PollHold(watch, operations, hold_s=config.poll_hold_seconds)
    targets = ModelTargets(resources, sessions, checkpoints, tinker)
    completions = Completions(targets, resources, sessions, operations, watch, scheduler.progress)
    openai = OpenAIService(targets, completions)
    return Services(
        config,
        repo,
        engine,
        scheduler,
        resources,
        sessions,
        operations,
        payloads,
        signer,
        checkpoints,
        expiry,
        dashboard=DashboardService(repo, scheduler.queue_depth),
        metrics=MetricsService(
            repo,
            scheduler.metrics,
            scheduler.queue_depth,
            busy_seconds=scheduler.busy_seconds,
            held_polls=watch.waiting,
            unanswered_samples=scheduler.arrivals.unanswered,
            cpu_threads=cpu_threads(config.engine, model_paths),
        ),
        watch=watch,
        polls=polls,
        tinker=tinker,
        openai=openai,
    )
