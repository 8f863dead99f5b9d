"""The real tinker 0.38 SDK against a real `posttrain serve`, on the Tinker wire surface
(/api/v1). Each scenario runs in the tinker 0.38 interpreter (tests/tinker_env.py: the
Together SDK's shim pins tinker 0.23.1, so the two cannot share this process) and reports what
it saw; the assertions are here.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess

CLIENT = Path(__file__).parent / "tinker_native" / "client.py"


@pytest.fixture(scope="module")
def tinker_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess.started(tmp_path_factory.mktemp("tinker-native"))
    yield proc
    proc.stop()


def run(tinker_python: str, scenario: str, server: ServerProcess, *args: str) -> dict:
    done = subprocess.run(
        [tinker_python, str(CLIENT), scenario, server.base_url, *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={"TINKER_TELEMETRY": "0", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, (
        f"{scenario} failed:\n{done.stderr[-4000:]}\n{server.log()[-3000:]}"
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_handshake_creates_a_training_run_and_closes(tinker_python, tinker_server):
    seen = run(tinker_python, "handshake", tinker_server)
    assert "posttrain/tiny-qwen3" in seen["models"]
    assert seen["model_id"].endswith(":train:0")
    assert seen["info_base"] == "posttrain/tiny-qwen3"
    assert seen["lora_rank"] == 4
    assert seen["session_runs"] == [seen["model_id"]] and seen["listed"]


def test_supervised_steps_lower_the_loss_and_sampler_logprobs_match_training(
    tinker_python, tinker_server
):
    seen = run(tinker_python, "sl_steps", tinker_server)
    losses = seen["losses"]
    assert losses[-1] < losses[0]
    assert all(":" in key for key in seen["metrics"])  # the SDK splits every key on ':'
    for forward, scored in zip(seen["forward"], seen["scored"], strict=True):
        assert scored[0] is None  # nothing predicts the first prompt token
        # forward[i] scores token i+1 given tokens[:i+1]: the sampler's prompt logprobs
        assert scored[1:] == pytest.approx(forward, abs=2e-5)


def test_elementwise_loss_is_each_tokens_share_of_loss_sum(tinker_python, tinker_server):
    seen = run(tinker_python, "elementwise", tinker_server)
    for loss_fn in ("cross_entropy", "importance_sampling"):
        out = seen[loss_fn]
        assert out["keys"] == [["elementwise_loss", "logprobs"]] * 3
        total = sum(sum(row) for row in out["elementwise"])
        assert total == pytest.approx(out["loss_sum"], rel=1e-5)
    ce = seen["cross_entropy"]
    for weights, logprobs, losses in zip(
        seen["weights"], ce["logprobs"], ce["elementwise"], strict=True
    ):
        assert losses == pytest.approx([-w * x for w, x in zip(weights, logprobs, strict=True)])
    policy = seen["importance_sampling"]
    for logprobs, losses in zip(policy["logprobs"], policy["elementwise"], strict=True):
        # -exp(x - q) * A with q = -1.0 and A = 0.5 at every token
        assert losses == pytest.approx([-math.exp(x + 1.0) * 0.5 for x in logprobs], rel=1e-5)


def test_resume_with_optimizer_reproduces_the_next_loss_bit_for_bit(tinker_python, tinker_server):
    seen = run(tinker_python, "resume", tinker_server)
    assert seen["path"] == f"tinker://{seen['model_ids'][0]}/weights/after-two"
    assert seen["model_ids"][1].endswith(":train:1")
    assert seen["resumed"] == seen["original"]


def test_load_state_into_a_run_reproduces_the_saved_runs_next_losses_bit_for_bit(
    tinker_python, tinker_server
):
    seen = run(tinker_python, "load_state", tinker_server)
    original = seen["original"]
    # With the optimizer: the next step and the one after it, exactly as the saved run had them,
    # into the run that saved the state (after more steps) and into a fresh run.
    assert seen["same_with_optimizer"] == original
    assert seen["fresh_with_optimizer"] == original
    # Without: the same weights (the first loss), a fresh optimizer (the second loss is that of
    # a client created from the state without its optimizer, not the saved run's).
    without = seen["same_without_optimizer"]
    assert without[0] == original[0] == seen["from_state"][0]
    assert without[1] == seen["from_state"][1] != original[1]


def test_a_snapshot_sampler_keeps_its_weights_while_training_goes_on(tinker_python, tinker_server):
    seen = run(tinker_python, "snapshot", tinker_server)
    assert seen["after"] == seen["before"]
    assert seen["fresh"][1:] != pytest.approx(seen["before"][1:], abs=1e-4)
    assert all(len(tokens) == 5 for tokens in seen["sampled"])  # stop=[]: no stop, not even EOS
    assert seen["stop_reasons"] == ["length"] * 3


def test_one_call_of_1100_datums_equals_the_same_data_in_four_calls(tinker_python, tinker_server):
    seen = run(tinker_python, "chunked", tinker_server)
    assert math.isclose(seen["one"]["loss"], seen["four"]["loss"], rel_tol=1e-5)
    for one, four in zip(seen["one"]["after"], seen["four"]["after"], strict=True):
        assert one == pytest.approx(four, abs=1e-5)


def test_refusals_raise_with_the_reason(tinker_python, tinker_server):
    seen = run(tinker_python, "refusals", tinker_server)
    assert "stable_reinforce" in seen["stable_reinforce"]
    assert "importance_sampling" in seen["stable_reinforce"]
    assert "no/such" in seen["unknown_model"]
    assert "data[1].model_input" in seen["out_of_vocabulary"]  # the caller's field names


def _post(server: ServerProcess, path: str, body: dict, key: str = "retry-1") -> httpx.Response:
    headers = {"X-API-Key": "tml-posttrain-test", "X-Idempotency-Key": key}
    return httpx.post(f"{server.base_url}/api/v1/{path}", json=body, headers=headers, timeout=60)


def _result(server: ServerProcess, request_id: str) -> dict:
    return _post(server, "retrieve_future", {"request_id": request_id}).json()


def test_a_retried_post_with_the_same_seq_id_runs_once(tinker_server):
    client = _post(tinker_server, "create_session", {"tags": [], "sdk_version": "0.38.0"}).json()
    created = _post(
        tinker_server,
        "create_model",
        {
            "session_id": client["session_id"],
            "model_seq_id": 0,
            "base_model": "posttrain/tiny-qwen3",
            "lora_config": {"rank": 2, "seed": 0},
        },
    ).json()
    model_id = _result(tinker_server, created["request_id"])["model_id"]
    step = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    first = _post(tinker_server, "optim_step", step, key="retry-a").json()
    second = _post(tinker_server, "optim_step", step, key="retry-b").json()
    assert second["request_id"] == first["request_id"]
    assert "metrics" in _result(tinker_server, first["request_id"])
    sessions = httpx.get(
        f"{tinker_server.base_url}/v1/rl/training-sessions",
        headers={"Authorization": "Bearer tml-posttrain-test"},
        timeout=30,
    ).json()["data"]
    (run,) = [s for s in sessions if s.get("display_name") == model_id]
    assert run["step"] == 1  # one optimizer step, not two
    # After finish, the heartbeat answers 410 and the SDK stops beating.
    assert _post(tinker_server, f"sessions/{client['session_id']}/finish", {}).status_code == 200
    beat = _post(tinker_server, "session_heartbeat", {"session_id": client["session_id"]})
    assert beat.status_code == 410


def test_samplers_past_the_slots_give_the_least_recently_used_slot_up(tinker_python, tmp_path):
    server = ServerProcess.started(tmp_path, "--max-sessions-per-resource", "3")
    try:
        seen = run(tinker_python, "eviction", server)
        resources = httpx.get(
            f"{server.base_url}/v1/rl/model-resources",
            headers={"Authorization": "Bearer tml-posttrain-test"},
            timeout=30,
        ).json()["data"]
    finally:
        server.stop()
    assert seen["again"] == seen["first"]  # rebuilt from their checkpoints: the same weights
    assert len({json.dumps(x) for x in seen["first"]}) == 4  # four different moments
    assert len(resources) == 1  # one copy of the base weights, never a second resource


def test_a_path_saved_before_a_restart_serves_the_same_weights_after_it(tinker_python, tmp_path):
    server = ServerProcess.started(tmp_path)
    try:
        before = run(tinker_python, "saved_sampler", server)
        server.stop()
        server.start(keep_port=True)
        after = run(tinker_python, "after_restart", server, before["path"])
    finally:
        server.stop()
    assert before["path"].endswith("/sampler_weights/for-later")
    assert after["scored"] == before["scored"]


def _sessions_of(server: ServerProcess, client: str) -> dict[str, str]:
    """display name -> status of the posttrain sessions of a Tinker client's runs and samplers."""
    sessions = httpx.get(
        f"{server.base_url}/v1/rl/training-sessions",
        headers={"Authorization": "Bearer tml-posttrain-test"},
        timeout=30,
    ).json()["data"]
    return {
        s["display_name"]: s["status"]
        for s in sessions
        if (s.get("display_name") or "").startswith(f"{client}:")
    }


def test_a_closed_clients_sessions_stop_and_its_saved_paths_serve_a_new_client(
    tinker_python, tinker_server
):
    closed = run(tinker_python, "closed_client", tinker_server)
    sessions = _sessions_of(tinker_server, closed["client"])
    # The run, its path sampler, its snapshot sampler and a base-model sampler: all stopped.
    assert len(sessions) == 4, sessions
    assert set(sessions.values()) == {"TRAINING_SESSION_STATUS_STOPPED"}, sessions
    after = run(
        tinker_python, "after_close", tinker_server, closed["state"], closed["sampler_path"]
    )
    assert after["scored"] == closed["scored"]
    assert len(after["sampled"]) == 3
    assert after["loss"] == closed["loss"]  # the state, loaded: the run's next loss exactly
    reopened = _sessions_of(tinker_server, after["client"])
    assert len(reopened) == 2, reopened  # the run made from the state, the path's sampler
    assert set(reopened.values()) == {"TRAINING_SESSION_STATUS_STOPPED"}, reopened


def test_an_inflight_sampler_follows_the_run_and_top_k_prompt_logprobs_agree(
    tinker_python, tinker_server
):
    seen = run(tinker_python, "inflight", tinker_server)
    assert seen["after"] != seen["before"]
    assert seen["after"] == seen["now"]  # the weights a fresh snapshot of that moment holds
    topk, logprobs = seen["topk"], seen["prompt_logprobs"]
    assert topk[0] is None and logprobs[0] is None  # nothing predicts the first token
    for row, value in zip(topk[1:], logprobs[1:], strict=True):
        assert len(row) == 3 and row[0][1] >= row[1][1] >= row[2][1]
        assert value <= row[0][1] + 1e-6  # the prompt's token is at best the most likely one


def test_tinker_runs_never_land_on_a_resource_made_on_the_together_surface(tinker_server):
    together = {"Authorization": "Bearer tml-posttrain-test"}
    made = httpx.post(
        f"{tinker_server.base_url}/v1/rl/model-resources",
        json={"base_model": "posttrain/tiny-qwen3", "inactive_timeout": 600},
        headers={**together, "Idempotency-Key": "together-resource"},
        timeout=60,
    ).json()
    client = _post(tinker_server, "create_session", {"tags": [], "sdk_version": "0.38.0"}).json()
    body = {
        "session_id": client["session_id"],
        "model_seq_id": 0,
        "base_model": "posttrain/tiny-qwen3",
        "lora_config": {"rank": 2, "seed": 0},
    }
    created = _post(tinker_server, "create_model", body).json()
    model_id = _result(tinker_server, created["request_id"])["model_id"]
    sessions = httpx.get(
        f"{tinker_server.base_url}/v1/rl/training-sessions", headers=together, timeout=30
    ).json()["data"]
    (run,) = [s for s in sessions if s.get("display_name") == model_id]
    assert run["model_resources_id"] != made["id"]
    stopped = httpx.post(
        f"{tinker_server.base_url}/v1/rl/model-resources/{made['id']}/stop",
        headers=together,
        timeout=60,
    )
    assert stopped.status_code == 200, stopped.text  # no Tinker session holds it
