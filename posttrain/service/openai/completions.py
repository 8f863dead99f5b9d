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

A streamed reply (`stream`, CompletionStream) shows each choice's text as its tokens are
drawn: the sample stream hands them over after every decode block
(service/operations/progress.py), and texts.StreamedText says what of them may be shown (no
character split, nothing that a stop string may still cut); the rest of each choice's text
follows once the operation finished, so the deltas concatenate to the text a whole reply
carries. Where logprobs are asked for or the prompt is echoed, or the sample does not run as a
stream (a vLLM lane), each choice's text comes whole at the end.

Not here: the wire shapes and the SSE framing (api/openai/).

Imports: service, types.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import hashlib
import itertools
from collections.abc import AsyncIterator
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
from posttrain.service.openai.texts import StreamedText, stop_cut, token_texts
from posttrain.service.operations.completion import CompletionWatch
from posttrain.service.operations.progress import SampleProgress
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


@dataclass(frozen=True)
class Prepared:
    """A job resolved: the session that samples it, its tokenizer and prompts, and the job
    with a chat turn's end among its stop tokens."""

    target: Target
    tokenizer: PreTrainedTokenizerBase
    prompts: tuple[tuple[int, ...], ...]
    job: CompletionJob

    def draw_request(self) -> SampleRequest | None:
        """The sample operation drawing n sequences per prompt; None where nothing is drawn
        (max_tokens 0). With the prompt echoed and logprobs asked for, where no scoring
        operation follows, it scores its own prompt."""
        job = self.job
        if job.sampling_params.max_tokens == 0:
            return None
        scores_prompt = job.echo and job.logprobs is not None and not _needs_scoring(job)
        return SampleRequest(
            prompts=self.prompts,
            num_samples=job.n,
            sampling_params=job.sampling_params,
            prompt_logprobs=scores_prompt,
            topk_prompt_logprobs=(job.logprobs or 0) if scores_prompt else 0,
        )

    @property
    def streams_tokens(self) -> bool:
        """Whether a streamed reply shows text as it is drawn: not where logprobs are asked
        for (a sampled token's top-k comes from a scoring operation after the draw) or the
        prompt is echoed; those send each choice whole once it finished."""
        return self.job.logprobs is None and not self.job.echo


@dataclass(frozen=True)
class TextDelta:
    """Text of choice `index` a streamed reply sends next; a choice's last one carries its
    logprobs where they were asked for (its text then comes whole)."""

    index: int
    text: str
    logprobs: TokenLogprobs | None = None


class Completions:
    def __init__(
        self,
        targets: ModelTargets,
        resources: ResourceService,
        sessions: SessionService,
        operations: OperationService,
        watch: CompletionWatch,
        progress: SampleProgress,
    ) -> None:
        self.targets = targets
        self.resources = resources
        self.sessions = sessions
        self.operations = operations
        self.watch = watch
        self.progress = progress
        self._tokenizers: dict[str, PreTrainedTokenizerBase] = {}

    def tokenizer(self, base_model: str) -> PreTrainedTokenizerBase:
        """The base model's own tokenizer, from the directory the engine loads it from."""
        if base_model not in self._tokenizers:
            directory = self.resources.model_info(base_model).tokenizer_dir
            assert isinstance(directory, Path), f"{base_model} has no tokenizer directory"
            self._tokenizers[base_model] = AutoTokenizer.from_pretrained(str(directory))
        return self._tokenizers[base_model]

    async def complete(self, user: str, job: CompletionJob) -> Completion:
        prepared = await self._prepared(user, job)
        request = prepared.draw_request()
        output = None
        if request is not None:
            op = await self._submit(user, prepared.target, request)
            output = await self._settled(user, prepared.target, op)
        return await self._completed(user, prepared, output)

    async def stream(self, user: str, job: CompletionJob) -> CompletionStream:
        """The job submitted (a bad request raises here, before any reply is sent); its reply
        as it is drawn is the stream's `events`."""
        prepared = await self._prepared(user, job)
        request = prepared.draw_request()
        op = None if request is None else await self._submit(user, prepared.target, request)
        return CompletionStream(self, user, prepared, op)

    async def _prepared(self, user: str, job: CompletionJob) -> Prepared:
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
        return Prepared(target, tokenizer, prompts, job)

    async def _completed(
        self, user: str, prepared: Prepared, output: SampleOutput | None
    ) -> Completion:
        """The reply once the draw finished (`output`; None where nothing was drawn): a
        scoring operation first where the logprobs asked for need one."""
        job, tokenizer = prepared.job, prepared.tokenizer
        drawn = _drawn(prepared, output)
        scores = [d.prompt_scores for d in drawn]
        if _needs_scoring(job):
            assert job.logprobs is not None, "only logprobs ask for a scoring operation"
            scores = list(await self._scored(user, prepared.target, drawn, job.logprobs))

        def texts() -> list[Choice]:  # decoding is per token: off the event loop
            return [
                _choice(tokenizer, index, choice, score, job)
                for index, (choice, score) in enumerate(zip(drawn, scores, strict=True))
            ]

        choices = await anyio.to_thread.run_sync(texts)
        return Completion(
            base_model=prepared.target.base_model,
            choices=choices,
            prompt_tokens=sum(len(p) for p in prepared.prompts),
            completion_tokens=sum(c.num_completion_tokens for c in choices),
        )

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
        op = await self._submit(user, target, request)
        return (await self._settled(user, target, op)).results

    async def _submit(self, user: str, target: Target, request: SampleRequest) -> OperationRecord:
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

        return await anyio.to_thread.run_sync(submit)

    async def read(self, user: str, target: Target, op: OperationRecord) -> OperationRecord:
        def read() -> OperationRecord:
            return self.operations.get(user, target.session_id, OperationKind.SAMPLE, op.id)

        return await anyio.to_thread.run_sync(read)

    async def _settled(self, user: str, target: Target, op: OperationRecord) -> SampleOutput:
        """The operation's output once it finished: woken by its completion (watched before
        its status is read, so a completion between the two is not missed)."""
        waiter = self.watch.watch(op.id, asyncio.get_running_loop())
        try:
            op = await self.read(user, target, op)
            if op.status not in OPERATION_TERMINAL:
                await waiter.wait()
                op = waiter.record or await self.read(user, target, op)
        finally:
            self.watch.forget(waiter)
        return _output(op)


class CompletionStream:
    """A submitted job's reply as it is drawn (`events`): the text each choice's tokens add,
    after every decode block of the operation (service/operations/progress.py), then the rest
    of each choice's final text and the whole Completion. What was sent is always a prefix of
    the final text (texts.StreamedText), so a client that concatenates the deltas reads the
    text a whole reply carries."""

    def __init__(
        self,
        completions: Completions,
        user: str,
        prepared: Prepared,
        op: OperationRecord | None,
    ) -> None:
        self.completions = completions
        self.user = user
        self.prepared = prepared
        self.op = op  # the draw; None where nothing is drawn
        self.num_choices = len(prepared.prompts) * prepared.job.n

    async def events(self) -> AsyncIterator[list[TextDelta] | Completion]:
        """Batches of deltas (one per block at most), then the Completion last; a failed
        operation raises (after the deltas sent)."""
        completions, prepared = self.completions, self.prepared
        stop = prepared.job.sampling_params.stop
        shown = [StreamedText(prepared.tokenizer, stop) for _ in range(self.num_choices)]
        output = None
        if self.op is not None:
            op = self.op
            if prepared.streams_tokens:
                progress = completions.progress
                channel = progress.watch(op.id, asyncio.get_running_loop())
                try:
                    op = await completions.read(self.user, prepared.target, op)
                    while op.status not in OPERATION_TERMINAL:
                        drawn = await channel.take()
                        # A block's few tokens per choice: decoded on the loop, as they come.
                        deltas = [
                            TextDelta(index, text)
                            for index, tokens in sorted(drawn.items())
                            if (text := shown[index].add(tokens))
                        ]
                        if deltas:
                            yield deltas
                        if channel.closed:
                            op = channel.record or await completions.read(
                                self.user, prepared.target, op
                            )
                            break
                finally:
                    progress.forget(channel)
                output = _output(op)
            else:
                output = await completions._settled(self.user, prepared.target, op)
        completion = await completions._completed(self.user, prepared, output)
        rests = []
        for choice, streamed in zip(completion.choices, shown, strict=True):
            assert choice.text.startswith(streamed.shown), "a stream shows a prefix of the text"
            rest = choice.text[len(streamed.shown) :]
            if rest or choice.logprobs is not None or not streamed.shown:
                rests.append(TextDelta(choice.index, rest, choice.logprobs))
        yield rests
        yield completion


def _output(op: OperationRecord) -> SampleOutput:
    """A finished sample operation's output; its failure as the error to answer."""
    if op.error_code == OperationErrorCode.INVALID_INPUT:
        raise InvalidRequest(f"sample operation {op.id} failed: {op.error_message}")
    if op.status not in OPERATION_TERMINAL:
        raise EngineFailure(f"sample operation {op.id} did not finish: the server is stopping")
    if op.status != OperationStatus.COMPLETED:
        raise EngineFailure(f"sample operation {op.id} failed: {op.error_message}")
    assert isinstance(op.output, SampleOutput), f"{op.id} completed without a SampleOutput"
    return op.output


def _drawn(prepared: Prepared, output: SampleOutput | None) -> list[Drawn]:
    """n sequences per prompt, prompt-major (OpenAI's choice order), as the draw's `output`
    gave them (None: nothing drawn); each with its prompt's logprobs where the draw scored it."""
    job = prepared.job
    if output is None:
        return [Drawn(p, [], [], "length") for p in prepared.prompts for _ in range(job.n)]
    request = prepared.draw_request()
    scores_prompt = request is not None and request.prompt_logprobs
    return [
        Drawn(
            prompt,
            list(sequence.tokens),
            list(sequence.logprobs),
            "stop" if sequence.stop_reason == StopReason.STOP else "length",
            result if scores_prompt else None,
        )
        for prompt, result in zip(prepared.prompts, output.results, strict=True)
        for sequence in result.sequences
    ]


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
    """Each token's text (texts.token_texts: what decoding it adds to the text before it, a
    character split between tokens given whole to its last). `shown`: special tokens as their
    own text (the `tokens` of logprobs), else as none (the text)."""
    return token_texts(tokenizer, tokens, skip_special_tokens=not shown)


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
    cut = stop_cut("".join(texts), job.sampling_params.stop)
    if cut is not None:  # the stop string and what follows it are not returned
        # The tokens whose text starts before the cut (a token the stop string starts in).
        kept = bisect.bisect_left(list(itertools.accumulate(map(len, texts), initial=0)), cut)
        kept = min(kept, len(tokens))
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
    offsets = list(itertools.accumulate(map(len, texts), initial=0))[:-1]
    logprobs_out = TokenLogprobs(
        tokens=shown, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets
    )
    return Choice(index, text, finish_reason, logprobs_out, num_completion_tokens)
