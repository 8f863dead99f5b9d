"""A decode stream (engine/interface.py's DecodeStream) whose engine lives in another process:
the host keeps each open stream by id (`StreamHost`, part of LocalEngine), and the API process
drives it step by step (`RemoteStream`, what RemoteEngine.sample_stream hands out) through the
stream messages of hosts/messages.py: OpenStream, one message per DecodeStream method, and
CloseStream. A step (StreamAdmit, StreamBlock) also brings back the operations finished since,
the tokens the followed ones drew since (`follow`'s set travels with each step), the rows
running and the room a join finds (sample_stream.JoinRoom): what the caller asks after each,
in the same round trip. A round trip costs about a CPU decode step's time across Ray
(docs/continuous_batching.md, "Invariants"), so a quiet block is one, and weighing a candidate join
at a boundary is none: `fits` answers from the room, `can_join` once per session.

Between two of a stream's messages the host serves any other (another session's training
between blocks, a PIPELINE publish), as the in-process engine does between blocks: the
stream's state (its rows, its decode cache pool) stays in the host's engine until the stream is
closed. One thread drives a stream (service/scheduling/sample_streams.py's StreamPass), so its
messages reach the host in the order they were made; a trainer group sends them to rank 0 alone
(hosts/ranks/trainer_group.py RANK_ZERO), where samples run.

A stream is bound to the host it was opened on: once that host died, every operation of the
stream fails with the host's WorkerDied (INTERNAL_ERROR naming the process), even after the
resource was loaded again elsewhere (a new host never saw the stream); closing it then does
nothing (its pool died with the process).

Imports: errors, types, engine (generate.sample_stream, interface, hosts.messages).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from typing import Protocol, TypeVar

from posttrain.engine.generate.sample_stream import JoinRoom
from posttrain.engine.hosts.messages import (
    CloseStream,
    HostedStream,
    Stepped,
    StreamAdmit,
    StreamBlock,
    StreamCanJoin,
    StreamFits,
    StreamHosting,
    StreamMessage,
)
from posttrain.engine.interface import DecodeStream
from posttrain.errors import EngineFailure, WorkerDied
from posttrain.types import SampleRequest, SampleResult

T = TypeVar("T")


class StreamHost(StreamHosting, ABC):
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

    def stream(self, resource_id: str, stream_id: int) -> HostedStream:
        """An open stream of the resource."""
        owner, stream = self._streams.get(stream_id, (None, None))
        if owner != resource_id or stream is None:
            raise EngineFailure(f"no decode stream {stream_id} is open on {resource_id}")
        return stream

    def close_stream(self, resource_id: str, stream_id: int) -> None:
        """The stream's pass ended: drop its decode state (idempotent)."""
        owner, stream = self._streams.get(stream_id, (None, None))
        if owner == resource_id and stream is not None:
            del self._streams[stream_id]
            stream.close()


class StreamCall(Protocol):
    """A host's `call` (hosts/placement.py's WorkerHandle), as a stream's messages need it."""

    def __call__(self, message: StreamMessage[T], /) -> T: ...


class RemoteStream(DecodeStream):
    """A stream open on a host, driven from the API process: each method one message on
    `call` (the host's, bound at open: hosts/process/remote.py); `admit` and `block` are steps,
    which also bring back what finished and the rows running after them (only they change
    either): `take_finished` and `running_rows` answer from it without a round trip.
    `died` says how the operations report the host's death (a generator replica's:
    hosts/replicas/engine.py); by default as the host's WorkerDied."""

    def __init__(
        self,
        call: StreamCall,
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
        self._progress: list[tuple[int, list[list[int]]]] = []  # likewise
        self._followed: tuple[int, ...] = ()  # sent with every step
        # The host's death, once seen (as `died` reports it): every later call fails with it
        # (the stream is bound to that host), also those answered here.
        self._died: EngineFailure | None = None

    def _send(self, message: StreamMessage[T]) -> T:
        if self._closed:
            raise EngineFailure(f"decode stream {self.stream_id} of {self.resource_id} is closed")
        self._check()
        try:
            return self._host_call(message)
        except WorkerDied as exc:
            if self._report_death is None:
                self._died = exc
                raise
            self._died = self._report_death(exc)
            raise self._died from exc

    def _check(self) -> None:
        if self._died is not None:
            raise self._died

    def can_join(self, session_id: str) -> bool:
        """Asked once per session: the model a session samples does not change."""
        if session_id not in self._joins:
            asked = StreamCanJoin(self.resource_id, self.stream_id, session_id)
            self._joins[session_id] = self._send(asked)
        self._check()
        return self._joins[session_id]

    def _step(self, step: StreamMessage[Stepped[T]]) -> T:
        stepped = self._send(step)
        self._rows, self._room = stepped.running_rows, stepped.room
        self._finished.extend(stepped.finished)
        self._progress.extend(stepped.progress)
        return stepped.answer

    def admit(
        self,
        items: list[tuple[str, SampleRequest]],
        fence: int = 0,
        *,
        row_limit: int = 0,
        spare_bytes: int = 0,
    ) -> list[int]:
        admit = StreamAdmit(
            self.resource_id, self.stream_id, items, fence, row_limit, spare_bytes, self._followed
        )
        return self._step(admit)

    def block(self, most: int = 1) -> None:
        self._step(StreamBlock(self.resource_id, self.stream_id, most, self._followed))

    def take_finished(self) -> list[tuple[int, list[SampleResult]]]:
        self._check()
        taken, self._finished = self._finished, []
        return taken

    def follow(self, ids: Collection[int]) -> None:
        """Sent with the next step (the host follows them from then on)."""
        self._followed = tuple(sorted(ids))

    def take_progress(self) -> list[tuple[int, list[list[int]]]]:
        self._check()
        taken, self._progress = self._progress, []
        return taken

    def running_rows(self) -> int:
        self._check()
        return self._rows

    def fits(self, items: list[tuple[str, SampleRequest]], spare_bytes: int) -> bool:
        """From the room the last step brought (before any step, the host's answer)."""
        if self._room is None:
            return self._send(StreamFits(self.resource_id, self.stream_id, items, spare_bytes))
        self._check()
        return self._room.reserve_bytes([request for _, request in items]) <= spare_bytes

    def close(self) -> None:
        """Free the stream's decode state on its host; nothing to free where the host died."""
        if self._closed:
            return
        self._closed = True
        try:
            self._host_call(CloseStream(self.resource_id, self.stream_id))
        except WorkerDied:
            pass  # its decode state died with the process
