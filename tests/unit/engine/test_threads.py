"""The engine's intra-op thread count: half the usable cores split between processes, the
config's count when given, and applied where an engine starts."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.hosts import threads
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.hosts.threads import intra_op_threads, usable_cores


@pytest.fixture(autouse=True)
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_usable_cores_is_this_process_affinity():
    assert usable_cores() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("cores", "processes", "expected"),
    [(1, 1, 1), (2, 1, 1), (3, 1, 1), (4, 1, 2), (16, 1, 8), (16, 2, 4), (16, 3, 2), (2, 2, 1)],
)
def test_the_default_is_half_the_cores_split_between_processes_at_least_one(
    monkeypatch, cores, processes, expected
):
    monkeypatch.setattr(threads, "usable_cores", lambda: cores)
    assert intra_op_threads(None, processes=processes) == expected


def test_a_requested_count_wins_whatever_the_cores(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    assert intra_op_threads(3) == 3
    assert intra_op_threads(3, processes=4) == 3


def test_an_engine_sets_torch_threads_from_its_config():
    paths = {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}
    torch.set_num_threads(2)
    LocalEngine(EngineConfig(device="cpu", threads=1), paths)
    assert torch.get_num_threads() == 1
    LocalEngine(EngineConfig(device="cpu", threads=2), paths)
    assert torch.get_num_threads() == 2
    LocalEngine(EngineConfig(device="cpu"), paths)
    assert torch.get_num_threads() == max(1, usable_cores() // 2)


def test_threads_below_one_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="threads"):
        EngineConfig(threads=0)
