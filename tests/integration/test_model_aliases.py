"""`posttrain serve --model NAME=PATH` / `--model NAME=BUILTIN` end to end: the served name is a
supported model, resources and sessions are created on it through the SDK, and it computes
with the weights it names (a built-in under a hub name scores exactly as the built-in)."""

from __future__ import annotations

import shutil

import pytest
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL, low_level, sft_sample
from together.post_training import ModelResourcesClient

from posttrain.config import BUILTIN_MODEL_DIR

ALIAS = "Qwen/Qwen3-8B"  # the built-in tiny-qwen3 under a name the Tinker cookbook knows
DIR_ALIAS = "my-org/tiny"  # a copied directory under a name of its own
TOKENS = [1, 40, 41, 42, 50, 60, 70, 80, 33, 34, 35, 2]
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}


@pytest.fixture(scope="module")
def alias_server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("aliases")
    directory = root / "models" / "tiny"
    shutil.copytree(BUILTIN_MODEL_DIR, directory)
    proc = ServerProcess.started(
        root,
        "--poll-hold-seconds", "0",
        "--model", f"{ALIAS}={BASE_MODEL}",
        "--model", f"{DIR_ALIAS}={directory}",
    )  # fmt: skip
    yield proc
    proc.stop()


def logprobs_on(base_url: str, base_model: str) -> list[float]:
    resources = ModelResourcesClient.create(
        base_url=base_url, api_key=API_KEY, base_model=base_model, interval=0.2
    )
    session = resources.create_session(interval=0.2, lora_config={"rank": 4, "seed": 3})
    result = session.trainer.forward(samples=[sft_sample(TOKENS, 1)], loss=CE, interval=0.05)
    session.stop()
    resources.stop()
    return result.loss_fn_outputs[0].tensors["logprobs"].data


def test_the_served_names_are_supported_models_with_the_models_limits(alias_server):
    models = low_level(alias_server.base_url).post_training.supported_models.get()
    by_name = {m.base_model: m for m in models.data}
    assert list(by_name) == [BASE_MODEL, "posttrain/tiny-qwen3-moe", ALIAS, DIR_ALIAS]
    limits = {
        name: by_name[name].compute_configs[0].generator_config.context_length
        for name in (BASE_MODEL, ALIAS, DIR_ALIAS)
    }
    assert limits == {BASE_MODEL: 512, ALIAS: 512, DIR_ALIAS: 512}


def test_a_resource_on_a_served_name_computes_with_the_weights_it_names(alias_server):
    builtin = logprobs_on(alias_server.base_url, BASE_MODEL)
    assert len(builtin) == len(TOKENS) - 1
    assert logprobs_on(alias_server.base_url, ALIAS) == builtin
    assert logprobs_on(alias_server.base_url, DIR_ALIAS) == builtin
    page = low_level(alias_server.base_url).post_training.model_resources.list(limit=100)
    assert sorted(r.base_model for r in page.data) == sorted([BASE_MODEL, ALIAS, DIR_ALIAS])
