"""A `posttrain serve` at its defaults computes on every usable core, its idle OpenMP threads
sleep (libgomp says so as it loads), and it reports both in /metrics and at debug."""

from __future__ import annotations

from pathlib import Path

import httpx
from conftest import ServerProcess

from posttrain.engine.hosts.threads import WAIT_SETTINGS, usable_cores


def test_a_default_server_uses_every_core_and_passive_waits(tmp_path: Path, monkeypatch):
    for name in WAIT_SETTINGS:  # the server's own default, not this process's setting
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_DISPLAY_ENV", "VERBOSE")
    proc = ServerProcess.started(tmp_path, "--log-level", "debug")
    try:
        metrics = httpx.get(f"{proc.base_url}/metrics").text
        cores = usable_cores()
        assert f'posttrain_engine_threads{{wait_policy="passive"}} {cores}' in metrics, metrics
        log = proc.log()
        line = f"torch intra-op threads {cores} (usable cores {cores}), OpenMP wait policy passive"
        assert line in log, log[-4000:]
        assert "GOMP_SPINCOUNT = '0'" in log, log[-4000:]  # what libgomp read when torch loaded
    finally:
        proc.stop()


def test_threads_and_a_users_spin_count_are_reported_as_set(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    proc = ServerProcess.started(tmp_path, "--threads", "1")
    try:
        metrics = httpx.get(f"{proc.base_url}/metrics").text
        assert 'posttrain_engine_threads{wait_policy="spin 1000"} 1' in metrics, metrics
    finally:
        proc.stop()
