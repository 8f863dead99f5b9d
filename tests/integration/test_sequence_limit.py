"""The training-sample limit a server reports is the one it enforces: `--max-seq-length N`
lowers the model's context to N in GET /v1/rl/supported-models (both trainer configs) and the
Tinker capabilities, a sample of N tokens (model input + last target) trains, and one of N + 1
is a 400 naming the sample's field and both numbers. Against a real server."""

from __future__ import annotations

import uuid

import httpx
import pytest
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL, low_level, open_session, sft_sample

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
LIMIT = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("limit")
    proc = ServerProcess.started(directory, "--max-seq-length", str(LIMIT))
    yield proc
    proc.stop()


def reported(base_url: str) -> dict[str, int]:
    models = low_level(base_url).post_training.supported_models.get()
    (model,) = [m for m in models.data if m.base_model == BASE_MODEL]
    trainer = model.compute_configs[0].trainer_config
    assert trainer.full is not None and trainer.lora is not None
    caps = httpx.get(f"{base_url}/api/v1/get_server_capabilities", headers=HEADERS).json()
    (tinker,) = [m for m in caps["supported_models"] if m["model_name"] == BASE_MODEL]
    return {
        "lora": trainer.lora.max_seq_length,
        "full": trainer.full.max_seq_length,
        "tinker": tinker["max_context_length"],
        "context": model.compute_configs[0].generator_config.context_length,
    }


def test_the_reported_limit_is_the_enforced_one(server):
    limits = reported(server.base_url)
    # The model's context stays what sampling may span; training takes the flag's limit.
    assert limits == {"lora": LIMIT, "full": LIMIT, "tinker": LIMIT, "context": 512}
    resources, session = open_session(server.base_url)
    tokens = [3 + t % 90 for t in range(LIMIT + 1)]
    ce = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
    fits = session.trainer.forward_backward(samples=[sft_sample(tokens[:LIMIT], 1)], loss=ce)
    assert fits.loss > 0
    sessions = f"{server.base_url}/v1/rl/training-sessions"
    url = f"{sessions}/{session.session_id}/operations/forward-backward"
    over = httpx.post(
        url,
        json={"samples": [sft_sample(tokens, 1)], "loss": ce},
        headers={**HEADERS, "Idempotency-Key": str(uuid.uuid4())},
    )
    assert over.status_code == 400, over.text
    error = over.json()["error"]
    assert error["param"] == "samples[0].model_input"
    assert error["message"] == f"samples[0] has {LIMIT + 1} tokens; the maximum is {LIMIT}"
    session.stop()
    resources.stop()
