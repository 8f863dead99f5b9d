"""Where a full-weight session (train/full_weight.py) starts and ends on a resource: in one
process, or on a trainer group's ranks sharded with FSDP2 (parallel/fsdp.py). The registry
(hosts/in_process.py) calls these with the resource it found.
"""

from __future__ import annotations

from torch import nn

from posttrain.config import EngineConfig
from posttrain.engine.generate import generator
from posttrain.engine.optim.optimizer import SessionOptimizer
from posttrain.engine.parallel.fsdp import FsdpShards
from posttrain.engine.state import ResourceState, SessionState
from posttrain.engine.train import full_weight
from posttrain.model.lora import LoraModel


def create(config: EngineConfig, resource: ResourceState, session_id: str) -> None:
    """The resource's one full-weight session, its model trainable, its generator's copy
    taken while the model is frozen (so it never holds gradients)."""
    assert not resource.sessions, "a full-weight session shares its resource with no one"
    named = full_weight.trainable_parameters(resource.lora)
    group = resource.group
    model = resource.loaded.model
    shards = None
    generator_model: nn.Module | None
    if group is None:
        generator_model = full_weight.generator_copy(model)
    else:
        # Sharded in place (a group of one rank too: a world of one, as on one GPU); the
        # optimizer holds the sharded parameters (same names), the generator's copy lives on
        # rank 0 alone, which samples (trainer_group.RANK_ZERO).
        generator_model = full_weight.generator_copy(model) if group.rank == 0 else None
        shards = FsdpShards(
            group,
            model,
            named,
            resource.loaded.device,
            reshard_after_forward=config.shard_parameters,
        )
        resource.param_shards = shards
        named = shards.named
    resource.sessions[session_id] = SessionState(
        session_id,
        generator.generator_key(session_id),
        SessionOptimizer(named, muon_scaling=resource.muon_scaling, sharding=shards),
        generator_model=generator_model,
        full_weight=True,
    )


def end(resource: ResourceState) -> None:
    """The session has gone: the resource's model is its base model again, on every rank."""
    assert resource.model_path is not None, "full-weight resource without a model path"
    if resource.param_shards is not None:
        # No way back to plain parameters: the sharded model goes, the base reloads from disk.
        resource.param_shards = None
        resource.loaded = full_weight.reload(resource.model_path, resource.loaded)
        resource.lora = LoraModel(resource.loaded.model)
        return
    full_weight.restore_base(resource.lora, resource.model_path, resource.loaded.device)
