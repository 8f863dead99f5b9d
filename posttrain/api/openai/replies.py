"""OpenAI reply bodies from a service Completion: text completions and chat completions,
whole (replies) or as server-sent events (`stream: true`).

The scheduler answers an operation once it finished, so a stream sends each choice's text in
one chunk after the request's operations completed (OpenAI's chunk shapes, a role chunk first
for chat, a finish chunk per choice, a usage chunk where stream_options.include_usage asks,
then `data: [DONE]`): a client reading a stream reads the same text a whole reply carries.

Imports: service.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from posttrain.service.openai.completions import Completion, TokenLogprobs, completion_id


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


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def completion_events(model: str, completion: Completion, *, include_usage: bool) -> Iterator[str]:
    whole = completion_body(model, completion)
    head = {key: whole[key] for key in ("id", "object", "created", "model")}
    for choice in whole["choices"]:
        yield _event({**head, "choices": [{**choice, "finish_reason": None}]})
        finish = {"index": choice["index"], "text": "", "logprobs": None}
        yield _event({**head, "choices": [{**finish, "finish_reason": choice["finish_reason"]}]})
    if include_usage:
        yield _event({**head, "choices": [], "usage": whole["usage"]})
    yield "data: [DONE]\n\n"


def chat_events(
    model: str, completion: Completion, k: int, *, include_usage: bool
) -> Iterator[str]:
    whole = chat_body(model, completion, k)
    head = {key: whole[key] for key in ("id", "created", "model")} | {
        "object": "chat.completion.chunk"
    }
    for choice in whole["choices"]:
        index = choice["index"]
        role = {"index": index, "delta": {"role": "assistant", "content": ""}}
        yield _event({**head, "choices": [{**role, "logprobs": None, "finish_reason": None}]})
        delta = {"index": index, "delta": {"content": choice["message"]["content"]}}
        content = {**delta, "logprobs": choice["logprobs"], "finish_reason": None}
        yield _event({**head, "choices": [content]})
        finish = {"index": index, "delta": {}, "logprobs": None}
        yield _event({**head, "choices": [{**finish, "finish_reason": choice["finish_reason"]}]})
    if include_usage:
        yield _event({**head, "choices": [], "usage": whole["usage"]})
    yield "data: [DONE]\n\n"
