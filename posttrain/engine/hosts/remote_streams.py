"""A decode stream (engine/interface.py's DecodeStream) whose engine lives in another process:
the host keeps each open stream by id (`StreamHost`, part of LocalEngine), and the API process
drives it step by step (`RemoteStream`, what RemoteEngine.sample_stream hands out) through four
Commands: OPEN_STREAM, STREAM_CALL (one DecodeStream method and its arguments), STREAM_STEP
(`admit` or `block`, then the operations finished since, the rows running and the room a join
finds, sample_stream.JoinRoom: what the caller asks after each, in the same round trip) and
CLOSE_STREAM. A round trip costs about a CPU decode step's time across Ray
(docs/continuous_batching.md, "Invariants"), so a quiet block is one, and weighing a candidate join
at a boundary is none: `join_reserve_bytes` answers from the room, `can_join` once per session.

Between two of a stream's commands the host serves any other (another session's training
between blocks, a PIPELINE publish), as the in-process engine does between blocks: the
stream's state (its rows, its decode cache pool) stays in the host's engine until the stream is
closed. One thread drives a stream (service/scheduling/sample_streams.py's StreamPass), so its
commands reach the host in the order they were made; a trainer group sends them to rank 0 alone
(hosts/ranks/trainer_group.py RANK_ZERO), where samples run.

A stream is bound to the host it was opened on: once that host died, every operation of the
stream fails with the host's WorkerDied (INTERNAL_ERROR naming the process), even after the
resource was loaded again elsewhere (a new host never saw the stream); closing it then does
nothing (its pool died with the process).

Imports: errors, types, engine (generate.sample_stream, hosts.messages).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol, cast

from posttrain.engine.generate.sample_stream import JoinRoom
from posttrain.engine.hosts.messages import Call, Command
from posttrain.engine.interface import DecodeStream
from posttrain.errors import EngineFailure, WorkerDied
from posttrain.types import SampleRequest, SampleResult

# What STREAM_CALL may run on a host's stream: the DecodeStream protocol but `close`.
STREAM_METHODS = frozenset(
    {
        "can_join",
        "admit",
        "block",
        "take_finished",
        "running_rows",
        "reserve_rows",
        "pool_row_bytes",
        "join_reserve_bytes",
    }
)

# What STREAM_STEP may run: the methods that change what runs and what finished.
STEPS = frozenset({"admit", "block"})


class HostedStream(DecodeStream, Protocol):
    """A stream as its host keeps it: a DecodeStream that also says what a join finds now
    (generate/sample_stream.py's SessionSampleStream; a replica's FencedStream)."""

    def room(self) -> JoinRoom: ...


class StreamHost(ABC):
    """The host's side (a base of LocalEngine): the streams opened by its caller, by id."""

    def __init__(self) -> None:
        self._streams: dict[int, tuple[str, HostedStream]] = {}
        self._stream_ids = itertools.count(1)  # never reused: a stale caller reaches none

    @abstractmethod
    def sample_stream(self, resource_id: str, session_id: str) -> HostedStream: ...

    def open_stream(self, resource_id: str, session_id: str) -> int:
        """An idle stream of the resource on the model `session_id` samples; its id."""
        return self._opened(resource_id, self.sample_stream(resource_id, session_id))

    def _opened(self, resource_id: str, stream: HostedStream) -> int:
        """Keep `stream`, open on the resource; its id (never reused, so a stale caller never
        reaches another stream)."""
        stream_id = next(self._stream_ids)
        self._streams[stream_id] = (resource_id, stream)
        return stream_id

    def stream_call(self, resource_id: str, stream_id: int, method: str, *args: Any) -> Any:
        """One DecodeStream method of an open stream (STREAM_METHODS)."""
        if method not in STREAM_METHODS:
            raise EngineFailure(f"{method!r} is not a decode stream's method")
        owner, stream = self._streams.get(stream_id, (None, None))
        if owner != resource_id or stream is None:
            raise EngineFailure(f"no decode stream {stream_id} is open on {resource_id}")
        return getattr(stream, method)(*args)

    def stream_step(
        self, resource_id: str, stream_id: int, method: str, *args: Any
    ) -> tuple[Any, list[tuple[int, list[SampleResult]]], int, JoinRoom]:
        """`admit` or `block` on an open stream, then take_finished, running_rows and room:
        (its answer, the operations finished since the last take, the rows running now, what
        a join finds now)."""
        if method not in STEPS:
            raise EngineFailure(f"{method!r} is not a decode stream's step")
        answer = self.stream_call(resource_id, stream_id, method, *args)
        _, stream = self._streams[stream_id]
        return answer, stream.take_finished(), stream.running_rows(), stream.room()

    def close_stream(self, resource_id: str, stream_id: int) -> None:
        """The stream's pass ended: drop its decode state (idempotent)."""
        owner, stream = self._streams.get(stream_id, (None, None))
        if owner == resource_id and stream is not None:
            del self._streams[stream_id]
            stream.close()


class RemoteStream(DecodeStream):
    """A stream open on a host, driven from the API process: each method one STREAM_CALL on
    `call` (the host's, bound at open: hosts/process/remote.py), but `admit` and `block`, each one
    STREAM_STEP that also brings back what finished and the rows running after it (only they
    change either): `take_finished` and `running_rows` answer from it without a round trip.
    `died` says how the operations report the host's death (a generator replica's:
    hosts/replicas/engine.py); by default as the host's WorkerDied."""

    def __init__(
        self,
        call: Callable[[Call], Any],
        resource_id: str,
        stream_id: int,
        died: Callable[[WorkerDied], EngineFailure] | None = None,
    ) -> None:
        self._host_call = call
        self._report_death = died
        self.resource_id = resource_id
        self.stream_id = stream_id
        self._closed = False
        self._rows = 0  # as of the last step
        self._room: JoinRoom | None = None  # as of the last step
        self._joins: dict[str, bool] = {}  # can_join's answers, by session
        self._finished: list[tuple[int, list[SampleResult]]] = []  # brought by steps, not taken
        # The host's death, once seen (as `died` reports it): every later call fails with it
        # (the stream is bound to that host), also those answered here.
        self._died: EngineFailure | None = None

    def _send(self, command: Command, method: str, *args: Any) -> Any:
        if self._closed:
            raise EngineFailure(f"decode stream {self.stream_id} of {self.resource_id} is closed")
        self._check()
        try:
            return self._host_call(Call(command, (self.resource_id, self.stream_id, method, *args)))
        except WorkerDied as exc:
            if self._report_death is None:
                self._died = exc
                raise
            self._died = self._report_death(exc)
            raise self._died from exc

    def _check(self) -> None:
        if self._died is not None:
            raise self._died

    def _call(self, method: str, *args: Any) -> Any:
        return self._send(Command.STREAM_CALL, method, *args)

    def can_join(self, session_id: str) -> bool:
        """Asked once per session: the model a session samples does not change."""
        if session_id not in self._joins:
            self._joins[session_id] = cast(bool, self._call("can_join", session_id))
        self._check()
        return self._joins[session_id]

    def _step(self, method: str, *args: Any) -> Any:
        answer, finished, self._rows, self._room = self._send(Command.STREAM_STEP, method, *args)
        self._finished.extend(finished)
        return answer

    def admit(self, items: list[tuple[str, SampleRequest]], fence: int = 0) -> list[int]:
        return cast(list[int], self._step("admit", items, fence))

    def block(self, most: int = 1) -> None:
        self._step("block", most)

    def take_finished(self) -> list[tuple[int, list[SampleResult]]]:
        self._check()
        taken, self._finished = self._finished, []
        return taken

    def running_rows(self) -> int:
        self._check()
        return self._rows

    def reserve_rows(self, rows: int) -> None:
        self._call("reserve_rows", rows)

    def pool_row_bytes(self, items: list[tuple[str, SampleRequest]]) -> int:
        return cast(int, self._call("pool_row_bytes", items))

    def join_reserve_bytes(self, items: list[tuple[str, SampleRequest]]) -> int:
        """From the room the last step brought (before any step, the host's answer)."""
        if self._room is None:
            return cast(int, self._call("join_reserve_bytes", items))
        self._check()
        return self._room.reserve_bytes([request for _, request in items])

    def close(self) -> None:
        """Free the stream's decode state on its host; nothing to free where the host died."""
        if self._closed:
            return
        self._closed = True
        try:
            self._host_call(Call(Command.CLOSE_STREAM, (self.resource_id, self.stream_id)))
        except WorkerDied:
            pass  # its decode state died with the process
