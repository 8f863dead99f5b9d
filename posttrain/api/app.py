"""create_app(config): the FastAPI application, its lifespan, and the one error -> HTTP map.

Imports: api.*, service.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from posttrain.api.arrivals import ArrivalsMiddleware
from posttrain.api.contract import documented, openapi
from posttrain.api.guard import RequestGuard
from posttrain.api.openai import routes as openai_routes
from posttrain.api.responses import error_response
from posttrain.api.routes import (
    checkpoints,
    dashboard,
    metrics,
    model_resources,
    operations,
    payloads,
    sessions,
    supported_models,
    whoami,
)
from posttrain.api.schemas.objects import Health
from posttrain.api.tinker import checkpoint_routes as tinker_checkpoint_routes
from posttrain.api.tinker import routes as tinker_routes
from posttrain.config import ServerConfig
from posttrain.errors import posttrainError
from posttrain.service import wire_services

log = logging.getLogger("posttrain.api")

# ErrorData.type for the HTTP errors the framework raises itself: no such route (404), a route
# without that method (405). Any other 4xx is invalid_request_error, any 5xx server_error.
HTTP_KINDS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


def create_app(config: ServerConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = wire_services(config)
        operations.keep_wire_bodies_as_requests(services)
        services.recover_after_restart()
        app.state.services = services
        try:
            yield
        finally:
            app.state.services.close()

    app = FastAPI(title="posttrain", lifespan=lifespan)
    app.add_middleware(ArrivalsMiddleware)
    app.add_middleware(RequestGuard)  # added last: it runs first, before any body is read

    @app.exception_handler(posttrainError)
    async def handle_posttrain_error(request: Request, exc: posttrainError) -> JSONResponse:
        if exc.http_status >= 500:
            log.exception("unexpected %s", type(exc).__name__, exc_info=exc)
        return error_response(exc.http_status, exc.error_type, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def handle_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        location = ".".join(str(p) for p in first["loc"] if p not in ("body", "query", "header"))
        return error_response(400, "invalid_request_error", f"{location}: {first['msg']}", location)

    @app.exception_handler(HTTPException)
    async def handle_http(request: Request, exc: HTTPException) -> JSONResponse:
        status = exc.status_code
        kind = HTTP_KINDS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        message = f"{exc.detail}: {request.method} {request.url.path}"
        response = error_response(status, kind, message, None)
        response.headers.update(exc.headers or {})  # 405 carries Allow
        return response

    for router in (
        supported_models.router,
        model_resources.router,
        sessions.router,
        operations.router,
        payloads.router,
        checkpoints.router,
        dashboard.router,
        metrics.router,
        whoami.router,
        tinker_routes.router,
        tinker_checkpoint_routes.router,
        openai_routes.router,
    ):
        app.include_router(router)

    @app.get("/healthz", **documented(Health))
    def health() -> dict[str, str]:
        return {"status": "ok"}

    app.openapi = lambda: openapi(app, config.limits)  # type: ignore[method-assign]

    return app
