"""The Tinker wire's training-run and checkpoint REST routes over raw HTTP against a real
`posttrain serve`, as the tinker 0.38 RestClient sends them (`X-API-Key`, checkpoint ids with a
slash in the URL, 204 answers to mutations) and with the fields its response models require.
Users from a keys file: another user's runs and checkpoints read as absent. The last test runs
the real SDK's RestClient (tests/tinker_env.py's interpreter) over the same routes."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess

ALICE, BOB, CAROL, DAVE = "tml-alice", "tml-bob", "tml-carol", "tml-dave"
BASE_MODEL = "posttrain/tiny-qwen3"
SCENARIO = Path(__file__).parent / "tinker_native" / "rest_checkpoints.py"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("tinker-checkpoints")
    keys = directory / "keys"
    keys.write_text(f"{ALICE} user_alice\n{BOB} user_bob\n{CAROL} user_carol\n{DAVE} user_dave\n")
    proc = ServerProcess.started(directory, "--keys-file", str(keys))
    yield proc
    proc.stop()


def call(
    server: ServerProcess, method: str, path: str, key: str = ALICE, **kwargs: object
) -> httpx.Response:
    headers = {"X-API-Key": key, "X-Idempotency-Key": f"stainless-python-retry-{path}"}
    return httpx.request(
        method, f"{server.base_url}/api/v1/{path}", headers=headers, timeout=60, **kwargs
    )


def result(server: ServerProcess, answer: httpx.Response, key: str = ALICE) -> dict:
    assert answer.status_code == 200, answer.text
    request_id = answer.json()["request_id"]
    while True:  # each retrieve is held until the operation ends or the hold passes
        done = call(server, "POST", "retrieve_future", key, json={"request_id": request_id})
        done = done.json()
        if done.get("type") != "try_again":
            return done


def new_run(server: ServerProcess, metadata: dict[str, str], key: str = ALICE) -> str:
    client = call(server, "POST", "create_session", key, json={"tags": [], "sdk_version": "0.38.0"})
    created = call(
        server,
        "POST",
        "create_model",
        key,
        json={
            "session_id": client.json()["session_id"],
            "model_seq_id": 0,
            "base_model": BASE_MODEL,
            "lora_config": {"rank": 2, "seed": 0, "train_unembed": False},
            "user_metadata": metadata,
        },
    )
    return result(server, created, key)["model_id"]


def save(
    server: ServerProcess, model_id: str, seq: int, name: str, sampler: bool, key: str = ALICE
) -> str:
    route = "save_weights_for_sampler" if sampler else "save_weights"
    body = {"model_id": model_id, "seq_id": seq, "path": name, "user_metadata": {"n": str(seq)}}
    return result(server, call(server, "POST", route, key, json=body), key)["path"]


def error_param(answer: httpx.Response) -> str:
    return answer.json()["error"]["param"]


def test_runs_and_checkpoints_answer_what_the_sdk_models_require(server):
    model_id = new_run(server, {"renderer_name": "qwen3"}, CAROL)
    trained = save(server, model_id, 1, "step-1", sampler=False, key=CAROL)
    sampler = save(server, model_id, 2, "final", sampler=True, key=CAROL)
    assert trained == f"tinker://{model_id}/weights/step-1"

    run = call(server, "GET", f"training_runs/{model_id}", CAROL, params={"access_scope": "owned"})
    assert run.status_code == 200, run.text
    body = run.json()
    assert body["training_run_id"] == model_id and body["base_model"] == BASE_MODEL
    assert (body["model_owner"], body["is_lora"], body["lora_rank"]) == ("user_carol", True, 2)
    assert body["corrupted"] is False
    assert body["user_metadata"] == {"renderer_name": "qwen3"}
    assert datetime.fromisoformat(body["last_request_time"]).tzinfo is not None
    assert body["last_checkpoint"]["tinker_path"] == trained
    assert body["last_sampler_checkpoint"]["tinker_path"] == sampler

    listed = call(server, "GET", f"training_runs/{model_id}/checkpoints", CAROL).json()[
        "checkpoints"
    ]
    assert [c["checkpoint_id"] for c in listed] == ["sampler_weights/final", "weights/step-1"]
    for checkpoint in listed:
        assert checkpoint["checkpoint_type"] in ("training", "sampler")
        assert checkpoint["size_bytes"] > 0 and checkpoint["public"] is False
        assert checkpoint["expires_at"] is None
        datetime.fromisoformat(checkpoint["time"])
    assert listed[1]["user_metadata"] == {"n": "1"}

    page = call(server, "GET", "checkpoints", CAROL, params={"limit": 1, "offset": 1}).json()
    assert [c["tinker_path"] for c in page["checkpoints"]] == [trained]
    assert page["cursor"] == {"offset": 1, "limit": 1, "total_count": 2}
    runs = call(server, "GET", "training_runs", CAROL, params={"limit": 20, "offset": 0}).json()
    assert [r["training_run_id"] for r in runs["training_runs"]] == [model_id]
    assert runs["cursor"]["total_count"] == 1

    info = call(server, "POST", "weights_info", CAROL, json={"tinker_path": trained}).json()
    assert info == {
        "base_model": BASE_MODEL,
        "is_lora": True,
        "lora_rank": 2,
        "train_unembed": False,
        "train_mlp": True,
        "train_attn": True,
        "optimizer_config": {"type": "adamw"},
    }
    bad = call(server, "GET", "checkpoints", CAROL, params={"limit": 0})
    assert bad.status_code == 400 and error_param(bad) == "limit"


def test_ttl_publish_and_delete_through_the_checkpoint_id_in_the_url(server):
    model_id = new_run(server, {})
    path = save(server, model_id, 1, "shared", sampler=True)
    route = f"training_runs/{model_id}/checkpoints/sampler_weights/shared"

    assert call(server, "PUT", f"{route}/ttl", json={"ttl_seconds": 86400}).status_code == 204
    (listed,) = call(server, "GET", f"training_runs/{model_id}/checkpoints").json()["checkpoints"]
    assert datetime.fromisoformat(listed["expires_at"]) > datetime.fromisoformat(listed["time"])
    assert call(server, "PUT", f"{route}/ttl", json={"ttl_seconds": None}).status_code == 204
    (listed,) = call(server, "GET", f"training_runs/{model_id}/checkpoints").json()["checkpoints"]
    assert listed["expires_at"] is None
    bad = call(server, "PUT", f"{route}/ttl", json={"ttl_seconds": 0})
    assert bad.status_code == 400 and error_param(bad) == "ttl_seconds"

    # Bob sees nothing of Alice's until she publishes; then the checkpoint, not the rest.
    hidden = call(server, "GET", f"training_runs/{model_id}", key=BOB)
    assert hidden.status_code == 404 and error_param(hidden) == "training_run_id"
    info = call(server, "POST", "weights_info", key=BOB, json={"tinker_path": path})
    assert info.status_code == 404 and error_param(info) == "tinker_path"
    assert call(server, "DELETE", route, key=BOB).status_code == 404
    assert call(server, "POST", f"{route}/publish").status_code == 204
    assert call(server, "POST", f"{route}/publish").status_code == 204  # already public
    info = call(server, "POST", "weights_info", key=BOB, json={"tinker_path": path})
    assert info.status_code == 200 and info.json()["lora_rank"] == 2
    seen = call(
        server, "GET", f"training_runs/{model_id}", key=BOB, params={"access_scope": "accessible"}
    )
    assert seen.status_code == 200 and seen.json()["last_sampler_checkpoint"]["public"] is True
    assert call(server, "DELETE", f"{route}/publish").status_code == 204
    info = call(server, "POST", "weights_info", key=BOB, json={"tinker_path": path})
    assert info.status_code == 404

    assert call(server, "DELETE", route).status_code == 204
    assert call(server, "GET", f"training_runs/{model_id}/checkpoints").json()["checkpoints"] == []
    again = call(server, "DELETE", route)
    assert again.status_code == 404 and error_param(again) == "checkpoint_id"
    gone = call(server, "POST", "weights_info", json={"tinker_path": path})
    assert gone.status_code == 404


def test_the_sdk_rest_client_reads_lists_and_changes_checkpoints(tinker_python, server):
    done = subprocess.run(
        [tinker_python, str(SCENARIO), server.base_url, DAVE],
        capture_output=True,
        text=True,
        timeout=600,
        env={"TINKER_TELEMETRY": "0", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, f"{done.stderr[-4000:]}\n{server.log()[-3000:]}"
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    state, weights = seen["paths"]
    model_id = seen["run"]["id"]
    assert state == f"tinker://{model_id}/weights/s1"
    assert seen["run"] == {
        "id": model_id,
        "base_model": BASE_MODEL,
        "lora_rank": 4,
        "user_metadata": {"renderer": "qwen3"},
        "last": state,
        "last_sampler": weights,
    }
    assert [c[:2] for c in seen["listed"]] == [
        ["sampler_weights/w1", "sampler"],
        ["weights/s1", "training"],
    ]
    assert all(c[2] > 0 for c in seen["listed"])
    assert seen["page"] == [1, 2]
    assert seen["runs"] == [[model_id], 1]
    assert seen["info"] == [BASE_MODEL, True, 4, "adamw"]
    assert seen["ttl_s"][0] == pytest.approx(7200, abs=120) and seen["ttl_s"][1] is None
    assert seen["public"] == [True, False]
    assert seen["after_delete"] == [weights]
    assert "404" in seen["deleted_again"] and "checkpoint_id" in seen["deleted_again"]


def test_a_published_path_is_sampled_and_loaded_by_another_user(server):
    model_id = new_run(server, {})
    sampler_path = save(server, model_id, 1, "to-share", sampler=True)
    state_path = save(server, model_id, 2, "state-to-share", sampler=False)
    bob = call(server, "POST", "create_session", BOB, json={"tags": [], "sdk_version": "0.38.0"})
    session = bob.json()["session_id"]

    def sampler_of(path: str, seq: int) -> httpx.Response:
        body = {"session_id": session, "sampling_session_seq_id": seq, "model_path": path}
        return call(server, "POST", "create_sampling_session", BOB, json=body)

    def load(path: str, seq: int) -> httpx.Response:
        body = {"session_id": session, "model_seq_id": seq, "path": path, "optimizer": False}
        return call(server, "POST", "load_weights", BOB, json=body)

    hidden = sampler_of(sampler_path, 0)
    assert hidden.status_code == 404 and error_param(hidden) == "model_path"
    assert load(state_path, 0).status_code == 404
    for name in ("sampler_weights/to-share", "weights/state-to-share"):
        route = f"training_runs/{model_id}/checkpoints/{name}/publish"
        assert call(server, "POST", route).status_code == 204
    shared = sampler_of(sampler_path, 1)
    assert shared.status_code == 200, shared.text
    loaded = result(server, load(state_path, 1), BOB)
    assert loaded["model_id"] == f"{session}:train:1"
    # Bob's run is his: Alice does not see it, and its checkpoint stays Alice's.
    assert (
        call(server, "POST", "get_info", ALICE, json={"model_id": loaded["model_id"]}).status_code
        == 404
    )
    info = call(server, "POST", "get_info", BOB, json={"model_id": loaded["model_id"]})
    assert info.status_code == 200 and info.json()["lora_rank"] == 2
