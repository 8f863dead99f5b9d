"""A session's trainable tensors by name, as checkpoints and live state hold them, and back:
with a full-weight session's parameters sharded over a trainer group (parallel/zero3.py,
parallel/fsdp.py), gathered in full onto rank 0 (the one that writes) and copied back each
rank its own.

Not here: the file formats (formats.py, durable.py) and which session is which
(hosts/in_process.py).
"""

from __future__ import annotations

from torch import Tensor

from posttrain.engine.checkpoint import formats
from posttrain.engine.parallel.fsdp import FsdpShards
from posttrain.engine.state import ResourceState, SessionState


def trainer_tensors(resource: ResourceState, session: SessionState) -> dict[str, Tensor]:
    """The session's trainable tensors by name; sharded parameters (parallel/zero3.py)
    gathered in full, kept on rank 0 alone (the one that writes; {} elsewhere)."""
    shards = resource.param_shards
    if shards is None or not session.is_full_weight:
        return {name: p.detach() for name, p in session.optimizer.named_params}
    if isinstance(shards, FsdpShards):  # gathered onto rank 0 alone
        return {name: full for name, full in shards.full_tensors() if full is not None}
    keep = shards.sharding.group.rank == 0
    return {name: full for name, full in shards.full_tensors() if keep}


def copy_into_trainer(
    resource: ResourceState, session: SessionState, saved: dict[str, Tensor]
) -> None:
    """formats.copy_into the session's parameters; sharded, each rank its own (the names are
    checked against every parameter first)."""
    named = session.optimizer.named_params
    shards = resource.param_shards
    if shards is None or not session.is_full_weight:
        formats.copy_into(named, saved)
        return
    formats.check_names(named, saved)
    if isinstance(shards, FsdpShards):  # each rank its slice of every parameter
        shards.copy_into(saved)
        return
    owned = shards.owned()
    formats.copy_into(owned, {name: saved[name] for name, _ in owned})
