"""What the engine holds per model resource and per session; the registry (hosts/in_process.py) owns
the table of them, the trainer (train/trainer.py) and the generator (generate/generator.py) act on
them.

Each LoRA session has two adapters on its resource's model: the trainer's (what
forward-backward and optim-step change) and the generator's (what sample uses), which
weights-sync overwrites with a copy of the trainer's. A full-weight session (the only session
of its resource) trains the model itself and samples from its own copy of it
(train/full_weight.py).
"""

from __future__ import annotations

import itertools
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from posttrain.engine.generate.prefix_cache import PrefixCache
from posttrain.engine.optim.optimizer import SessionOptimizer
from posttrain.engine.parallel.data_parallel import DataParallel
from posttrain.engine.parallel.fsdp import FsdpShards
from posttrain.model.loader import LoadedModel
from posttrain.model.lora import LoraModel
from posttrain.types import MuonScaling


@dataclass(frozen=True)
class WeightsVersion:
    """What an adapter serves: `generation` changes on every publish (it keys the prefix
    cache); `version` is the policy version of those weights (api.md 2.4)."""

    generation: int
    version: int


@dataclass
class SessionState:
    trainer_key: str
    generator_key: str
    optimizer: SessionOptimizer
    # Full-weight sessions only: the generator's own copy of the model
    # (train/full_weight.py). LoRA sessions sample through their generator adapter on the
    # shared model instead.
    generator_model: nn.Module | None = None
    # A full-weight session; on a rank of a trainer group other than 0 it has no generator copy
    # (parallel/fsdp.py: sampling runs on rank 0 alone).
    full_weight: bool = False

    @property
    def is_full_weight(self) -> bool:
        return self.full_weight or self.generator_model is not None

    @property
    def has_no_generator(self) -> bool:
        """A full-weight session whose generator copy lives on another rank."""
        return self.full_weight and self.generator_model is None


@dataclass
class ResourceState:
    loaded: LoadedModel
    lora: LoraModel
    muon_scaling: MuonScaling | None
    sessions: dict[str, SessionState] = field(default_factory=dict)
    # Where the base weights come from; a full-weight session's end restores them from here.
    model_path: Path | None = None
    # The sampler's KV of prompt prefixes, keyed by generator adapter and weights generation.
    prefix_cache: PrefixCache = field(default_factory=lambda: PrefixCache(0))
    # What each generator (by adapter key) serves; read live by the decode loop (PIPELINE).
    served: dict[str, WeightsVersion] = field(default_factory=dict)
    generations: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    # This process's rank in the resource's trainer group (hosts/ranks/trainer_group.py); None:
    # the resource trains in this process alone, and the trainer never talks to other ranks.
    group: DataParallel | None = None
    # A full-weight session's model sharded over the group with FSDP2 (parallel/fsdp.py);
    # None: no full-weight session, or no group.
    param_shards: FsdpShards | None = None

    def sharded_operation(self) -> AbstractContextManager[None]:
        """One operation of a resource whose parameters are sharded (parallel/fsdp.py: every
        unit resharded when it ends); nothing otherwise."""
        return self.param_shards.operation() if self.param_shards else nullcontext()

    def reduced_in_backward(self) -> frozenset[int]:
        """Ids of the parameters whose gradients the backward itself sums over the ranks."""
        shards = self.param_shards
        return frozenset() if shards is None else shards.reduced_in_backward
