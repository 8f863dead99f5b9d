"""The served /openapi.json as the API's contract: request bodies, response models, the error
envelope at each status a route can answer, and bearer auth (the API reference).

Routes take their bodies as raw bytes and parse them with their wire models (api/deps.py), so
that FastAPI's own validation never answers; each route names its body and reply models here
(`documented`), and `openapi` writes them into the document. The error statuses follow from a
route's shape, one rule each (`_errors`); bounds that come from the server's configuration
(LimitsConfig) are written into the body schemas, so a client or a fuzzer sees the real limits.

Imports: api.deps, api.schemas, config.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse
from fastapi.routing import APIRoute, iter_route_contexts
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from posttrain.api.deps import current_user
from posttrain.api.schemas.objects import ErrorEnvelope
from posttrain.config import LimitsConfig

BEARER = "bearerAuth"
SCHEMAS = "#/components/schemas/"

# Request body models by component name, filled in by `documented` as the routes are defined.
_BODIES: dict[str, type[BaseModel]] = {}

WHY = {
    400: "Invalid request: bad JSON, a field out of range or unknown; `param` names it",
    401: "Missing or unknown bearer API key",
    404: "No such object, or not the caller's",
    413: "Request body over the server's size limit",
    422: "Idempotency-Key reused for a different request",
}


def documented(
    reply: type[BaseModel] | None,
    *,
    body: type[BaseModel] | None = None,
    body_required: bool = True,
    media_type: str | None = None,
    errors: tuple[int, ...] = (),
) -> dict[str, Any]:
    """Route decorator arguments documenting a route: its 200 reply model (or, with
    `media_type`, a file of that type), its JSON body model, and the error statuses that do not
    follow from its shape (`_errors`), such as a 404 for an id its body names."""
    extra: dict[str, Any] = {}
    if body is not None:
        _BODIES[body.__name__] = body
        schema = {"$ref": SCHEMAS + body.__name__}
        extra["requestBody"] = {
            "required": body_required,
            "content": {"application/json": {"schema": schema}},
        }
    arguments: dict[str, Any] = {"response_model": None, "openapi_extra": extra or None}
    if media_type is not None:
        content: dict[str, dict[str, Any]] = {media_type: {"schema": {}}}
        arguments["responses"] = {200: {"description": "The file", "content": content}}
        arguments["response_class"] = FileResponse  # no JSON content of its own
    else:
        arguments["responses"] = {200: {"description": "Successful Response", "model": reply}}
    arguments["responses"].update({status: {"description": WHY[status]} for status in errors})
    return arguments


# The route reads it as optional, so that its absence is this API's 400 naming it (api.md
# 1.4.1) rather than FastAPI's validation error; the contract says it is required.
IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": True,
    "description": "One per logical request; a retry resends it (api.md 1.4.1)",
    "schema": {"type": "string", "minLength": 1},
}
# The seed-era sample route's clients send none (api.md 5.6): there the key is optional, and
# the route declares its header with this description.
OPTIONAL_KEY = "Optional: an operation sent without one is not deduplicated (api.md 5.6)"


def openapi(app: FastAPI, limits: LimitsConfig) -> dict[str, Any]:
    """The document /openapi.json serves, built once per app."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    _add_models(schemas, [(m, "validation") for m in _BODIES.values()])
    _add_models(schemas, [(ErrorEnvelope, "serialization")])
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    doc["components"]["securitySchemes"] = {
        BEARER: {"type": "http", "scheme": "bearer", "description": "The server's API key"}
    }
    authenticated = _authenticated(app)
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            _errors(operation, method, (path, method.upper()) in authenticated)
    _limits(schemas, limits)
    app.openapi_schema = doc
    return doc


def _add_models(schemas: dict[str, Any], models: list[tuple[type[BaseModel], Any]]) -> None:
    _, defs = models_json_schema(models, ref_template=SCHEMAS + "{model}")
    for name, schema in defs.get("$defs", {}).items():
        if name in schemas and schemas[name] != schema:
            raise AssertionError(f"two OpenAPI components are named {name}")
        schemas[name] = schema


def _authenticated(app: FastAPI) -> set[tuple[str, str]]:
    """(path, method) of every route that takes the caller's bearer key (deps.current_user);
    signed URLs and the health check do not."""
    found: set[tuple[str, str]] = set()
    # Included routers' routes, with their prefixes, as get_openapi walks them.
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        if isinstance(route, APIRoute) and _calls(route.dependant, current_user):
            # starlette's Route types its methods optional; FastAPI gives each APIRoute its own.
            assert route.methods is not None, f"the route {route.path} has no methods"
            found.update((route.path, method) for method in route.methods)
    return found


def _calls(dependant: Dependant, function: Callable[..., Any]) -> bool:
    return any(d.call is function or _calls(d, function) for d in dependant.dependencies)


def _errors(operation: dict[str, Any], method: str, authenticated: bool) -> None:
    """Bearer auth where the route takes the key, and the error envelope at each status the
    route can answer."""
    responses = operation["responses"]
    responses.pop("422", None)  # FastAPI's own validation error, which never answers here
    statuses = {int(status) for status in responses if int(status) >= 400}
    if authenticated:
        operation["security"] = [{BEARER: []}]
        statuses.add(401)
    parameters = operation.get("parameters", [])
    for index, parameter in enumerate(parameters):
        if parameter["name"] == IDEMPOTENCY_KEY["name"]:
            optional = parameter.get("description") == OPTIONAL_KEY
            parameters[index] = {**copy.deepcopy(IDEMPOTENCY_KEY), "required": not optional}
            if optional:
                parameters[index]["description"] = OPTIONAL_KEY
    if any(p["in"] == "path" for p in parameters):
        statuses.add(404)
    if any(p["in"] != "path" for p in parameters) or method in ("post", "put", "patch"):
        statuses.add(400)
    if method in ("post", "put", "patch"):
        statuses.add(413)
    if any(p["name"] == IDEMPOTENCY_KEY["name"] for p in parameters):
        statuses.add(422)
    envelope = {"application/json": {"schema": {"$ref": SCHEMAS + ErrorEnvelope.__name__}}}
    for status in sorted(statuses):
        responses[str(status)] = {"description": WHY[status], "content": copy.deepcopy(envelope)}


def _limits(schemas: dict[str, Any], limits: LimitsConfig) -> None:
    """The configured bounds the service checks at submit (400 naming the field)."""
    _maximum(schemas["SampleIn"]["properties"]["num_samples"], limits.max_sequences)
    sampling = schemas["SamplingParamsIn"]["properties"]["max_tokens"]
    _maximum(sampling, limits.max_operation_tokens)


def _maximum(schema: dict[str, Any], maximum: int) -> None:
    """Set the maximum of an integer field's schema, nullable (anyOf) or not."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") == "integer":
            branch["maximum"] = maximum
