"""OpenAI reply bodies from a service Completion: text completions and chat completions,
whole (replies) or as server-sent events (`stream: true`).

A stream sends each choice's text as the service hands it over (service/openai/completions.py
CompletionStream: deltas after every decode block, then the rest of the text once the
operation finished), in OpenAI's chunk shapes: for chat a role chunk per choice first, content
chunks as text comes, a finish chunk per choice, a usage chunk where
stream_options.include_usage asks, then `data: [DONE]`; a client that concatenates a choice's
chunks reads the text a whole reply carries. A failure after the reply began is an error event
(OpenAI's error object), which the SDK raises.

Imports: errors, service.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from posttrain.errors import posttrainError
from posttrain.service.openai.completions import (
    Completion,
    CompletionStream,
    TokenLogprobs,
    completion_id,
)


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


def _error_event(exc: posttrainError) -> str:
    """A failure after the reply began (its status was sent): OpenAI's error object as an
    event, which the SDK raises as an APIError."""
    error = {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": None}
    return _event({"error": error})


def _chunk(head: dict[str, Any], choice: dict[str, Any], finish_reason: str | None) -> str:
    return _event({**head, "choices": [{**choice, "finish_reason": finish_reason}]})


async def completion_events(
    model: str, stream: CompletionStream, *, include_usage: bool
) -> AsyncIterator[str]:
    head: dict[str, Any] = {"id": completion_id(), "object": "text_completion", "model": model}
    head["created"] = int(time.time())
    try:
        async for event in stream.events():
            if isinstance(event, Completion):
                for choice in event.choices:
                    finish = {"index": choice.index, "text": "", "logprobs": None}
                    yield _chunk(head, finish, choice.finish_reason)
                if include_usage:
                    yield _event({**head, "choices": [], "usage": _usage(event)})
                continue
            for delta in event:
                logprobs = None if delta.logprobs is None else asdict(delta.logprobs)
                text = {"index": delta.index, "text": delta.text, "logprobs": logprobs}
                yield _chunk(head, text, None)
    except posttrainError as exc:
        yield _error_event(exc)
    yield "data: [DONE]\n\n"


async def chat_events(
    model: str, stream: CompletionStream, k: int, *, include_usage: bool
) -> AsyncIterator[str]:
    head: dict[str, Any] = {"id": f"chat{completion_id()}", "object": "chat.completion.chunk"}
    head |= {"created": int(time.time()), "model": model}
    for index in range(stream.num_choices):
        role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        yield _chunk(head, role, None)
    try:
        async for event in stream.events():
            if isinstance(event, Completion):
                for choice in event.choices:
                    finish = {"index": choice.index, "delta": {}, "logprobs": None}
                    yield _chunk(head, finish, choice.finish_reason)
                if include_usage:
                    yield _event({**head, "choices": [], "usage": _usage(event)})
                continue
            for delta in event:
                logprobs = None if delta.logprobs is None else chat_logprobs(delta.logprobs, k)
                content = {"index": delta.index, "delta": {"content": delta.text}}
                yield _chunk(head, {**content, "logprobs": logprobs}, None)
    except posttrainError as exc:
        yield _error_event(exc)
    yield "data: [DONE]\n\n"
