"""The OpenAI-compatible routes: GET /v1/models, POST /v1/completions and
/v1/chat/completions, also under Tinker's /oai/api/v1 (hosted Tinker serves its checkpoints
there).

Every route takes the server's API keys as bearer keys (a POST is authenticated before its
body is read: api/guard.py); errors come in the one envelope api/app.py writes, which is
OpenAI's {"error": {"message", "type", "param", "code"}}.

Imports: api.deps, api.openai.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from posttrain.api.deps import BodyDep, ServicesDep, UserDep, parse
from posttrain.api.openai.replies import chat_body, chat_events, completion_body, completion_events
from posttrain.api.openai.schemas import (
    ChatBody,
    CompletionBody,
    chat_job,
    check_unserved,
    completion_job,
)

PREFIXES = ("/v1", "/oai/api/v1")

router = APIRouter(include_in_schema=False)  # OpenAI's own schema documents these routes


def list_models(svc: ServicesDep, user: UserDep) -> dict[str, Any]:
    models = svc.openai.targets.listed(user)
    data = [
        {"id": m.id, "object": "model", "created": m.created, "owned_by": m.owned_by}
        for m in models
    ]
    return {"object": "list", "data": data}


def _include_usage(options: dict[str, Any] | None) -> bool:
    return bool((options or {}).get("include_usage"))


async def create_completion(body: BodyDep, svc: ServicesDep, user: UserDep) -> Any:
    request = parse(CompletionBody, check_unserved(body))
    job = completion_job(request)
    if request.stream:
        stream = await svc.openai.completions.stream(user, job)
        usage = _include_usage(request.stream_options)
        events = completion_events(request.model, stream, include_usage=usage)
        return StreamingResponse(events, media_type="text/event-stream")
    completion = await svc.openai.completions.complete(user, job)
    return completion_body(request.model, completion)


async def create_chat_completion(body: BodyDep, svc: ServicesDep, user: UserDep) -> Any:
    request = parse(ChatBody, check_unserved(body))
    job = chat_job(request)
    k = request.top_logprobs or 0
    if request.stream:
        stream = await svc.openai.completions.stream(user, job)
        usage = _include_usage(request.stream_options)
        events = chat_events(request.model, stream, k, include_usage=usage)
        return StreamingResponse(events, media_type="text/event-stream")
    completion = await svc.openai.completions.complete(user, job)
    return chat_body(request.model, completion, k)


for prefix in PREFIXES:
    router.add_api_route(f"{prefix}/models", list_models, methods=["GET"])
    router.add_api_route(f"{prefix}/completions", create_completion, methods=["POST"])
    router.add_api_route(f"{prefix}/chat/completions", create_chat_completion, methods=["POST"])
