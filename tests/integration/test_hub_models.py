"""`posttrain serve --model ORG/NAME` end to end: a hub id cached in HF_HOME is served, with
HF_HUB_OFFLINE=1, under that id (the name tinker-cookbook picks its renderer by) and computes
with the cached weights; an uncached one offline stops start-up with exit status 2 and one
line. The cache is seeded as huggingface_hub lays its own out; nothing is downloaded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL, low_level, sft_sample
from hub_cache import seed_hub_model
from together.post_training import ModelResourcesClient

from posttrain.config import BUILTIN_MODEL_DIR

HUB_ID = "my-org/tiny-qwen3"  # the built-in tiny-qwen3's files, cached under a hub id
TOKENS = [1, 40, 41, 42, 50, 60, 70, 80, 33, 34, 35, 2]


@pytest.fixture
def hub_server(tmp_path, monkeypatch):
    hf_home = tmp_path / "hf"
    seed_hub_model(hf_home / "hub", HUB_ID, BUILTIN_MODEL_DIR)
    monkeypatch.setenv("HF_HOME", str(hf_home))  # the server process inherits it
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    proc = ServerProcess.started(tmp_path, "--poll-hold-seconds", "0", "--model", HUB_ID)
    yield proc
    proc.stop()


def logprobs_on(base_url: str, base_model: str) -> list[float]:
    resources = ModelResourcesClient.create(
        base_url=base_url, api_key=API_KEY, base_model=base_model, interval=0.2
    )
    session = resources.create_session(interval=0.2, lora_config={"rank": 4, "seed": 3})
    result = session.trainer.forward(
        samples=[sft_sample(TOKENS, 1)], loss={"type": "LOSS_TYPE_CROSS_ENTROPY"}, interval=0.05
    )
    session.stop()
    resources.stop()
    return result.loss_fn_outputs[0].tensors["logprobs"].data


def test_a_cached_hub_id_is_served_offline_under_that_id(hub_server):
    models = low_level(hub_server.base_url).post_training.supported_models.get()
    assert [m.base_model for m in models.data] == [BASE_MODEL, "posttrain/tiny-qwen3-moe", HUB_ID]
    served = logprobs_on(hub_server.base_url, HUB_ID)
    assert len(served) == len(TOKENS) - 1
    assert served == logprobs_on(hub_server.base_url, BASE_MODEL)
    # Resolving imported huggingface_hub before stay_offline(): its bars are off all the same.
    assert "Loading weights" not in hub_server.log()


def test_an_uncached_hub_id_offline_exits_2_with_one_line(tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    completed = subprocess.run(
        [sys.executable, "-m", "posttrain", "serve", "--model", "my-org/absent",
         "--port", "0", "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert completed.returncode == 2, completed.stderr
    lines = completed.stderr.splitlines()
    assert len(lines) == 1, completed.stderr
    assert lines[0].startswith(
        "posttrain: --model my-org/absent: no such directory, and not in the Hugging Face"
        " cache while offline"
    )
    assert "hf download my-org/absent" in lines[0]
