"""The Tinker dialect's services, wired over the one set of posttrain services.

Imports: service, store.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.service.durability.checkpoints import CheckpointService
from posttrain.service.lifecycle.resources import ResourceService
from posttrain.service.lifecycle.sessions import SessionService
from posttrain.service.operations.submit import OperationService
from posttrain.service.tinker.checkpoints import TinkerCheckpoints
from posttrain.service.tinker.records import FutureRecord
from posttrain.service.tinker.registry import Registry
from posttrain.service.tinker.runs import TinkerRuns
from posttrain.service.tinker.weights import TinkerWeights
from posttrain.store.dialect import DialectObjects
from posttrain.store.repo import Repo


@dataclass
class TinkerService:
    registry: Registry
    runs: TinkerRuns
    weights: TinkerWeights
    checkpoints: TinkerCheckpoints

    def future(self, user: str, request_id: str) -> FutureRecord:
        return self.registry.get(FutureRecord, request_id, user)


def build_tinker(
    repo: Repo,
    resources: ResourceService,
    sessions: SessionService,
    operations: OperationService,
    checkpoints: CheckpointService,
) -> TinkerService:
    registry = Registry(DialectObjects(repo))
    runs = TinkerRuns(repo, registry, resources, sessions, operations)
    weights = TinkerWeights(registry, runs, checkpoints)
    return TinkerService(
        registry, runs, weights, TinkerCheckpoints(registry, runs, weights, checkpoints)
    )
