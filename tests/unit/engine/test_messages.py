"""hosts/messages.py: the one vocabulary between an engine and its processes. Every Command
names a method of the engine hosted there, and every engine implements the whole Engine
protocol itself (no forwarding by name), so the type checker sees it."""

from __future__ import annotations

import inspect
import pickle

from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.hosts.messages import Call, Command
from posttrain.engine.hosts.process.remote import ProcessEngine, RemoteEngine
from posttrain.engine.hosts.ranks.trainer_group import TrainerGroupEngine
from posttrain.engine.hosts.replicas.engine import ReplicatedEngine
from posttrain.engine.hosts.replicas.worker import ReplicaEngine
from posttrain.engine.interface import Engine


def protocol_methods() -> set[str]:
    return {
        name
        for name, member in vars(Engine).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }


def test_every_command_is_a_method_of_the_engine_hosted_there():
    missing = [c for c in Command if not callable(getattr(ReplicaEngine, c.value, None))]
    assert missing == []
    replica_only = {Command.INSTALL_GENERATOR, Command.RECEIVED, Command.REBUILT}
    on_workers = [c for c in Command if c not in replica_only]
    assert all(callable(getattr(LocalEngine, c.value, None)) for c in on_workers)


def test_every_resource_method_of_the_protocol_has_a_command():
    catalog = {"device_name", "model_info", "check_tokens", "export_merged"}
    answered_here = {"unload_resource", "is_loaded", "close", "generator_lanes"}
    answered_here |= {"generator_fence", "sample_stream"}  # None: no decode stream remotely
    sent = protocol_methods() - catalog - answered_here
    assert sent == sent & {c.value for c in Command}, sent - {c.value for c in Command}


def test_each_engine_implements_the_protocol_itself():
    for engine in (LocalEngine, RemoteEngine, ProcessEngine, TrainerGroupEngine, ReplicatedEngine):
        assert "__getattr__" not in {n for k in engine.__mro__ for n in vars(k)}, engine
        defined = {n for k in engine.__mro__ if k is not object for n in vars(k)}
        assert protocol_methods() <= defined, (engine, protocol_methods() - defined)


def test_a_call_crosses_a_pipe_as_itself():
    call = Call(Command.PUBLISH, ("r", "s"), {"version": 3})
    back = pickle.loads(pickle.dumps(call))
    assert back == call
    assert back.command is Command.PUBLISH
