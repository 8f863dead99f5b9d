"""The OpenAI surface's text rules on the built-in tokenizer: token texts concatenate to the
text, a stop string is cut with what follows it, special tokens keep their place among the
tokens but add no text, echo puts the prompt first with a null first logprob (scored by the
draw itself where no top-k of a sampled token is asked for), and the built-in chat template
renders ChatML."""

from __future__ import annotations

from transformers import AutoTokenizer

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID
from posttrain.service.openai.chat import ChatMessage, ChatPrompt, chat_tokens
from posttrain.service.openai.completions import CompletionJob, Drawn, _choice, _needs_scoring
from posttrain.types import SampleResult, SamplingParams, TopkPromptLogprobs

TOKENIZER = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def job(
    *,
    stop: tuple[str, ...] = (),
    logprobs: int | None = 0,
    echo: bool = False,
    max_tokens: int = 8,
    temperature: float = 1.0,
):
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=stop)
    return CompletionJob("m", ("x",), params, logprobs=logprobs, echo=echo)


def test_a_stop_string_and_what_follows_are_cut_and_the_finish_is_stop():
    tokens = encode("46\n12")
    drawn = Drawn((1,), tokens, [-0.5] * len(tokens), "length")
    choice = _choice(TOKENIZER, 0, drawn, None, job(stop=("\n",)))
    assert choice.text == "46"
    assert choice.finish_reason == "stop"
    assert choice.logprobs is not None and choice.logprobs.tokens == ["4", "6"]
    assert choice.num_completion_tokens == 2


def test_a_final_eos_keeps_its_logprob_and_adds_no_text():
    tokens = [*encode("46"), TOKENIZER.eos_token_id]
    drawn = Drawn((1,), tokens, [-0.1, -0.2, -0.3], "stop")
    choice = _choice(TOKENIZER, 0, drawn, None, job())
    assert choice.text == "46"
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == ["4", "6", TOKENIZER.eos_token]
    assert choice.logprobs.token_logprobs == [-0.1, -0.2, -0.3]
    assert choice.logprobs.text_offset == [0, 1, 2]


def test_echo_puts_the_prompt_first_with_scored_logprobs_and_top_k():
    prompt = tuple(encode("1+2="))
    drawn = Drawn(prompt, encode("3"), [-0.25], "length")
    scored_length = len(prompt) + 1
    top = [TopkPromptLogprobs([], [])] + [
        TopkPromptLogprobs([encode("9")[0]], [-0.01]) for _ in range(scored_length - 1)
    ]
    score = SampleResult([], [], [0.0, -1.0, -2.0, -3.0, -0.25], top)
    choice = _choice(TOKENIZER, 0, drawn, score, job(logprobs=1, echo=True))
    logprobs = choice.logprobs
    assert choice.text == "1+2=3"
    assert logprobs is not None
    assert logprobs.tokens == ["1", "+", "2", "=", "3"]
    assert logprobs.token_logprobs == [None, -1.0, -2.0, -3.0, -0.25]
    assert logprobs.top_logprobs[0] is None
    assert logprobs.top_logprobs[4] == {"9": -0.01, "3": -0.25}
    assert logprobs.text_offset == [0, 1, 2, 3, 4]
    assert choice.num_completion_tokens == 1


def test_only_a_sampled_tokens_top_k_or_an_undrawn_echo_needs_a_scoring_operation():
    assert not _needs_scoring(job(logprobs=None, echo=True))
    assert not _needs_scoring(job(logprobs=0, echo=True))  # the draw scores its prompt
    assert _needs_scoring(job(logprobs=1, echo=True))
    assert _needs_scoring(job(logprobs=2, echo=True, temperature=0))
    # lm-eval's loglikelihood request: the greedy token is its own top-1
    assert not _needs_scoring(job(logprobs=1, echo=True, max_tokens=1, temperature=0))
    assert not _needs_scoring(job(logprobs=1, temperature=0))
    assert _needs_scoring(job(logprobs=0, echo=True, max_tokens=0))  # nothing drawn to score


def test_a_draw_that_scored_its_prompt_gives_the_greedy_token_as_its_own_top_1():
    prompt = tuple(encode("1+2="))
    top = [TopkPromptLogprobs([], [])] + [
        TopkPromptLogprobs([encode("9")[0]], [-0.01]) for _ in range(len(prompt) - 1)
    ]
    scored_prompt = SampleResult([], [], [0.0, -1.0, -2.0, -3.0], top)
    drawn = Drawn(prompt, encode("3"), [-0.25], "length", scored_prompt)
    greedy = job(logprobs=1, echo=True, max_tokens=1, temperature=0)
    logprobs = _choice(TOKENIZER, 0, drawn, scored_prompt, greedy).logprobs
    assert logprobs is not None
    assert logprobs.token_logprobs == [None, -1.0, -2.0, -3.0, -0.25]
    assert logprobs.top_logprobs[1] == {"9": -0.01, "+": -1.0}
    assert logprobs.top_logprobs[4] == {"3": -0.25}


def test_the_built_in_chat_template_renders_chatml_ending_in_the_assistant_turn():
    prompt = ChatPrompt((ChatMessage("user", "12+34="),))
    tokens = chat_tokens(TOKENIZER, BUILTIN_MODEL_ID, prompt)
    rendered = "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
    assert list(tokens) == encode(rendered)
