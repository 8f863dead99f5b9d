"""Conformance with the SDK beyond the training path: the `tg` CLI runs against the server with
no project configured, responses survive the SDK's strict validation, and bad input (an
unsupported field, an unknown status filter, an unknown route) gets the API's error envelope."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL, low_level, open_session
from together import BadRequestError, NotFoundError, Together
from together.types import WhoamiUserJwt

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
TG = Path(sys.executable).with_name("tg")  # the SDK's console script, in the test venv


@pytest.fixture(scope="module")
def auto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the module, on `--device auto` (the flag that used to leak into gpu_type)."""
    directory = tmp_path_factory.mktemp("conformance")
    proc = ServerProcess.started(directory, "--device", "auto")
    yield proc
    proc.stop()


@dataclass(frozen=True)
class Created:
    resource_id: str
    session_id: str
    checkpoint_id: str


@pytest.fixture(scope="module")
def created(auto_server: ServerProcess) -> Iterator[Created]:
    """A resource, a RUNNING session on it and a training checkpoint of that session."""
    resources, session = open_session(auto_server.base_url)
    checkpoint = session.create_training_checkpoint()
    yield Created(resources.model_resources_id, session.session_id, checkpoint.id)
    session.stop()
    resources.stop()


def real_device() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def strict_client(base_url: str) -> Together:
    return Together(
        base_url=base_url, api_key=API_KEY, max_retries=0, _strict_response_validation=True
    )


# ---------------------------------------------------------------- the tg CLI


def tg(server: ServerProcess, home: Path, *args: str) -> str:
    """Run `tg` the way a user would: key and base URL from the environment, no project id, no
    stored login (a fresh HOME), no telemetry or version check (no network here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOGETHER_")}
    env |= {
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / "config"),
        "XDG_CACHE_HOME": str(home / "cache"),
        "TOGETHER_API_KEY": API_KEY,
        "TOGETHER_BASE_URL": server.base_url,
        "TOGETHER_TELEMETRY_DISABLED": "1",
        "TOGETHER_DISABLE_VERSION_CHECK": "1",
        "COLUMNS": "200",
    }
    done = subprocess.run(
        [str(TG), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, f"tg {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_cli_lists_and_gets_training_objects_with_no_project_configured(
    auto_server, created, tmp_path
):
    listed_resources = json.loads(tg(auto_server, tmp_path, "--json", "training", "ls-resources"))
    assert created.resource_id in [r["id"] for r in listed_resources["data"]]
    listed_sessions = json.loads(tg(auto_server, tmp_path, "--json", "training", "ls-sessions"))
    assert created.session_id in [s["id"] for s in listed_sessions["data"]]
    table = tg(auto_server, tmp_path, "--no-json", "training", "ls-checkpoints")
    assert created.checkpoint_id in table and created.session_id in table

    kinds = {
        created.resource_id: "model_resource",
        created.session_id: "training_session",
        created.checkpoint_id: "training_checkpoint",
    }
    for object_id, kind in kinds.items():
        got = json.loads(tg(auto_server, tmp_path, "--json", "training", "get", object_id))
        assert (got["kind"], got["data"]["id"]) == (kind, object_id)


def test_whoami_names_the_user_of_the_callers_key(auto_server, created):
    me = strict_client(auto_server.base_url).whoami()
    assert isinstance(me, WhoamiUserJwt)
    resource = low_level(auto_server.base_url).post_training.model_resources.retrieve(
        created.resource_id
    )
    assert me.user.id == resource.created_by
    anonymous = httpx.get(f"{auto_server.base_url}/v3/whoami")
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["type"] == "authentication_error"


# ---------------------------------------------------------------- strict response validation


def test_responses_pass_the_sdks_strict_validation_and_name_the_real_device(auto_server, created):
    client = strict_client(auto_server.base_url).post_training
    models = client.supported_models.get()
    model = next(m for m in models.data if m.base_model == BASE_MODEL)
    assert model.default_gpu_type == "B200-SXM"  # the only value the SDK's literal accepts
    assert [c.gpu_type for c in model.compute_configs] == ["B200-SXM"]
    assert model.compute_configs[0].device == real_device()  # extra field, kept by the SDK

    resource = client.model_resources.retrieve(created.resource_id)
    assert resource.compute_config.device == real_device()
    if real_device() == "cpu":
        assert resource.compute_config.gpu_type is None  # no SDK literal names a CPU
    listed = client.model_resources.list()
    assert created.resource_id in [r.id for r in listed.data]
    assert client.sessions.retrieve(created.session_id).resources_id == created.resource_id
    assert created.session_id in [s.id for s in client.sessions.list().data]
    assert client.checkpoints.retrieve(created.checkpoint_id).session_id == created.session_id
    assert created.checkpoint_id in [c.id for c in client.checkpoints.list().data]


def test_supported_models_offer_full_weight_training_with_the_engines_limits(auto_server):
    models = strict_client(auto_server.base_url).post_training.supported_models.get()
    trainer = models.data[0].compute_configs[0].trainer_config
    assert trainer.full is not None and trainer.lora is not None
    assert (trainer.full.max_batch_size, trainer.full.max_seq_length) == (
        trainer.lora.max_batch_size,
        trainer.lora.max_seq_length,
    )


# ---------------------------------------------------------------- refused input


def resource_ids(base_url: str) -> list[str]:
    page = low_level(base_url).post_training.model_resources.list(limit=100)
    return [r.id for r in page.data]


def test_base_weights_ref_is_refused_naming_it_and_creates_nothing(auto_server, created):
    client = low_level(auto_server.base_url).post_training
    before = resource_ids(auto_server.base_url)
    with pytest.raises(BadRequestError) as refused:
        client.model_resources.create(base_model=BASE_MODEL, base_weights_ref="registry/model")
    assert refused.value.body["error"]["param"] == "base_weights_ref"
    assert "base_weights_ref" in refused.value.body["error"]["message"]
    with pytest.raises(BadRequestError) as priced:
        client.model_resources.estimate_cost(
            base_model=BASE_MODEL, base_weights_ref="registry/model"
        )
    assert priced.value.body["error"]["param"] == "base_weights_ref"
    assert resource_ids(auto_server.base_url) == before


def test_unknown_status_filters_are_refused_naming_the_field(auto_server, created):
    client = low_level(auto_server.base_url).post_training
    with pytest.raises(BadRequestError) as resources:
        client.model_resources.list(status=["MODEL_RESOURCES_STATUS_READY", "READY"])
    assert resources.value.body["error"]["param"] == "status"
    assert "'READY'" in resources.value.body["error"]["message"]
    with pytest.raises(BadRequestError) as sessions:
        client.sessions.list(status=["TRAINING_SESSION_STATUS_BOGUS"])
    assert sessions.value.body["error"]["param"] == "status"

    ready = client.model_resources.list(status=["MODEL_RESOURCES_STATUS_READY"])
    assert created.resource_id in [r.id for r in ready.data]
    stopped = client.sessions.list(status=["TRAINING_SESSION_STATUS_STOPPED"])
    assert created.session_id not in [s.id for s in stopped.data]
    repeated = httpx.get(  # repeated keys mean the same as a comma list (api.md 0.4)
        f"{auto_server.base_url}/v1/rl/training-sessions",
        params=[
            ("status", "TRAINING_SESSION_STATUS_STOPPED"),
            ("status", "TRAINING_SESSION_STATUS_RUNNING"),
        ],
        headers=HEADERS,
    )
    assert created.session_id in [s["id"] for s in repeated.json()["data"]]


def test_unknown_routes_and_wrong_methods_answer_the_error_envelope(auto_server):
    unknown = httpx.get(f"{auto_server.base_url}/v1/rl/no-such-thing", headers=HEADERS)
    assert unknown.status_code == 404
    assert set(unknown.json()) == {"error"}
    assert unknown.json()["error"]["type"] == "not_found_error"
    assert "/v1/rl/no-such-thing" in unknown.json()["error"]["message"]

    wrong = httpx.delete(f"{auto_server.base_url}/v1/rl/supported-models", headers=HEADERS)
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "GET"
    assert wrong.json()["error"]["type"] == "invalid_request_error"
    assert "DELETE" in wrong.json()["error"]["message"]

    with pytest.raises(NotFoundError) as raised:  # what an SDK caller sees
        low_level(auto_server.base_url).get("/v1/rl/no-such-thing", cast_to=object)
    assert raised.value.body["error"]["type"] == "not_found_error"
