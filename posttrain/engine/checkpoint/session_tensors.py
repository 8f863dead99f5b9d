"""A session's trainable tensors by name, as checkpoints and live state hold them, and back:
with a full-weight session sharded over a trainer group (parallel/fsdp.py), gathered in full
onto rank 0 (the one that writes) and copied back each rank its slices.

Not here: the file formats (formats.py, durable.py) and which session is which
(hosts/in_process.py).
"""

from __future__ import annotations

from torch import Tensor

from posttrain.engine.checkpoint import formats
from posttrain.engine.state import ResourceState, SessionState


def trainer_tensors(resource: ResourceState, session: SessionState) -> dict[str, Tensor]:
    """The session's trainable tensors by name; sharded parameters gathered in full one at a
    time onto rank 0 (the one that writes; {} elsewhere)."""
    shards = resource.param_shards
    if shards is None or not session.is_full_weight:
        return {name: p.detach() for name, p in session.optimizer.named_params}
    return {name: full for name, full in shards.full_tensors() if full is not None}


def copy_into_trainer(
    resource: ResourceState, session: SessionState, saved: dict[str, Tensor]
) -> None:
    """formats.copy_into the session's parameters; sharded, each rank its slices (the names
    are checked against every parameter first)."""
    named = session.optimizer.named_params
    shards = resource.param_shards
    if shards is None or not session.is_full_weight:
        formats.copy_into(named, saved)
        return
    formats.check_names(named, saved)
    shards.copy_into(saved)
