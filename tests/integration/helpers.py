"""Helpers shared by the integration tests: SDK clients pointed at a test server, and what
its /metrics says runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
from together import Together
from together.post_training import ModelResourcesClient, SessionClient

API_KEY = "test-key"
BASE_MODEL = "posttrain/tiny-qwen3"


def open_session(
    base_url: str, **session_args: object
) -> tuple[ModelResourcesClient, SessionClient]:
    resources = ModelResourcesClient.create(
        base_url=base_url, api_key=API_KEY, base_model=BASE_MODEL, interval=0.2
    )
    session = resources.create_session(interval=0.2, **session_args)
    return resources, session


def low_level(base_url: str) -> Together:
    return Together(base_url=base_url, api_key=API_KEY, max_retries=0)


def sft_sample(tokens: list[int], prompt_len: int) -> dict:
    """A cross-entropy sample: predict tokens[1:] from tokens[:-1], weights 0 on the prompt."""
    n = len(tokens) - 1
    weights = [0.0] * (prompt_len - 1) + [1.0] * (n - prompt_len + 1)
    return {
        "model_input": {"chunks": [{"encoded_text": {"tokens": tokens[:-1]}}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": tokens[1:], "dtype": "int64"},
            "weights": {"data": weights, "dtype": "float32"},
        },
    }


BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_bench(script: str, *args: str) -> str:
    """Run bench/<script> on one thread against this checkout; its stdout, after asserting it
    exited 0. The script's own folder, not the checkout, is on its sys.path: PYTHONPATH points
    it at this checkout (not at whichever one the venv's editable install names)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(BENCH.parent),
    }
    completed = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return completed.stdout


def running(base_url: str, kind: str) -> float:
    """How many operations of `kind` (`sample`, `forward-backward`) run now, from /metrics."""
    text = httpx.get(f"{base_url}/metrics").text
    pattern = rf'^posttrain_operations\{{kind="{kind}",status="running"\}} (\S+)$'
    match = re.search(pattern, text, re.M)
    return float(match.group(1)) if match else 0.0
