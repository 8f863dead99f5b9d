"""The engine's intra-op thread count: the usable cores split between processes (one when every
model served is narrow), the config's count when given, and applied where an engine starts;
idle OpenMP threads spin briefly unless the user chose otherwise, as libgomp reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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
    [(1, 1, 1), (2, 1, 2), (3, 1, 3), (4, 1, 4), (16, 1, 16), (16, 2, 8), (16, 3, 5), (2, 4, 1)],
)
def test_the_default_is_all_the_cores_split_between_processes_at_least_one(
    monkeypatch, cores, processes, expected
):
    monkeypatch.setattr(threads, "usable_cores", lambda: cores)
    assert intra_op_threads(None, processes=processes) == expected


def model_dir(path: Path, hidden: int, *, multimodal: bool = False) -> Path:
    """A directory whose config.json gives `hidden` (all the thread rule reads)."""
    path.mkdir()
    config = {"hidden_size": hidden}
    config = (
        {"text_config": config, "vision_config": {"hidden_size": 4096}} if multimodal else config
    )
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_models_all_narrower_than_small_hidden_get_one_thread(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    narrow = model_dir(tmp_path / "narrow", threads.SMALL_HIDDEN - 1)
    wide = model_dir(tmp_path / "wide", threads.SMALL_HIDDEN)
    assert intra_op_threads(None, model_dirs=[BUILTIN_MODEL_DIR, narrow]) == 1
    assert intra_op_threads(None, model_dirs=[BUILTIN_MODEL_DIR, narrow, wide]) == 16
    assert intra_op_threads(None, processes=2, model_dirs=[wide]) == 8
    assert intra_op_threads(None, model_dirs=[tmp_path / "no-such-dir"]) == 16  # unknown: all
    assert intra_op_threads(3, model_dirs=[narrow]) == 3


def test_the_width_of_a_multimodal_model_is_its_text_models(tmp_path: Path):
    assert threads.widest_hidden([model_dir(tmp_path / "vl", 128, multimodal=True)]) == 128
    assert threads.widest_hidden([BUILTIN_MODEL_DIR]) == 128
    assert threads.widest_hidden([]) is None


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
    assert torch.get_num_threads() == 1  # the built-in model is narrow


def openmp_environment(program: str, **env: str) -> str:
    """What libgomp says it read (OMP_DISPLAY_ENV) in a fresh interpreter running `program`
    and then a parallel operator, with `env` and no wait setting of this process's. libgomp
    shows its unset default as PASSIVE too; what tells them apart is how long idle threads spin
    before they sleep: GOMP_SPINCOUNT, 300000 by default."""
    base = {k: v for k, v in os.environ.items() if k not in threads.WAIT_SETTINGS}
    script = f"{program}\nimport torch\ntorch.randn(512, 512) @ torch.randn(512, 512)\n"
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stderr


CALL = "from posttrain.engine.hosts.threads import bounded_openmp_spins as p\nprint(p())"


def test_bounded_spins_reach_libgomp_when_set_before_torch_loads():
    assert f"GOMP_SPINCOUNT = '{threads.SPIN_ROUNDS}'" in openmp_environment(CALL)
    # Without the call libgomp spins (its default), so the check above can fail.
    assert "GOMP_SPINCOUNT = '300000'" in openmp_environment("pass")


def test_a_users_wait_setting_wins():
    told = openmp_environment(CALL, OMP_WAIT_POLICY="ACTIVE")
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in told
    assert "GOMP_SPINCOUNT = '5000'" in openmp_environment(CALL, GOMP_SPINCOUNT="5000")
    assert "GOMP_SPINCOUNT = '0'" in openmp_environment(CALL, OMP_WAIT_POLICY="PASSIVE")


def test_after_torch_is_imported_the_policy_is_not_claimed(monkeypatch):
    for name in threads.WAIT_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert "torch" in sys.modules  # this module imported it
    assert threads.bounded_openmp_spins() is False
    assert not any(name in os.environ for name in threads.WAIT_SETTINGS)
    monkeypatch.setenv("GOMP_SPINCOUNT", "5000")
    assert threads.openmp_wait_policy() == "spin 5000"
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert threads.openmp_wait_policy() == "passive"


def test_threads_below_one_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="threads"):
        EngineConfig(threads=0)
