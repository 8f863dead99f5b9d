"""The OpenAI-compatible routes: GET /v1/models, POST /v1/completions and
/v1/chat/completions, also under Tinker's /oai/api/v1 (hosted Tinker serves its checkpoints
there).

Every route takes the server's API keys as bearer keys (a POST is authenticated before its
body is read: api/guard.py); errors come in the one envelope api/app.py writes, which is
OpenAI's {"error": {"message", "type", "param", "code"}}.

Imports: api.deps, api.openai.schemas, service.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter

from posttrain.api.deps import BodyDep, ServicesDep, UserDep, parse
from posttrain.api.openai.schemas import (
    ChatBody,
    CompletionBody,
    chat_job,
    check_unserved,
    completion_job,
)
from posttrain.errors import InvalidRequest
from posttrain.service.openai.completions import Completion, TokenLogprobs, completion_id

PREFIXES = ("/v1", "/oai/api/v1")

router = APIRouter(include_in_schema=False)  # OpenAI's own schema documents these routes


async def list_models(svc: ServicesDep, user: UserDep) -> dict[str, Any]:
    models = svc.openai.targets.listed(user)
    data = [
        {"id": m.id, "object": "model", "created": m.created, "owned_by": m.owned_by}
        for m in models
    ]
    return {"object": "list", "data": data}


async def create_completion(body: BodyDep, svc: ServicesDep, user: UserDep) -> dict[str, Any]:
    request = parse(CompletionBody, check_unserved(body))
    if request.stream:
        raise InvalidRequest("stream is not served yet", param="stream")
    completion = await svc.openai.completions.complete(user, completion_job(request))
    return completion_body(request.model, completion)


async def create_chat_completion(body: BodyDep, svc: ServicesDep, user: UserDep) -> dict[str, Any]:
    request = parse(ChatBody, check_unserved(body))
    if request.stream:
        raise InvalidRequest("stream is not served yet", param="stream")
    completion = await svc.openai.completions.complete(user, chat_job(request))
    return chat_body(request.model, completion, request.top_logprobs or 0)


def _usage(completion: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }


def chat_logprobs(logprobs: TokenLogprobs, k: int) -> dict[str, Any]:
    """OpenAI's chat `logprobs`: per token its logprob and the k most likely at its place."""
    content = []
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        ranked = sorted((top or {}).items(), key=lambda item: -item[1])[:k]
        content.append(
            {
                "token": token,
                "logprob": logprob,
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in ranked
                ],
            }
        )
    return {"content": content}


def chat_body(model: str, completion: Completion, k: int) -> dict[str, Any]:
    choices = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs, k),
            "finish_reason": c.finish_reason,
        }
        for c in completion.choices
    ]
    return {
        "id": f"chat{completion_id()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(completion),
    }


def completion_body(model: str, completion: Completion) -> dict[str, Any]:
    choices = [
        {
            "index": c.index,
            "text": c.text,
            "logprobs": None if c.logprobs is None else asdict(c.logprobs),
            "finish_reason": c.finish_reason,
        }
        for c in completion.choices
    ]
    return {
        "id": completion_id(),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(completion),
    }


for prefix in PREFIXES:
    router.add_api_route(f"{prefix}/models", list_models, methods=["GET"])
    router.add_api_route(f"{prefix}/completions", create_completion, methods=["POST"])
    router.add_api_route(f"{prefix}/chat/completions", create_chat_completion, methods=["POST"])
