"""Wire bodies of the OpenAI-compatible surface, and their conversion to the service's jobs.

Fields follow the OpenAI API (completions, chat completions); `top_k` is vLLM's extension. A
field OpenAI defines that posttrain does not serve is a 400 naming it (UNSERVED), unless it
holds the value that means "off"; an unknown field is a 400 naming it too (extra="forbid").

Imports: api.deps, errors, service, types.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from posttrain.errors import InvalidRequest
from posttrain.service.openai.chat import ChatMessage, ChatPrompt
from posttrain.service.openai.completions import CompletionJob, Prompt
from posttrain.types import MAX_TOPK_PROMPT_LOGPROBS, SamplingParams

# Fields of the OpenAI API that posttrain does not serve, with the value that means "off" (the
# one a client may send as a default).
UNSERVED: dict[str, Any] = {
    "best_of": 1,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": None,
    "suffix": None,
}


class SamplingBody(BaseModel):
    """The sampling fields completions and chat share."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None


class CompletionBody(SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOPK_PROMPT_LOGPROBS)
    echo: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None  # OpenAI's end-user tag: accepted, not used


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # OpenAI's participant name: accepted, not rendered


class ChatBody(SamplingBody):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOPK_PROMPT_LOGPROBS)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None


def check_unserved(body: dict[str, Any]) -> dict[str, Any]:
    """The body without the unserved fields that hold their "off" value; a 400 naming the
    first that asks for something."""
    kept = dict(body)
    for name, off in UNSERVED.items():
        if name in kept:
            if kept[name] not in (off, None):
                raise InvalidRequest(f"{name} is not supported by this server", param=name)
            del kept[name]
    return kept


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> tuple[Prompt, ...]:
    """OpenAI's four prompt forms as a tuple of prompts, each text or token ids."""
    if isinstance(prompt, str):
        return (prompt,)
    if not prompt:
        raise InvalidRequest("prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return (tuple(prompt),)  # type: ignore[arg-type]
    return tuple(p if isinstance(p, str) else tuple(p) for p in prompt)  # type: ignore[arg-type]


def _sampling(body: SamplingBody, max_tokens: int | None) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > 4:  # OpenAI's own limit
        raise InvalidRequest("stop holds at most 4 sequences", param="stop")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=tuple(s for s in stop if s),
    )


def chat_job(body: ChatBody) -> CompletionJob:
    """A chat request as a completion of the conversation rendered by the model's template."""
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    messages = tuple(
        ChatMessage(
            m.role,
            m.content if isinstance(m.content, str) else "".join(p.text for p in m.content),
        )
        for m in body.messages
    )
    max_tokens = body.max_completion_tokens or body.max_tokens  # None: what the context leaves
    return CompletionJob(
        model=body.model,
        prompts=(ChatPrompt(messages),),
        sampling_params=_sampling(body, max_tokens),
        n=body.n,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
    )


def completion_job(body: CompletionBody) -> CompletionJob:
    sampling = _sampling(body, body.max_tokens)
    return CompletionJob(
        model=body.model,
        prompts=_prompts(body.prompt),
        sampling_params=sampling,
        n=body.n,
        logprobs=body.logprobs,
        echo=body.echo,
    )
