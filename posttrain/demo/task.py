"""The demo's task: two-digit addition with a program-checked, exact-match reward.

A problem is a pair (a, b) with 10 <= a, b <= 99. Its prompt is ``<|im_start|>a+b=`` and the
one correct completion is ``str(a + b) + "\\n"`` followed by ``<|endoftext|>``: exactly the
line format the built-in model was pretrained on (scripts/build_tiny_model.py), so the
warm-up only has to sharpen arithmetic, not teach a format.

The held-out problems are drawn first from the seed and never appear in training.
This module is pure Python (no SDK, no torch), so it is cheap to test.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TypedDict

IM_START = "<|im_start|>"
LOW, HIGH = 10, 99


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{IM_START}{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return f"{self.a + self.b}\n"


def split_problems(seed: int, num_heldout: int) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out): every pair in [10, 99]^2, shuffled by `seed`; the first
    `num_heldout` are held out."""
    pairs = [Problem(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs[num_heldout:], pairs[:num_heldout]


def reward(problem: Problem, completion: str, *, stopped: bool) -> float:
    """1.0 for exactly the answer line followed by end-of-text, else 0.0.

    `completion` is the decoded sampled text without special tokens; `stopped` says the
    sequence ended on end-of-text rather than by running out of tokens."""
    return 1.0 if stopped and completion == problem.answer else 0.0


class HeldoutExample(TypedDict):
    """One held-out answer, as summary.json and the closing printout show it."""

    prompt: str  # "12+34="
    completion: str
    expected: str  # "46"
    correct: bool


def judged(problem: Problem, completion: str, *, stopped: bool) -> HeldoutExample:
    """`completion` judged by the reward the held-out accuracy counts, in one place."""
    return HeldoutExample(
        prompt=f"{problem.a}+{problem.b}=",
        completion=completion.strip(),
        expected=problem.answer.strip(),
        correct=reward(problem, completion, stopped=stopped) > 0,
    )


def group_advantages(rewards_G: list[float], *, normalize: bool) -> list[float]:
    """Group-relative advantages (GRPO): reward minus the group mean, optionally divided by
    the group's standard deviation (DeepSeekMath, arXiv 2402.03300, section 4.1.2). A group
    whose rewards are all equal gets zeros: it carries no signal about which sample is better.
    """
    mean = sum(rewards_G) / len(rewards_G)
    centred_G = [r - mean for r in rewards_G]
    if not normalize:
        return centred_G
    std = (sum(c * c for c in centred_G) / len(centred_G)) ** 0.5
    return [c / std if std > 0 else 0.0 for c in centred_G]
