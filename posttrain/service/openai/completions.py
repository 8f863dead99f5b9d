"""OpenAI-style completions as sample operations of the one scheduler.

A completion request becomes, on the session its `model` names (service/openai/targets.py):
1) a sample operation drawing `n` sequences per prompt (skipped when max_tokens is 0); with
   the prompt echoed and logprobs asked for, it also returns the prompt's logprobs and their
   top-k (`prompt_logprobs`, `topk_prompt_logprobs`);
2) where the sampled tokens' top-k alternatives are asked for, one scoring operation: a sample
   operation over prompt + completion with `topk_prompt_logprobs`, whose prompt logprobs give
   every position's logprob and top-k (its one drawn token is dropped). The engine has no
   top-k for sampled tokens, save one case: at temperature 0 the token drawn is the argmax of
   the logprobs it reports, so with k = 1 it is its own top-1 and no scoring is needed (an
   lm-eval loglikelihood request: echo, max_tokens 1, logprobs 1, temperature 0, is one
   operation). With max_tokens 0 and the prompt echoed, the scoring operation scores it.
The sampled tokens keep the logprobs they were drawn with, which come from the same float32
function a forward pass uses (DESIGN.md "Numerics that matter"). Both are ordinary
operations: queued, batched with the training loop's samples, and counted in /metrics;
neither is a path of its own into the engine.

Text follows the OpenAI completions API: special tokens (a final EOS) have no text but keep
their place and logprob among the tokens (lm-eval's loglikelihood drops the last token it is
sent, the one drawn after an echoed prompt), a stop string and what follows it are cut from
the text, and a token's text is what decoding it adds to the text before it (so the texts of
the tokens concatenate to the text).

Not here: the wire shapes and the SSE framing (api/openai/).

Imports: service, types.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import anyio.to_thread
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from posttrain.errors import EngineFailure, InvalidRequest
from posttrain.records import OperationRecord
from posttrain.service.ids import new_id
from posttrain.service.lifecycle.resources import ResourceService
from posttrain.service.lifecycle.sessions import SessionService
from posttrain.service.openai.chat import ChatPrompt, chat_tokens, end_of_turn_ids
from posttrain.service.openai.targets import ModelTargets, Target
from posttrain.service.operations.polls import PollHold
from posttrain.service.operations.submit import OperationService
from posttrain.statuses import OPERATION_TERMINAL, OperationErrorCode, OperationStatus
from posttrain.types import (
    OperationKind,
    SampleOutput,
    SampleRequest,
    SampleResult,
    SamplingParams,
    StopReason,
)

Prompt = str | tuple[int, ...] | ChatPrompt


@dataclass(frozen=True)
class CompletionJob:
    """A completions request as the api parsed it. `logprobs` None: none returned; k >= 0:
    each token's logprob and the top k alternatives at its position."""

    model: str
    prompts: tuple[Prompt, ...]
    sampling_params: SamplingParams
    n: int = 1
    logprobs: int | None = None
    echo: bool = False


@dataclass(frozen=True)
class TokenLogprobs:
    """OpenAI's completions `logprobs` object, field for field."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    finish_reason: str  # "stop" or "length"
    logprobs: TokenLogprobs | None
    num_completion_tokens: int


@dataclass(frozen=True)
class Completion:
    base_model: str
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Drawn:
    """One choice's tokens before text: what it was drawn from and what it drew."""

    prompt: tuple[int, ...]
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_scores: SampleResult | None = None  # the prompt's logprobs, when the draw scored it


class Completions:
    def __init__(
        self,
        targets: ModelTargets,
        resources: ResourceService,
        sessions: SessionService,
        operations: OperationService,
        polls: PollHold,
    ) -> None:
        self.targets = targets
        self.resources = resources
        self.sessions = sessions
        self.operations = operations
        self.polls = polls
        self._tokenizers: dict[str, PreTrainedTokenizerBase] = {}

    def tokenizer(self, base_model: str) -> PreTrainedTokenizerBase:
        """The base model's own tokenizer, from the directory the engine loads it from."""
        if base_model not in self._tokenizers:
            directory = self.resources.model_info(base_model).tokenizer_dir
            assert isinstance(directory, Path), f"{base_model} has no tokenizer directory"
            self._tokenizers[base_model] = AutoTokenizer.from_pretrained(str(directory))
        return self._tokenizers[base_model]

    async def complete(self, user: str, job: CompletionJob) -> Completion:
        target = await anyio.to_thread.run_sync(self.targets.resolve, user, job.model)
        tokenizer = await anyio.to_thread.run_sync(self.tokenizer, target.base_model)
        base = target.base_model

        def encoded() -> tuple[tuple[int, ...], ...]:
            return tuple(_encoded(tokenizer, base, p, i) for i, p in enumerate(job.prompts))

        prompts = await anyio.to_thread.run_sync(encoded)
        if any(isinstance(p, ChatPrompt) for p in job.prompts):  # a turn ends at end-of-turn
            params = job.sampling_params
            stop_ids = params.stop_token_ids + end_of_turn_ids(tokenizer)
            params = dataclasses.replace(params, stop_token_ids=stop_ids)
            job = dataclasses.replace(job, sampling_params=params)
        k = job.logprobs
        scoring = _needs_scoring(job)
        drawn = await self._draw(
            user, target, prompts, job, scores_prompt=job.echo and k is not None and not scoring
        )
        scores = [d.prompt_scores for d in drawn]
        if scoring:
            assert k is not None, "only logprobs ask for a scoring operation"
            scores = list(await self._scored(user, target, drawn, k))

        def texts() -> list[Choice]:  # decoding is per token: off the event loop
            return [
                _choice(tokenizer, index, choice, score, job)
                for index, (choice, score) in enumerate(zip(drawn, scores, strict=True))
            ]

        choices = await anyio.to_thread.run_sync(texts)
        return Completion(
            base_model=target.base_model,
            choices=choices,
            prompt_tokens=sum(len(p) for p in prompts),
            completion_tokens=sum(c.num_completion_tokens for c in choices),
        )

    async def _draw(
        self,
        user: str,
        target: Target,
        prompts: tuple[tuple[int, ...], ...],
        job: CompletionJob,
        *,
        scores_prompt: bool,
    ) -> list[Drawn]:
        """n sequences per prompt, prompt-major (OpenAI's choice order); `scores_prompt`: each
        with its prompt's logprobs and their top `job.logprobs`."""
        if job.sampling_params.max_tokens == 0:
            return [Drawn(p, [], [], "length") for p in prompts for _ in range(job.n)]
        request = SampleRequest(
            prompts=prompts,
            num_samples=job.n,
            sampling_params=job.sampling_params,
            prompt_logprobs=scores_prompt,
            topk_prompt_logprobs=(job.logprobs or 0) if scores_prompt else 0,
        )
        output = await self._run(user, target, request)
        return [
            Drawn(
                prompt,
                list(sequence.tokens),
                list(sequence.logprobs),
                "stop" if sequence.stop_reason == StopReason.STOP else "length",
                result if scores_prompt else None,
            )
            for prompt, result in zip(prompts, output.results, strict=True)
            for sequence in result.sequences
        ]

    async def _scored(
        self, user: str, target: Target, drawn: list[Drawn], k: int
    ) -> tuple[SampleResult, ...]:
        """Each choice's prompt + completion scored: logprobs and top-k at every position."""
        request = SampleRequest(
            prompts=tuple(d.prompt + tuple(d.tokens) for d in drawn),
            sampling_params=SamplingParams(max_tokens=1, temperature=0.0, stop_at_eos=False),
            prompt_logprobs=True,
            topk_prompt_logprobs=k,
        )
        return (await self._run(user, target, request)).results

    async def _run(self, user: str, target: Target, request: SampleRequest) -> SampleOutput:
        def submit() -> OperationRecord:
            session = self.sessions.get(user, target.session_id)
            fingerprint = hashlib.sha256(repr(request).encode()).hexdigest()
            try:
                return self.operations.submit(
                    user,
                    session,
                    OperationKind.SAMPLE,
                    idempotency_key=None,
                    fingerprint=fingerprint,
                    request=request,
                )
            except InvalidRequest as exc:  # the sample checks name the Together fields
                raise InvalidRequest(exc.message, param=_openai_param(exc.param)) from None

        op = await anyio.to_thread.run_sync(submit)
        while op.status not in OPERATION_TERMINAL:
            settled = await self.polls.settled(
                user, target.session_id, OperationKind.SAMPLE, op.id, hold_s=30.0
            )
            op = settled.op
            if not settled.was_held and op.status not in OPERATION_TERMINAL:
                await asyncio.sleep(0.05)  # polls are not held on this server: poll gently
        if op.error_code == OperationErrorCode.INVALID_INPUT:
            raise InvalidRequest(f"sample operation {op.id} failed: {op.error_message}")
        if op.status != OperationStatus.COMPLETED:
            raise EngineFailure(f"sample operation {op.id} failed: {op.error_message}")
        assert isinstance(op.output, SampleOutput), f"{op.id} completed without a SampleOutput"
        return op.output


# The sample checks (service/operations/submit.py) name Together's fields; a client here sent these.
OPENAI_PARAMS = {
    "sampling_params.max_tokens": "max_tokens",
    "sampling_params.stop": "stop",
    "num_samples": "n",
    "topk_prompt_logprobs": "logprobs",
    "prompt_logprobs": "logprobs",  # top-k and echoed logprobs come from a scoring operation
}


def _openai_param(param: str | None) -> str | None:
    if param is not None and param.startswith("model_inputs"):
        return "prompt"
    return OPENAI_PARAMS.get(param or "", param)


def _needs_scoring(job: CompletionJob) -> bool:
    """Whether the logprobs asked for need a scoring operation beside the draw: the top-k of
    sampled tokens (unless k = 1 at temperature 0, where the token drawn is its own top-1), or
    an echoed prompt's logprobs when nothing is drawn."""
    k = job.logprobs
    if k is None:
        return False
    if job.sampling_params.max_tokens == 0:
        return job.echo or k > 0
    return k > 0 and not (k == 1 and job.sampling_params.temperature == 0)


def completion_id() -> str:
    return new_id("cmpl")


def _encoded(
    tokenizer: PreTrainedTokenizerBase, base_model: str, prompt: Prompt, index: int
) -> tuple[int, ...]:
    if isinstance(prompt, ChatPrompt):
        tokens = chat_tokens(tokenizer, base_model, prompt)
    elif isinstance(prompt, str):
        tokens = tuple(tokenizer.encode(prompt, add_special_tokens=False))
    else:
        tokens = prompt
    if not tokens:
        raise InvalidRequest(f"prompt[{index}] has no tokens", param="prompt")
    return tokens


def _texts(tokenizer: PreTrainedTokenizerBase, tokens: list[int], *, shown: bool) -> list[str]:
    """Each token's text: what decoding it adds to the text of the tokens before it. `shown`:
    special tokens as their own text (the `tokens` of logprobs), else as none (the text)."""
    texts, previous = [], ""
    for end in range(1, len(tokens) + 1):
        text = _decoded(tokenizer, tokens[:end], skip_special_tokens=not shown)
        texts.append(text[len(previous) :])
        previous = text
    return texts


def _decoded(
    tokenizer: PreTrainedTokenizerBase, tokens: list[int], *, skip_special_tokens: bool = False
) -> str:
    text = tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str), "decoding one sequence gives one text"
    return text


def _choice(
    tokenizer: PreTrainedTokenizerBase,
    index: int,
    drawn: Drawn,
    score: SampleResult | None,
    job: CompletionJob,
) -> Choice:
    tokens, logprobs = list(drawn.tokens), list(drawn.logprobs)
    texts = _texts(tokenizer, tokens, shown=False)
    finish_reason = drawn.finish_reason
    cut = _stop_cut("".join(texts), job.sampling_params.stop)
    if cut is not None:  # the stop string and what follows it are not returned
        kept = 0
        while kept < len(tokens) and sum(map(len, texts[:kept])) < cut:
            kept += 1
        tokens, logprobs, texts = tokens[:kept], logprobs[:kept], texts[:kept]
        finish_reason = "stop"
    text = "".join(texts)[:cut]
    num_completion_tokens = len(tokens)
    token_logprobs: list[float | None] = list(logprobs)
    start = 0  # where the completion's tokens start among the tokens returned
    if job.echo:
        start = len(drawn.prompt)
        prompt_texts = _texts(tokenizer, list(drawn.prompt), shown=False)
        text = "".join(prompt_texts) + text
        texts = prompt_texts + texts
        tokens = list(drawn.prompt) + tokens
        prompt_logprobs: list[float | None] = [None] * start
        if score is not None:
            assert score.prompt_logprobs is not None, "a scoring operation returns prompt logprobs"
            prompt_logprobs = [None, *score.prompt_logprobs[1:start]]
        token_logprobs = prompt_logprobs + token_logprobs
    if job.logprobs is None:
        return Choice(index, text, finish_reason, None, num_completion_tokens)
    shown = _texts(tokenizer, tokens, shown=True)
    top: list[dict[str, float] | None] = []
    for position, logprob in enumerate(token_logprobs):
        if logprob is None:
            top.append(None)
            continue
        entry: dict[str, float] = {}
        # A scoring operation's sequence is prompt + completion, a draw's own scores cover the
        # prompt only (past it, a token drawn at temperature 0 is its own top-1); the tokens
        # returned start at `start` in it.
        scored = score.topk_prompt_logprobs if score is not None else None
        at = len(drawn.prompt) - start + position
        if scored is not None and at < len(scored):
            alternatives = scored[at]
            for alt, alt_logprob in zip(alternatives.token_ids, alternatives.logprobs, strict=True):
                entry.setdefault(_decoded(tokenizer, [alt]), alt_logprob)
        entry[shown[position]] = logprob
        top.append(entry)
    offsets = [sum(map(len, texts[:position])) for position in range(len(texts))]
    logprobs_out = TokenLogprobs(
        tokens=shown, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets
    )
    return Choice(index, text, finish_reason, logprobs_out, num_completion_tokens)


def _stop_cut(text: str, stop: tuple[str, ...]) -> int | None:
    """Where the earliest stop string starts in the completion's text, if one occurs."""
    found = [text.find(s) for s in stop if s and s in text]
    return min(found) if found else None
