"""A `posttrain serve` at its defaults computes on every usable core when it serves a model wide
enough to repay a second thread, on one when it serves only narrow ones (the built-ins); its
idle OpenMP threads spin briefly, then sleep (libgomp says so as it loads); it reports both in
/metrics and at debug."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
from conftest import ServerProcess

from posttrain.engine.hosts.threads import SMALL_HIDDEN, SPIN_ROUNDS, WAIT_SETTINGS, usable_cores

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "model"))
import families  # noqa: E402


def test_a_default_server_beside_a_wide_model_uses_every_core_and_bounded_spins(
    tmp_path: Path, monkeypatch
):
    for name in WAIT_SETTINGS:  # the server's own default, not this process's setting
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_DISPLAY_ENV", "VERBOSE")
    wide = families.build(
        "qwen3",
        tmp_path / "wide",
        size=families.Size(hidden_size=SMALL_HIDDEN, num_hidden_layers=1),
    )
    proc = ServerProcess.started(tmp_path, "--log-level", "debug", "--model", str(wide))
    try:
        metrics = httpx.get(f"{proc.base_url}/metrics").text
        cores = usable_cores()
        spin = f"spin {SPIN_ROUNDS}"
        assert f'posttrain_engine_threads{{wait_policy="{spin}"}} {cores}' in metrics, metrics
        log = proc.log()
        line = f"torch intra-op threads {cores} (usable cores {cores}), OpenMP wait policy {spin}"
        assert line in log, log[-4000:]
        assert f"GOMP_SPINCOUNT = '{SPIN_ROUNDS}'" in log, log[
            -4000:
        ]  # what libgomp read when torch loaded
    finally:
        proc.stop()


def test_built_ins_alone_take_one_thread_and_a_users_spin_count_is_reported(
    tmp_path: Path, monkeypatch
):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "5000")
    proc = ServerProcess.started(tmp_path)
    try:
        metrics = httpx.get(f"{proc.base_url}/metrics").text
        assert 'posttrain_engine_threads{wait_policy="spin 5000"} 1' in metrics, metrics
    finally:
        proc.stop()
