"""Shared by the examples: where the server is, the built-in model's tokenizer, the task.

Every example takes `--base-url URL` to use a running `posttrain serve` (or any server that
speaks the API); without it, the example starts `posttrain serve` on a free port itself and
stops it at the end. The API key comes from TOGETHER_API_KEY (a server started without
--api-key accepts any non-empty key).

Nothing here loads transformers, torch or the SDK on import (each takes seconds): the
tokenizer loads on first use, and each example imports the SDK after parsing its arguments,
so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID
from posttrain.demo.server import local_server

API_KEY = os.environ.get("TOGETHER_API_KEY", "local-key")
BASE_MODEL = BUILTIN_MODEL_ID


@functools.cache
def tokenizer():
    """The built-in model's tokenizer (a transformers PreTrainedTokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)


def eos() -> int:
    return tokenizer().eos_token_id


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The docstring as written, and each option's default after its help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return action.help
        return f"{action.help} (default: %(default)s)"


def parser(description: str | None) -> argparse.ArgumentParser:
    """An argument parser with --base-url; each example adds its own knobs."""
    result = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    result.add_argument(
        "--base-url",
        metavar="URL",
        help="a running server (default: start `posttrain serve` on a free port for the run)",
    )
    return result


@contextmanager
def server(base_url: str | None) -> Iterator[str]:
    """`base_url` itself, or the URL of a `posttrain serve` started for the duration."""
    if base_url:
        yield base_url
        return
    with local_server() as url:
        yield url


def encode(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False)


def decode(tokens: list[int]) -> str:
    return tokenizer().decode([int(t) for t in tokens], skip_special_tokens=True)


def model_input(tokens: list[int]) -> dict:
    return {"chunks": [{"encoded_text": {"tokens": tokens}}]}


def addition_problems(seed: int, count: int) -> list[tuple[str, str]]:
    """`count` (prompt, answer) pairs like ("<|im_start|>23+58=", "81\\n"), two-digit operands:
    the line format the built-in model was pretrained on."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        pairs.append((f"<|im_start|>{a}+{b}=", f"{a + b}\n"))
    return pairs


def greedy_accuracy(session, problems: list[tuple[str, str]], max_tokens: int = 5) -> float:
    """Share of problems whose greedy completion is exactly the answer then end-of-text."""
    results = session.generator.sample_batch(
        [model_input(encode(prompt)) for prompt, _ in problems],
        num_samples=1,
        sampling_params={"max_tokens": max_tokens, "temperature": 0.0},
    )
    correct = 0
    for (_, answer), result in zip(problems, results, strict=True):
        sequence = result.sequences[0]
        stopped = sequence.stop_reason == "STOP_REASON_STOP"
        correct += stopped and decode(sequence.tokens) == answer
    return correct / len(problems)


def addition_reward(completion: str, answer: str, *, stopped: bool) -> float:
    """1.0 for exactly the answer line then end-of-text. Otherwise partial credit, at most 0.5:
    half the share of the answer's characters that sit in their place. The untrained built-in
    model is almost never exactly right, and partial credit keeps the learning signal dense."""
    if stopped and completion == answer:
        return 1.0
    hits = sum(c == a for c, a in zip(completion, answer, strict=False))
    return 0.5 * hits / len(answer)
