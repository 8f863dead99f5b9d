"""Wire bodies of the OpenAI-compatible surface, and their conversion to the service's jobs.

Fields follow the OpenAI API (completions); `top_k` is vLLM's extension. A field OpenAI
defines that posttrain does not serve is a 400 naming it (UNSERVED), unless it holds the value
that means "off"; an unknown field is a 400 naming it too (extra="forbid").

Imports: api.deps, errors, service, types.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from posttrain.errors import InvalidRequest
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


class CompletionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOPK_PROMPT_LOGPROBS)
    echo: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None  # OpenAI's end-user tag: accepted, not used


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
    return tuple(p if isinstance(p, str) else tuple(p) for p in prompt)  # type: ignore[union-attr]


def completion_job(body: CompletionBody) -> CompletionJob:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > 4:  # OpenAI's own limit
        raise InvalidRequest("stop holds at most 4 sequences", param="stop")
    sampling = SamplingParams(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=tuple(s for s in stop if s),
    )
    return CompletionJob(
        model=body.model,
        prompts=_prompts(body.prompt),
        sampling_params=sampling,
        n=body.n,
        logprobs=body.logprobs,
        echo=body.echo,
    )
