"""GET /metrics: Prometheus text exposition (service/metrics.py).

Unauthenticated, as Prometheus scrapers expect, so it carries aggregates only: counts and
durations over all users, never a resource or session id, key, prompt or output.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from posttrain.api.deps import ServicesDep

router = APIRouter()

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@router.get("/metrics", include_in_schema=False)
def metrics(*, svc: ServicesDep) -> PlainTextResponse:
    return PlainTextResponse(svc.metrics.render(), media_type=PROMETHEUS_TEXT)
