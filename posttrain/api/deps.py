"""FastAPI dependencies: the caller's identity, strict JSON bodies, and the services.

Imports: service, errors.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from posttrain.config import ServerConfig
from posttrain.errors import InvalidRequest, Unauthorized
from posttrain.service import Services

M = TypeVar("M", bound=BaseModel)


# The dependencies are coroutines although they do no I/O: FastAPI runs a plain function
# dependency on a worker thread, a thread hop per request for a dictionary lookup.
async def services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


def authenticate(config: ServerConfig, authorization: str) -> str:
    """The user id of an Authorization header's bearer key. Single-user mode (no keys
    configured) accepts any non-empty key as config.user_id; otherwise only configured keys,
    each as its user. Called before a body is read (api/guard.py) and by every route."""
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized("missing bearer API key", param="Authorization")
    if not config.api_keys:
        return config.user_id
    user = config.api_keys.get(key.strip())
    if user is None:
        raise Unauthorized("unknown API key", param="Authorization")
    return user


async def current_user(request: Request) -> str:
    config: ServerConfig = request.app.state.services.config
    return authenticate(config, request.headers.get("authorization", ""))


def _reject_constant(name: str) -> Any:
    raise InvalidRequest(f"non-standard JSON number {name} is not allowed", param="body")


def loads_strict(raw: bytes) -> dict[str, Any]:
    """JSON object from a request body; empty means {} (the SDK POSTs some routes bodiless);
    NaN and Infinity are rejected (numbers that overflow to inf, like 1e400, are refused by the
    wire models, which name the field)."""
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", param="body") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply", param="body") from None
    except ValueError as exc:  # an integer over Python's 4,300-digit conversion limit
        raise InvalidRequest(
            f"request body has an unreadable number: {exc}", param="body"
        ) from None
    if not isinstance(value, dict):
        raise InvalidRequest("request body must be a JSON object", param="body")
    return value


async def json_body(request: Request) -> dict[str, Any]:
    return loads_strict(await request.body())


async def raw_body(request: Request) -> bytes:
    """The body unparsed: large bodies (operation POSTs) are decoded by their synchronous
    handler on a worker thread, not here on the event loop."""
    return await request.body()


def parse(model: type[M], body: dict[str, Any]) -> M:
    """Validate a body against a wire model; the first error names its field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        location = ""
        for part in first["loc"]:
            location += f"[{part}]" if isinstance(part, int) else (f".{part}" if location else part)
        message = first["msg"]
        if first["type"] == "extra_forbidden":
            message = "unknown field"
        raise InvalidRequest(f"{location or 'body'}: {message}", param=location or None) from None


# Annotated dependencies, so route signatures stay short and free of call defaults.
ServicesDep = Annotated[Services, Depends(services)]
UserDep = Annotated[str, Depends(current_user)]
BodyDep = Annotated[dict[str, Any], Depends(json_body)]
RawBodyDep = Annotated[bytes, Depends(raw_body)]
