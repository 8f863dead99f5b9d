"""The OpenAI surface's text rules on the built-in tokenizer: token texts concatenate to the
text, a stop string is cut with what follows it, special tokens keep their place among the
tokens but add no text, echo puts the prompt first with a null first logprob (scored by the
draw itself where no top-k of a sampled token is asked for), and the built-in chat template
renders ChatML. Token texts, computed in linear time, equal decoding prefix by prefix (a
character split between tokens given whole to its last); a streamed choice shows a prefix of
its final text and nothing past a stop string."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID
from posttrain.service.openai.chat import ChatMessage, ChatPrompt, chat_tokens
from posttrain.service.openai.completions import CompletionJob, Drawn, _choice, _needs_scoring
from posttrain.service.openai.texts import StreamedText, token_texts
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


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2's and Qwen's kind) over text with multi-byte characters, so
    random ids split characters between tokens; with special tokens."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(["hello world héllo € 日本語 😀 naïve café 12+34=46"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


def quadratic_texts(tokenizer, tokens: list[int], *, skip: bool, hold: bool) -> list[str]:
    """The rule decoded prefix by prefix: what each prefix's text adds to the last one given;
    `hold`: a text ending in U+FFFD is given later (never on the last token)."""
    texts, given = [], ""
    for end in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:end], skip_special_tokens=skip)
        if hold and end < len(tokens) and text.endswith("\ufffd"):
            texts.append("")
            continue
        texts.append(text[len(given) :])
        given = text
    return texts


def test_token_texts_equal_prefix_by_prefix_decoding_and_concatenate_to_the_text():
    rng = random.Random(0)
    byte_level = byte_level_tokenizer()
    for tokenizer in (TOKENIZER, byte_level):
        sentences = ["héllo € 日本語 😀 naïve", "12+34=46\n", "<|im_start|>user\nhi<|im_end|>"]
        sequences = [
            encode(text) if tokenizer is TOKENIZER else tokenizer.encode(text) for text in sentences
        ]
        sequences += [
            [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))] for _ in range(200)
        ]
        for tokens in sequences:
            for skip in (True, False):
                ours = token_texts(tokenizer, tokens, skip_special_tokens=skip)
                assert ours == quadratic_texts(tokenizer, tokens, skip=skip, hold=True)
                assert "".join(ours) == tokenizer.decode(tokens, skip_special_tokens=skip)
                if tokenizer is TOKENIZER:  # no character spans tokens: no text is held
                    assert ours == quadratic_texts(tokenizer, tokens, skip=skip, hold=False)
    split = byte_level.encode("€")
    assert len(split) > 1  # one character in several tokens: given whole to its last
    assert token_texts(byte_level, split, skip_special_tokens=True) == [""] * (len(split) - 1) + [
        "€"
    ]


def test_a_streamed_choice_shows_a_prefix_of_its_final_text_and_nothing_past_a_stop():
    rng = random.Random(1)
    tokenizer = byte_level_tokenizer()
    vocab = len(tokenizer)
    for trial in range(300):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 50))]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        stop: tuple[str, ...] = ()
        if trial % 2 and len(text) > 4:
            start = rng.randrange(len(text) - 2)
            stop = (text[start : start + rng.randrange(1, 3)], "never seen")
        final = _choice(
            tokenizer,
            0,
            Drawn((1,), tokens, [-0.5] * len(tokens), "length"),
            None,
            job(stop=stop, logprobs=None),
        ).text
        streamed = StreamedText(tokenizer, stop)
        shown = ""
        at = 0
        while at < len(tokens):  # blocks of 1 to 4 tokens
            block = tokens[at : at + rng.randrange(1, 5)]
            at += len(block)
            shown += streamed.add(block)
            assert final.startswith(shown)
            assert not any(s in shown for s in stop)
        assert shown == streamed.shown


class CountingDecoder:
    """The built-in tokenizer's decode, counting the tokens it is given."""

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, tokens: list[int], *, skip_special_tokens: bool) -> str:
        self.decoded += len(tokens)
        return TOKENIZER.decode(tokens, skip_special_tokens=skip_special_tokens)


def test_token_texts_decode_a_bounded_number_of_tokens_per_token():
    tokens = encode("12+34=46 reverse reverse ") * 200  # 5,000 tokens
    counting = CountingDecoder()
    texts = token_texts(counting, tokens, skip_special_tokens=True)  # type: ignore[arg-type]
    assert "".join(texts) == TOKENIZER.decode(tokens)
    assert counting.decoded <= 6 * len(tokens)  # prefix by prefix: n(n + 1)/2 of them
