"""The one message vocabulary between an engine and the processes it runs: every command a
worker process, a trainer rank or a generator replica answers is a `Call` of one `Command`.

A Command names a method of the engine object hosted there (hosts/in_process.py's LocalEngine,
hosts/ranks/trainer_group.py's RankEngine, hosts/replicas/worker.py's ReplicaEngine); the host runs
`engine.<command>(*args, **kwargs)` and answers with its result or its exception. The remote
engines (hosts/process/remote.py, hosts/replicas/engine.py) build Calls in typed methods, one per
Engine method, so callers see the Engine protocol and never name a method in a string. A Call and
its answer cross a pipe (hosts/process/worker.py) or a Ray actor call (hosts/ray/placement.py)
pickled; a Command pickles as its value.

Imports: nothing from posttrain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Command(StrEnum):
    # The Engine protocol (engine/interface.py), for a resource that lives in that process.
    LOAD_RESOURCE = "load_resource"
    CREATE_SESSION = "create_session"
    DROP_SESSION = "drop_session"
    FORWARD_BACKWARD_BATCH = "forward_backward_batch"
    CUSTOM_FORWARD_BACKWARD = "custom_forward_backward"
    OPTIM_STEP = "optim_step"
    PUBLISH = "publish"
    SAMPLE_BATCH = "sample_batch"
    PEAK_BYTES = "peak_bytes"
    HEADROOM = "headroom"
    PERSIST_SESSION = "persist_session"
    RESTORE_SESSION = "restore_session"
    SAVE_TRAINING_STATE = "save_training_state"
    SAVE_ADAPTER = "save_adapter"
    LOAD_TRAINING_STATE = "load_training_state"
    LOAD_ADAPTER = "load_adapter"
    SAVE_FULL_MODEL = "save_full_model"
    GENERATOR_STATE = "generator_state"
    # A decode stream driven step by step from the API process (hosts/remote_streams.py).
    OPEN_STREAM = "open_stream"
    STREAM_CALL = "stream_call"
    STREAM_STEP = "stream_step"  # admit or block, and what it finished, in one round trip
    CLOSE_STREAM = "close_stream"
    # Sizes and gradients, for operators, benchmarks and tests (hosts/in_process.py).
    RESOURCE_FOOTPRINT = "resource_footprint"
    SESSION_FOOTPRINT = "session_footprint"
    DISCARD_GRADIENTS = "discard_gradients"
    # A generator replica's own (hosts/replicas/worker.py).
    INSTALL_GENERATOR = "install_generator"
    RECEIVED = "received"
    REBUILT = "rebuilt"


# Calls that only drop state: where the process is gone there is nothing left to drop.
FORGETTING = frozenset({Command.DROP_SESSION})


@dataclass(frozen=True)
class Call:
    """One command for the engine hosted in another process; a callable keyword argument
    (sample_batch's `between_tokens`) is called back where the Call was made (a pipe) or not
    passed (a Ray actor)."""

    command: Command
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
