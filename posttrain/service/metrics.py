"""Server metrics in the Prometheus text format (exposition format 0.0.4).

Two sources. The scheduler reports every operation it finishes (OperationMetrics: counts,
run-time histogram and tokens per kind, kept in memory since the process started). The store
answers what is true right now: operations by kind and status, sessions per model resource,
resources by status, plus the scheduler's queue depth. Every operation finishes through
service/operations/recording.py, deferred weights-syncs included, so both sources count the same
operations.

Imports: store, types.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from posttrain.records import OperationRecord
from posttrain.statuses import OperationStatus
from posttrain.store.repo import Repo
from posttrain.types import (
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    OperationKind,
    OperationOutput,
    SampleOutput,
    SampleRequest,
)

# Upper bounds of the run-time histogram, in seconds: tiny-model steps take milliseconds,
# large-model steps minutes.
DURATION_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# tokens/s is averaged over this trailing window.
RATE_WINDOW_S = 60.0


def operation_tokens(request: object, output: OperationOutput | None) -> int:
    """Tokens an operation pushed through the model: the samples' input tokens for the
    forward-backward kinds; prompt tokens for every row plus the generated tokens for sample."""
    if isinstance(request, ForwardBackwardRequest | CustomForwardBackwardRequest):
        return sum(len(sample.tokens) for sample in request.samples)
    if isinstance(request, SampleRequest):
        prompt = sum(len(p) for p in request.prompts) * request.num_samples
        results = output.results if isinstance(output, SampleOutput) else ()
        generated = sum(len(s.tokens) for r in results for s in r.sequences)
        return prompt + generated
    return 0


@dataclass
class Histogram:
    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(DURATION_BUCKETS_S))
    count: int = 0
    total: float = 0.0

    def observe(self, value: float) -> None:
        """Prometheus buckets are cumulative: a value counts in every bucket it fits under."""
        self.count += 1
        self.total += value
        for i, bound in enumerate(DURATION_BUCKETS_S):
            if value <= bound:
                self.bucket_counts[i] += 1


class OperationMetrics:
    """What the scheduler reports as it finishes operations. Thread-safe: every resource's
    worker thread reports here, and /metrics reads from the event loop."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._finished: Counter[tuple[str, str]] = Counter()
        self._durations: dict[str, Histogram] = {}
        self._tokens: Counter[str] = Counter()
        self._recent_tokens: deque[tuple[float, str, int]] = deque()
        # Generators apart from the trainer: the trainer's scoring of sampled tokens
        # (types.LogprobMismatch): tokens scored, their summed and largest |difference|.
        self.mismatch_tokens = 0
        self.mismatch_sum = 0.0
        self.mismatch_max = 0.0
        # Prompts that skipped the enabled prefix cache, by reason (SampleResult).
        self.prefix_cache_refused: Counter[str] = Counter()
        # Shared passes: engine passes that served several sessions' operations at once.
        self.shared_passes = 0
        self.shared_pass_operations = 0

    def shared_pass(self, num_operations: int) -> None:
        with self._lock:
            self.shared_passes += 1
            self.shared_pass_operations += num_operations

    def operation_finished(self, op: OperationRecord, *, is_failed: bool) -> None:
        """Count `op` as COMPLETED or FAILED. An op that ran (status RUNNING, whose updated_at
        is when it started) also lands in the run-time histogram."""
        status = OperationStatus.FAILED if is_failed else OperationStatus.COMPLETED
        now = self._clock()
        with self._lock:
            self._finished[(op.kind.value, status.value)] += 1
            if op.status == OperationStatus.RUNNING:
                histogram = self._durations.setdefault(op.kind.value, Histogram())
                histogram.observe(max(0.0, now - op.updated_at))

    def count_tokens(
        self, kind: OperationKind, request: object, output: OperationOutput | None
    ) -> None:
        if isinstance(output, SampleOutput):
            self._count_mismatch(output)
        tokens = operation_tokens(request, output)
        if tokens == 0:
            return
        now = self._clock()
        with self._lock:
            self._tokens[kind.value] += tokens
            self._recent_tokens.append((now, kind.value, tokens))

    def _count_mismatch(self, output: SampleOutput) -> None:
        for result in output.results:
            if result.prefix_cache_refused is not None:
                with self._lock:
                    self.prefix_cache_refused[result.prefix_cache_refused] += 1
            if (mismatch := result.logprob_mismatch) is not None:
                with self._lock:
                    self.mismatch_tokens += mismatch.tokens
                    self.mismatch_sum += mismatch.mean * mismatch.tokens
                    self.mismatch_max = max(self.mismatch_max, mismatch.max)

    def prefix_cache_refusals(self) -> list[tuple[str, int]]:
        """(reason, prompts) of the sampled prompts that skipped the prefix cache."""
        with self._lock:
            return sorted(self.prefix_cache_refused.items())

    def tokens_per_second(self) -> dict[str, float]:
        """Per kind, tokens of the operations finished in the last RATE_WINDOW_S seconds."""
        now = self._clock()
        with self._lock:
            while self._recent_tokens and self._recent_tokens[0][0] < now - RATE_WINDOW_S:
                self._recent_tokens.popleft()
            window: Counter[str] = Counter()
            for _, kind, tokens in self._recent_tokens:
                window[kind] += tokens
        return {kind: window[kind] / RATE_WINDOW_S for kind in sorted(self._tokens)}

    def snapshot(self) -> tuple[dict[tuple[str, str], int], dict[str, Histogram], dict[str, int]]:
        with self._lock:
            durations = {
                kind: Histogram(list(h.bucket_counts), h.count, h.total)
                for kind, h in self._durations.items()
            }
            return dict(self._finished), durations, dict(self._tokens)


def _labels(**labels: str) -> str:
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in labels.items()) + "}"


def _family(name: str, kind: str, help_text: str, samples: Iterable[str]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


def _short(status: str) -> str:
    """COMPLETED rather than TRAINING_OPERATION_STATUS_COMPLETED: label values stay readable."""
    return status.rsplit("_STATUS_", 1)[-1].lower()


class MetricsService:
    def __init__(
        self,
        repo: Repo,
        operations: OperationMetrics,
        queue_depth: Callable[[], int],
        *,
        busy_seconds: Callable[[], dict[str, float]],
        held_polls: Callable[[], int],
        unanswered_samples: Callable[[], int],
        cpu_threads: tuple[int, str],
    ):
        self.repo = repo
        self.operations = operations
        self.queue_depth = queue_depth
        self.busy_seconds = busy_seconds
        self.held_polls = held_polls
        self.unanswered_samples = unanswered_samples
        self.cpu_threads = cpu_threads

    def render(self) -> str:
        """The whole exposition, one family after another, ending with a newline."""
        finished, durations, tokens = self.operations.snapshot()
        lines: list[str] = []
        lines += _family(
            "posttrain_operations",
            "gauge",
            "Operations in the store by kind and status.",
            (
                f"posttrain_operations{_labels(kind=kind, status=_short(status))} {count}"
                for kind, status, count in self.repo.count_operations()
            ),
        )
        lines += _family(
            "posttrain_operations_finished_total",
            "counter",
            "Operations the scheduler finished since the server started, by kind and status.",
            (
                f"posttrain_operations_finished_total{_labels(kind=k, status=_short(s))} {n}"
                for (k, s), n in sorted(finished.items())
            ),
        )
        duration_lines = []
        for kind, histogram in sorted(durations.items()):
            # bucket_counts are cumulative already (Histogram.observe).
            for bound, count in zip(DURATION_BUCKETS_S, histogram.bucket_counts, strict=True):
                duration_lines.append(
                    "posttrain_operation_duration_seconds_bucket"
                    f"{_labels(kind=kind, le=repr(bound))} {count}"
                )
            duration_lines += [
                f"posttrain_operation_duration_seconds_bucket{_labels(kind=kind, le='+Inf')} "
                f"{histogram.count}",
                f"posttrain_operation_duration_seconds_sum{_labels(kind=kind)} {histogram.total}",
                f"posttrain_operation_duration_seconds_count{_labels(kind=kind)} {histogram.count}",
            ]
        lines += _family(
            "posttrain_operation_duration_seconds",
            "histogram",
            "Run time of operations (start of execution to finish), by kind.",
            duration_lines,
        )
        lines += _family(
            "posttrain_tokens_total",
            "counter",
            "Tokens through the model: forward-backward inputs; sample prompts and generations.",
            (f"posttrain_tokens_total{_labels(kind=k)} {n}" for k, n in sorted(tokens.items())),
        )
        lines += _family(
            "posttrain_tokens_per_second",
            "gauge",
            f"Tokens per second over the last {RATE_WINDOW_S:.0f} s, by operation kind.",
            (
                f"posttrain_tokens_per_second{_labels(kind=k)} {rate}"
                for k, rate in self.operations.tokens_per_second().items()
            ),
        )
        lines += _family(
            "posttrain_shared_passes_total",
            "counter",
            "Engine passes that ran several sessions' forward-backward operations together.",
            [f"posttrain_shared_passes_total {self.operations.shared_passes}"],
        )
        lines += _family(
            "posttrain_shared_pass_operations_total",
            "counter",
            "Operations that ran inside shared passes.",
            [f"posttrain_shared_pass_operations_total {self.operations.shared_pass_operations}"],
        )
        lines += _family(
            "posttrain_queue_depth",
            "gauge",
            "Jobs waiting in the per-resource worker queues.",
            [f"posttrain_queue_depth {self.queue_depth()}"],
        )
        lines += _family(
            "posttrain_worker_busy_seconds_total",
            "counter",
            "Seconds the model resources' workers spent running jobs (the engine's busy time),"
            " all resources together.",
            [f"posttrain_worker_busy_seconds_total {sum(self.busy_seconds().values())}"],
        )
        lines += _family(
            "posttrain_held_polls",
            "gauge",
            "Operation GETs, and sample POSTs sent beside others of their session, waiting for"
            " their operation to finish (poll_hold_seconds).",
            [f"posttrain_held_polls {self.held_polls()}"],
        )
        lines += _family(
            "posttrain_sample_posts_unanswered",
            "gauge",
            "Sample POSTs received and not yet answered (held ones included).",
            [f"posttrain_sample_posts_unanswered {self.unanswered_samples()}"],
        )
        ops = self.operations
        mean = ops.mismatch_sum / ops.mismatch_tokens if ops.mismatch_tokens else 0.0
        lines += _family(
            "posttrain_generator_logprob_mismatch",
            "gauge",
            "Sampled tokens the trainer scored (vLLM generators): mean and max |logprob diff|.",
            [
                f"posttrain_generator_logprob_mismatch{_labels(stat=stat)} {value}"
                for stat, value in (
                    ("mean", mean),
                    ("max", ops.mismatch_max),
                    ("tokens", ops.mismatch_tokens),
                )
            ],
        )
        refused = ops.prefix_cache_refusals()
        lines += _family(
            "posttrain_prefix_cache_refused_total",
            "counter",
            "Sampled prompts that skipped the prefix cache, by reason (linear_attention_state:"
            " the model's linear-attention layers keep a recurrent state, no KV span).",
            (f"posttrain_prefix_cache_refused_total{_labels(reason=r)} {n}" for r, n in refused),
        )
        lines += _family(
            "posttrain_sessions",
            "gauge",
            "Training sessions by status.",
            (
                f"posttrain_sessions{_labels(status=_short(status))} {count}"
                for status, count in self.repo.count_sessions()
            ),
        )
        lines += _family(
            "posttrain_model_resources",
            "gauge",
            "Model resources by status.",
            (
                f"posttrain_model_resources{_labels(status=_short(status))} {count}"
                for status, count in self.repo.count_resources()
            ),
        )
        threads, wait_policy = self.cpu_threads
        lines += _family(
            "posttrain_engine_threads",
            "gauge",
            "torch intra-op threads of each engine process, labelled by how idle OpenMP"
            " threads wait.",
            [f"posttrain_engine_threads{_labels(wait_policy=wait_policy)} {threads}"],
        )
        return "\n".join(lines) + "\n"
