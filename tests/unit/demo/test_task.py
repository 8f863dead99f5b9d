"""The demo's addition task: disjoint splits, exact-match reward, group-relative advantages."""

from __future__ import annotations

import math

from posttrain.demo.loop import k3_kl
from posttrain.demo.task import Problem, group_advantages, reward, split_problems


def test_split_is_disjoint_complete_and_seeded():
    train, heldout = split_problems(seed=0, num_heldout=200)
    assert len(heldout) == 200 and len(train) + len(heldout) == 90 * 90
    assert not set(train) & set(heldout)
    assert split_problems(seed=0, num_heldout=200) == (train, heldout)
    assert split_problems(seed=1, num_heldout=200)[1] != heldout


def test_reward_is_exact_match_with_end_of_text():
    problem = Problem(23, 58)
    assert problem.prompt == "<|im_start|>23+58=" and problem.answer == "81\n"
    assert reward(problem, "81\n", stopped=True) == 1.0
    assert reward(problem, "81\n", stopped=False) == 0.0  # ran out of tokens instead
    assert reward(problem, "81", stopped=True) == 0.0
    assert reward(problem, "810\n", stopped=True) == 0.0


def test_group_advantages_center_and_optionally_scale():
    assert group_advantages([1.0, 0.0, 0.0, 0.0], normalize=False) == [0.75, -0.25, -0.25, -0.25]
    scaled = group_advantages([1.0, 0.0, 0.0, 0.0], normalize=True)
    std = math.sqrt((0.75**2 + 3 * 0.25**2) / 4)
    assert scaled == [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std]
    assert group_advantages([1.0, 1.0], normalize=True) == [0.0, 0.0]


def test_k3_kl_is_zero_on_policy_and_positive_otherwise():
    assert k3_kl(-1.5, -1.5) == 0.0
    u = -0.5 - (-1.0)
    assert k3_kl(-0.5, -1.0) == math.exp(u) - u - 1 > 0
