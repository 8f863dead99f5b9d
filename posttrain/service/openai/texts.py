"""A token sequence's text, token by token, in time linear in its length; and what a streamed
reply may show of a sequence still being drawn.

A token's text is what decoding it adds to the text of the tokens before it, except that a
text ending in U+FFFD (the bytes of a character not complete yet, or bytes that are no text)
is held and given to the first later token whose text does not: so a multi-byte character is
never split between two tokens, and the texts of the tokens concatenate to the decoded text.
The last token of a sequence gets whatever is held. Decoding every prefix (what the rule says)
costs time quadratic in the length, so `TokenTexts` decodes from the token after the
second-to-last point where text was given instead: a difference of two decodes that start at
one token, which equals the difference of the whole prefixes' decodes for the tokenizers
transformers ships (a byte-level or SentencePiece decoder is local past a character boundary).

`StreamedText` is one choice of a streamed reply: the text of the tokens drawn so far, less
what may still change (a held character) or be cut (the longest tail that may begin a stop
string), and nothing past a stop string: what it shows is always a prefix of the choice's final
text (service/openai/completions.py `_choice`).

Imports: nothing of posttrain.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


class TokenTexts:
    """Each token's text as tokens come (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self._start = 0  # the window's first token: decodes start here
        self._given = 0  # tokens whose text was given
        self._before = ""  # the text of tokens[_start:_given]

    def _decoded(self, end: int) -> str:
        text = self.tokenizer.decode(
            self.tokens[self._start : end], skip_special_tokens=self.skip_special_tokens
        )
        assert isinstance(text, str), "decoding one sequence gives one text"
        return text

    def add(self, token: int) -> str:
        """The text `token` adds after the tokens added before it ("" while held)."""
        self.tokens.append(token)
        text = self._decoded(len(self.tokens))
        if text.endswith(REPLACEMENT):
            return ""
        added = text[len(self._before) :]
        # The next window starts at this text's first token, so a decoder that reads a token
        # before (a SentencePiece leading space) sees the same one in both decodes.
        self._start, self._given = self._given, len(self.tokens)
        self._before = self._decoded(self._given)
        return added

    def held(self) -> str:
        """The text held (the sequence ended: it goes to its last token)."""
        if self._given == len(self.tokens):
            return ""
        return self._decoded(len(self.tokens))[len(self._before) :]


def token_texts(
    tokenizer: PreTrainedTokenizerBase, tokens: list[int], *, skip_special_tokens: bool
) -> list[str]:
    """Each token's text; they concatenate to the sequence's text."""
    texts = TokenTexts(tokenizer, skip_special_tokens=skip_special_tokens)
    out = [texts.add(token) for token in tokens]
    if out:
        out[-1] += texts.held()
    return out


def stop_cut(text: str, stop: tuple[str, ...]) -> int | None:
    """Where the earliest stop string starts in `text`, if one occurs."""
    found = [text.find(s) for s in stop if s and s in text]
    return min(found) if found else None


class StreamedText:
    """What a streamed reply shows of one choice while its sequence is drawn."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...]) -> None:
        self._texts = TokenTexts(tokenizer, skip_special_tokens=True)
        self._stop = stop
        # A stop string may begin in the last len - 1 characters without being whole yet.
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._text = ""  # the text of the tokens so far (held characters aside)
        self.shown = ""  # what was shown
        self._stopped = False

    def add(self, tokens: list[int]) -> str:
        """The text to show after `tokens` were drawn ("" if none may be shown yet)."""
        if self._stopped:
            return ""
        self._text += "".join(self._texts.add(token) for token in tokens)
        cut = stop_cut(self._text, self._stop)
        if cut is not None:
            self._stopped = True
            end = cut
        else:
            end = len(self._text) - self._hold
        if end <= len(self.shown):
            return ""
        new = self._text[len(self.shown) : end]
        self.shown += new
        return new
