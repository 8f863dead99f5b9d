"""What an OpenAI-surface `model` may name, through the `openai` SDK, on a server with two
users: tinker:// sampler paths, `<base>;<path>`, training-run paths, Together sessions and
inference checkpoints; another user's unpublished path reads as absent, a published one is
listed for them and serves them until it is unpublished."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import ServerProcess

ALICE, BOB = "key-alice", "key-bob"
BASE_MODEL = "posttrain/tiny-qwen3"
PROMPT = "<|im_start|>12+34=46"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("openai-models")
    keys = directory / "keys"
    keys.write_text(f"{ALICE} user_alice\n{BOB} user_bob\n")
    proc = ServerProcess.started(directory, "--keys-file", str(keys))
    yield proc
    proc.stop()


def tinker_call(server: ServerProcess, path: str, body: dict, key: str = ALICE) -> dict:
    headers = {"X-API-Key": key}
    url = f"{server.base_url}/api/v1/{path}"
    answer = httpx.post(url, headers=headers, json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    while "request_id" in reply and reply.get("type") != "create_session":
        done = httpx.post(
            f"{server.base_url}/api/v1/retrieve_future",
            headers=headers,
            json={"request_id": reply["request_id"]},
            timeout=60,
        ).json()
        if done.get("type") != "try_again":
            return done
    return reply


def saved_sampler_path(server: ServerProcess) -> tuple[str, str]:
    """(run model id, sampler path) of a fresh Tinker run of Alice's."""
    client = tinker_call(server, "create_session", {"tags": [], "sdk_version": "0.38.0"})
    created = tinker_call(
        server,
        "create_model",
        {
            "session_id": client["session_id"],
            "model_seq_id": 0,
            "base_model": BASE_MODEL,
            "lora_config": {"rank": 2, "seed": 0, "train_unembed": False},
        },
    )
    model_id = created["model_id"]
    body = {"model_id": model_id, "seq_id": 1, "path": "eval-me"}
    return model_id, tinker_call(server, "save_weights_for_sampler", body)["path"]


def echo_logprobs(server: ServerProcess, model: str, key: str = ALICE) -> list[float | None]:
    oai = openai.OpenAI(base_url=f"{server.base_url}/oai/api/v1", api_key=key, max_retries=0)
    reply = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0, temperature=0
    )
    return reply.choices[0].logprobs.token_logprobs


def test_a_tinker_path_each_way_serves_its_weights_and_only_to_its_owner(server):
    model_id, path = saved_sampler_path(server)
    assert path.startswith(f"tinker://{model_id}/sampler_weights/")
    # A fresh LoRA run's update is zero: its weights are the base model's.
    base = echo_logprobs(server, BASE_MODEL)
    for model in (path, f"{BASE_MODEL};{path}", f"tinker://{model_id}"):
        assert echo_logprobs(server, model) == pytest.approx(base, abs=1e-5), model
    oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=ALICE, max_retries=0)
    assert path in [m.id for m in oai.models.list()]
    with pytest.raises(openai.BadRequestError) as info:
        echo_logprobs(server, f"other/base;{path}")
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        echo_logprobs(server, path, key=BOB)
    with pytest.raises(openai.NotFoundError):
        echo_logprobs(server, f"tinker://{model_id}", key=BOB)
    with pytest.raises(openai.AuthenticationError):
        echo_logprobs(server, path, key="not-a-key")


def test_a_published_path_is_listed_for_and_serves_another_user_until_unpublished(server):
    model_id, path = saved_sampler_path(server)
    route = (
        f"{server.base_url}/api/v1/training_runs/{model_id}/checkpoints"
        f"/{path.split('/', 3)[3]}/publish"
    )
    bob = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=BOB, max_retries=0)
    assert path not in [m.id for m in bob.models.list()]
    assert httpx.post(route, headers={"X-API-Key": ALICE}).status_code == 204
    listed = {m.id: m.owned_by for m in bob.models.list()}
    assert listed[path] == "user_alice"
    owners = echo_logprobs(server, path)
    for model in (path, f"{BASE_MODEL};{path}"):
        assert echo_logprobs(server, model, key=BOB) == pytest.approx(owners, abs=1e-5), model
    with pytest.raises(openai.NotFoundError):  # the run itself stays Alice's
        echo_logprobs(server, f"tinker://{model_id}", key=BOB)
    assert httpx.delete(route, headers={"X-API-Key": ALICE}).status_code == 204
    assert path not in [m.id for m in bob.models.list()]
    with pytest.raises(openai.NotFoundError):
        echo_logprobs(server, path, key=BOB)
