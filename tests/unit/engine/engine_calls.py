"""One forward-backward or one sample operation through the engine's batched methods, the only
ones the Engine protocol has: a one-item batch, its error raised."""

from __future__ import annotations

from collections.abc import Callable

from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.types import (
    ForwardBackwardRequest,
    ForwardBackwardResult,
    SampleRequest,
    SampleResult,
)


def forward_backward(
    engine: LocalEngine, resource_id: str, session_id: str, request: ForwardBackwardRequest
) -> ForwardBackwardResult:
    (outcome,) = engine.forward_backward_batch(resource_id, [(session_id, request)])
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def sample(
    engine: LocalEngine,
    resource_id: str,
    session_id: str,
    request: SampleRequest,
    *,
    between_tokens: Callable[[], None] | None = None,
) -> list[SampleResult]:
    (results,) = engine.sample_batch(
        resource_id, [(session_id, request)], between_tokens=between_tokens
    )
    return results
