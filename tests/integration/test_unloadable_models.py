"""A `--model DIR` whose config and tokenizer pass the start-up check but whose weights cannot be
loaded (a truncated or a missing `model.safetensors`): the server starts, and creating a model
resource on it fails at once with PROVISIONING_FAILED and a message naming the directory and
the reason, through the SDK; the server keeps serving its other models."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL, low_level, sft_sample
from together.post_training import ModelResourcesClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "model"))
import families  # noqa: E402

PROVISIONING_FAILED = "MODEL_RESOURCES_ERROR_CODE_PROVISIONING_FAILED"


def truncate_weights(directory: Path) -> None:
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def remove_weights(directory: Path) -> None:
    (directory / "model.safetensors").unlink()


DAMAGE = {"truncated": truncate_weights, "no-weights": remove_weights}
REASON = {
    "truncated": "SafetensorError: Error while deserializing header",
    "no-weights": "OSError: Error no file named model.safetensors",
}


@pytest.fixture(scope="module")
def damaged_server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("damaged")
    dirs = {}
    for name, damage in DAMAGE.items():
        dirs[name] = families.build("qwen3", root / "models" / name)
        damage(dirs[name])
    model_args = [arg for d in dirs.values() for arg in ("--model", str(d))]
    proc = ServerProcess.started(root, "--poll-hold-seconds", "0", *model_args)
    yield proc, dirs
    proc.stop()


@pytest.mark.parametrize("name", list(DAMAGE))
def test_a_model_whose_weights_cannot_load_fails_resource_create_naming_it(name, damaged_server):
    server, dirs = damaged_server
    client = low_level(server.base_url).post_training
    created = client.model_resources.create(base_model=name)
    assert created.status == "MODEL_RESOURCES_STATUS_ERROR"
    assert created.error is not None
    assert created.error.code == PROVISIONING_FAILED
    assert created.error.message.startswith(f"model {dirs[name]}: its weights cannot be loaded")
    assert REASON[name] in created.error.message
    assert client.model_resources.retrieve(created.id).error.message == created.error.message

    # The SDK's own client stops waiting at the terminal status instead of hanging.
    with pytest.raises(RuntimeError, match="terminal status MODEL_RESOURCES_STATUS_ERROR"):
        ModelResourcesClient.create(
            base_url=server.base_url, api_key=API_KEY, base_model=name, interval=0.2
        )


def test_the_server_keeps_serving_its_loadable_models(damaged_server):
    server, _ = damaged_server
    resources = ModelResourcesClient.create(
        base_url=server.base_url, api_key=API_KEY, base_model=BASE_MODEL, interval=0.2
    )
    session = resources.create_session(interval=0.2, lora_config={"rank": 4, "seed": 5})
    result = session.trainer.forward(
        samples=[sft_sample([1, 40, 41, 42, 0], 1)],
        loss={"type": "LOSS_TYPE_CROSS_ENTROPY"},
        interval=0.05,
    )
    assert result.loss > 0
