"""OperationMetrics and the Prometheus text: counts, cumulative buckets, the tokens window."""

from __future__ import annotations

from posttrain.records import OperationRecord
from posttrain.service.metrics import (
    DURATION_BUCKETS_S,
    RATE_WINDOW_S,
    OperationMetrics,
    operation_tokens,
)
from posttrain.statuses import OperationStatus
from posttrain.types import (
    CustomForwardBackwardOutput,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LossConfig,
    LossType,
    OperationKind,
    SampledSequence,
    SampleOutput,
    SampleRequest,
    SampleResult,
    StopReason,
    TrainingSample,
)

STOP = StopReason.STOP


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def op(kind: OperationKind, status: OperationStatus, started: float) -> OperationRecord:
    return OperationRecord("op", "ts", kind, status, started, started, "k", "f", "u")


def test_operation_tokens_counts_inputs_and_generations():
    samples = (TrainingSample((1, 2, 3), {}), TrainingSample((4, 5), {}))
    fb = ForwardBackwardRequest(samples, LossConfig(LossType.CROSS_ENTROPY))
    assert operation_tokens(fb, ForwardBackwardResult(1.0, {})) == 5
    sample = SampleRequest(prompts=((1, 2), (3,)), num_samples=2)
    sequences = [SampledSequence([7, 8], [0.0, 0.0], STOP), SampledSequence([9], [0.0], STOP)]
    output = SampleOutput((SampleResult(sequences, []),) * 2)
    assert operation_tokens(sample, output) == 3 * 2 + 6
    assert operation_tokens(None, CustomForwardBackwardOutput()) == 0


def test_durations_land_in_cumulative_buckets_and_counts_by_status():
    clock = Clock()
    metrics = OperationMetrics(clock)
    fb, running = OperationKind.FORWARD_BACKWARD, OperationStatus.RUNNING
    metrics.operation_finished(op(fb, running, clock.now - 0.2), is_failed=False)
    metrics.operation_finished(op(fb, running, clock.now - 3.0), is_failed=True)
    # Never ran (its session had stopped): counted, not timed.
    metrics.operation_finished(op(fb, OperationStatus.PENDING, 0.0), is_failed=True)
    finished, durations, _ = metrics.snapshot()
    assert finished == {
        ("forward-backward", OperationStatus.COMPLETED.value): 1,
        ("forward-backward", OperationStatus.FAILED.value): 2,
    }
    histogram = durations["forward-backward"]
    assert histogram.count == 2 and abs(histogram.total - 3.2) < 1e-9
    expected = [(0.2 <= b) + (3.0 <= b) for b in DURATION_BUCKETS_S]
    assert histogram.bucket_counts == expected


def test_tokens_per_second_forgets_operations_older_than_the_window():
    clock = Clock()
    metrics = OperationMetrics(clock)
    samples = (TrainingSample(tuple(range(30)), {}),)
    request = ForwardBackwardRequest(samples, LossConfig(LossType.CROSS_ENTROPY))
    metrics.count_tokens(OperationKind.FORWARD_BACKWARD, request, ForwardBackwardResult(0.0, {}))
    clock.now += RATE_WINDOW_S / 2
    metrics.count_tokens(OperationKind.FORWARD_BACKWARD, request, ForwardBackwardResult(0.0, {}))
    assert metrics.tokens_per_second() == {"forward-backward": 60 / RATE_WINDOW_S}
    clock.now += RATE_WINDOW_S * 0.75
    assert metrics.tokens_per_second() == {"forward-backward": 30 / RATE_WINDOW_S}
    assert metrics.snapshot()[2] == {"forward-backward": 60}  # the counter never forgets
