"""A `--generators vllm` lane's decode stream (engine/interface.py's DecodeStream): each
sample handed to a busy lane goes to the lane's vLLM server as it comes, and the server's own
continuous batching takes it in at its next step; each operation is handed back as soon as its
every prompt's generate request answered.

vLLM has no decode blocks to run from outside: the server steps on its own. So `admit` sends
the operation's requests (one per prompt, each on a thread of the stream's pool, as a whole-batch
pass does) and `block` waits until something happened: a request answered, or a sample was
handed to the lanes (`wake`, from VllmEngine.wake_lanes). The scheduler's StreamPass then
records what finished and lets waiting samples join, under the lanes' fence rule
(hosts/staged_changes.py): each joining operation's `admit` first applies the changes staged up
to its fence (through `apply`, VllmEngine's; paused at a token boundary while requests run, so
the server's weight-version label moves with the weights), and the rule keeps out any whose
changes would alter a session decoding here.

A request that fails (its server died: GeneratorReplicaDied) fails the stream, as a failing
request fails a whole-batch pass: the caller fails every operation still in it.

Imports: types, engine (interface, hosts.vllm.requests).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor

from posttrain.engine.hosts.vllm.requests import merged, parts
from posttrain.engine.interface import DecodeStream
from posttrain.types import SampleRequest, SampleResult

# Generate requests a stream has open at once at most: one thread each (a request blocks its
# thread until vLLM answers). Past it requests wait their turn in the pool, as they would in
# the server's own queue; the stream's row limit (service/scheduling/sample_streams.py) bounds them
# first.
STREAM_REQUESTS = 256

# (session, prompt, request) -> one prompt's result, sent to the lane's server.
Generate = Callable[[str, tuple[int, ...], SampleRequest], SampleResult]
# fence, the sessions with requests running on the server -> the fence it serves after
# applying.
Apply = Callable[[int, frozenset[str]], int]
# session, request, results, the fence they were sampled at -> the results as handed back.
Finish = Callable[[str, SampleRequest, list[SampleResult], int], list[SampleResult]]


class _Operation:
    def __init__(self, session_id: str, request: SampleRequest, applied: int) -> None:
        self.session_id = session_id
        self.request = request
        self.applied = applied  # the fence its requests were sampled at
        self.rows = len(request.prompts) * request.num_samples
        self.replies: list[list[Future[SampleResult]]] = []  # per prompt, per part

    def done(self) -> bool:
        return all(reply.done() for prompt in self.replies for reply in prompt)

    def results(self) -> list[SampleResult]:
        """One per prompt; raises what a request raised."""
        return [merged([reply.result() for reply in prompt]) for prompt in self.replies]


class VllmStream(DecodeStream):
    """One generation on a vLLM server, open to joins until its last operation finished."""

    def __init__(
        self,
        generate: Generate,
        apply: Apply,
        finish: Finish,
        closed: Callable[[], None],
        most_sequences: int,
    ) -> None:
        """`most_sequences`: the most one request may ask for (the server's max_num_seqs)."""
        self._most = most_sequences
        self._generate = generate
        self._apply = apply
        self._finish = finish
        self._closed = closed
        self._pool = ThreadPoolExecutor(STREAM_REQUESTS, thread_name_prefix="vllm-stream")
        self._ids = itertools.count()
        self._open: dict[int, _Operation] = {}  # admitted, not handed back yet
        # Set by every answered request and by `wake`; `block` waits for it.
        self._event = threading.Event()

    def can_join(self, session_id: str) -> bool:
        return True  # every session samples the server's one base model

    def admit(
        self,
        items: list[tuple[str, SampleRequest]],
        fence: int = 0,
        *,
        row_limit: int = 0,  # the server's KV cache is its own, sized when it started
        spare_bytes: int = 0,
    ) -> list[int]:
        busy = frozenset(op.session_id for op in self._open.values() if not op.done())
        applied = self._apply(fence, busy)
        ids = []
        for session_id, request in items:
            operation = _Operation(session_id, request, applied)
            for prompt in request.prompts:
                replies = []
                for part in parts(request, self._most):
                    reply = self._pool.submit(self._generate, session_id, prompt, part)
                    reply.add_done_callback(lambda _: self._event.set())
                    replies.append(reply)
                operation.replies.append(replies)
            stream_id = next(self._ids)
            self._open[stream_id] = operation
            ids.append(stream_id)
        return ids

    def block(self, most: int = 1) -> None:
        """Until a request answered or a wake arrived (at once if one did since the last call:
        the caller looks at what finished and at the lanes' queue after every call)."""
        self._event.wait()
        self._event.clear()

    def wake(self) -> None:
        """A sample was handed to the lanes: the running `block` returns, so it may join."""
        self._event.set()

    def take_finished(self) -> list[tuple[int, list[SampleResult]]]:
        """The operations whose every request answered; a failed request fails the stream."""
        done = [i for i, op in self._open.items() if op.done()]
        finished = []
        for stream_id in done:
            op = self._open.pop(stream_id)
            results = self._finish(op.session_id, op.request, op.results(), op.applied)
            finished.append((stream_id, results))
        return finished

    def follow(self, ids: Collection[int]) -> None:
        """Nothing to follow: a generate request answers whole (take_progress)."""

    def take_progress(self) -> list[tuple[int, list[list[int]]]]:
        """Nothing: vLLM's generate requests answer whole, so an operation's tokens show only
        once it finished (a streamed reply then carries its text in one piece)."""
        return []

    def running_rows(self) -> int:
        """Rows of the operations not handed back yet (an answered one counts until then)."""
        return sum(op.rows for op in self._open.values())

    def fits(self, items: list[tuple[str, SampleRequest]], spare_bytes: int) -> bool:
        """The server's KV cache is its own, sized when it started: a join allocates nothing
        of posttrain's memory."""
        return spare_bytes >= 0

    def close(self) -> None:
        """Requests still open (the pass failed) run to their end on the server unread."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._closed()
