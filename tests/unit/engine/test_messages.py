"""hosts/messages.py: the one vocabulary between an engine and its processes. Every message's
handler calls methods of the engine hosted there (the protocol its `run` takes, which the type
checker matches against the engine class), and every engine implements the whole Engine
protocol itself (no forwarding by name), so the type checker sees it."""

from __future__ import annotations

import inspect
import pickle
from dataclasses import fields
from typing import Any, get_type_hints

from posttrain.engine.hosts import messages
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.hosts.messages import (
    CloseStream,
    HostedStream,
    Message,
    Publish,
    ReplicaHosting,
    SampleBatch,
    StreamMessage,
)
from posttrain.engine.hosts.process.remote import ProcessEngine, RemoteEngine
from posttrain.engine.hosts.ranks.trainer_group import TrainerGroupEngine
from posttrain.engine.hosts.replicas.engine import ReplicatedEngine
from posttrain.engine.hosts.replicas.worker import ReplicaEngine
from posttrain.engine.interface import DecodeStream, Engine, Generator, Trainer


def methods(protocol: type) -> set[str]:
    """The public methods a protocol (and the protocols it extends) declares."""
    return {
        name
        for klass in protocol.__mro__
        if klass.__module__.startswith("posttrain")
        for name, member in vars(klass).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }


def protocol_methods() -> set[str]:
    return methods(Engine)


def every_message() -> list[type[Message]]:
    """The concrete message classes of hosts/messages.py."""
    found, todo = [], [Message]
    while todo:
        klass = todo.pop()
        todo += klass.__subclasses__()
        if not inspect.isabstract(klass):
            found.append(klass)
    return found


def needs(message: type[Message]) -> type:
    """The protocol the message's handler takes the hosted engine as."""
    return get_type_hints(message.run, vars(messages))["engine"]


class Recorder:
    """An engine (and what it returns) that records the methods a handler calls."""

    def __init__(self, called: list[str]) -> None:
        self._called = called

    def __getattr__(self, name: str) -> Any:
        def method(*args: Any, **kwargs: Any) -> Recorder:
            self._called.append(name)
            return Recorder(self._called)

        return method


def called_by(message: type[Message]) -> list[str]:
    """The engine methods the message's handler calls (fields filled with stand-ins)."""
    called: list[str] = []
    message(*(None for _ in fields(message))).run(Recorder(called))
    return called


def test_every_message_is_answered_by_the_engine_hosted_there():
    missing = [m for m in every_message() if not methods(needs(m)) <= set(dir(ReplicaEngine))]
    assert missing == []
    on_workers = [m for m in every_message() if needs(m) is not ReplicaHosting]
    assert all(methods(needs(m)) <= set(dir(LocalEngine)) for m in on_workers)
    assert all(set(called_by(m)) <= methods(needs(m)) | methods(HostedStream) for m in on_workers)


def test_every_resource_method_of_the_protocol_has_a_message():
    catalog = {"device_name", "model_info", "check_tokens", "export_merged"}
    answered_here = {"unload_resource", "is_loaded", "close", "generator_lanes"}
    answered_here |= {"generator_fence", "sample_stream"}  # a stream's messages apart
    sent = protocol_methods() - catalog - answered_here
    engine = (Engine, Trainer, Generator)
    handled = {m.__name__: called_by(m) for m in every_message() if needs(m) in engine}
    assert sent == {called[0] for called in handled.values()}, handled
    assert all(len(called) == 1 for called in handled.values()), handled


def test_a_stream_runs_only_decode_stream_methods_and_closes_by_its_own_message():
    """A host runs a method of an open stream only through a stream message (a step also
    takes what finished, the rows running and the room a join finds): every one but `close`,
    which only CloseStream does, through the host, which forgets the stream."""
    streams = [m for m in every_message() if issubclass(m, StreamMessage) and m is not CloseStream]
    called = {name for m in streams for name in called_by(m)} - {"stream"}
    assert methods(HostedStream) - called == {"close"}, called
    assert methods(DecodeStream) < methods(HostedStream)
    assert called_by(CloseStream) == ["close_stream"]


def test_each_engine_implements_the_protocol_itself():
    for engine in (LocalEngine, RemoteEngine, ProcessEngine, TrainerGroupEngine, ReplicatedEngine):
        assert "__getattr__" not in {n for k in engine.__mro__ for n in vars(k)}, engine
        defined = {n for k in engine.__mro__ if k is not object for n in vars(k)}
        assert protocol_methods() <= defined, (engine, protocol_methods() - defined)


def test_a_message_crosses_a_pipe_as_itself():
    message = Publish("r", "s", version=3)
    back = pickle.loads(pickle.dumps(message))
    assert back == message
    assert type(back) is Publish
    assert messages.callables(SampleBatch("r", [], between_tokens=print)) == {
        "between_tokens": print
    }
