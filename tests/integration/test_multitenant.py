"""Many tenants on one server, through the official SDK: API keys and users, isolation between
users (404 for every verb, list filtering, signed URLs bound to one object), isolation between
sessions of one resource (concurrent training equals training alone; one session's optim-step
never moves another's weights), capacity, full-weight resources, and bad input.

The server takes a keys file with two users plus `--api-key` for the single local user.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from conftest import ServerProcess
from helpers import BASE_MODEL, sft_sample
from together import AuthenticationError, BadRequestError, NotFoundError, Together
from together.post_training import ModelResourcesClient, SessionClient

ALICE, BOB, LOCAL = "key-alice", "key-bob", "key-local"
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
PROBE = [sft_sample([5, 6, 7, 8, 9, 10, 11, 12], 1)]  # every position weighted
CAPACITY = 8  # EngineConfig.max_sessions_per_resource default


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("multitenant")
    keys = directory / "keys"
    keys.write_text(f"# test users\n{ALICE} user_alice\n{BOB} user_bob\n")
    flags = ("--keys-file", str(keys), "--api-key", LOCAL)
    proc = ServerProcess.started(directory, *flags)
    yield proc
    proc.stop()


def api(server: ServerProcess, key: str):
    return Together(base_url=server.base_url, api_key=key, max_retries=0).post_training


def open_resources(server: ServerProcess, key: str, **options: object) -> ModelResourcesClient:
    return ModelResourcesClient.create(
        base_url=server.base_url, api_key=key, base_model=BASE_MODEL, interval=0.2, **options
    )


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


def probe_logprobs(session: SessionClient) -> list[float]:
    """Forward-only logprobs of a fixed sequence: equal iff the trainer's weights are equal."""
    result = session.trainer.forward(samples=PROBE, loss=CE)
    return list(result.loss_fn_outputs[0].tensors["logprobs"].data)


def absolute(server: ServerProcess, url: str) -> str:
    """Signed URLs may be relative; the SDK joins them to its base URL (api.md 0.1)."""
    return f"{server.base_url}{url}" if url.startswith("/") else url


def new_key() -> str:
    return str(uuid.uuid4())


# ---------------------------------------------------------------- keys and users


def test_requests_without_a_valid_key_answer_401(server):
    url = f"{server.base_url}/v1/rl/model-resources"
    for sent in ({}, {"Authorization": "Bearer"}, {"Authorization": f"Basic {ALICE}"}):
        response = httpx.get(url, headers=sent)
        assert response.status_code == 401, sent
        assert response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(AuthenticationError) as info:
        api(server, "key-unknown").model_resources.list()
    assert info.value.body["error"]["param"] == "Authorization"
    with pytest.raises(AuthenticationError):
        api(server, "key-unknown").supported_models.get()


def test_each_key_acts_as_its_user(server):
    created_by = {}
    for key in (ALICE, BOB, LOCAL):
        resources = open_resources(server, key)
        created_by[key] = resources.retrieve().created_by
        session = resources.create_session(interval=0.2)
        assert session.retrieve().created_by == created_by[key]
        session.stop()
        resources.stop()
    assert created_by == {ALICE: "user_alice", BOB: "user_bob", LOCAL: "user_local"}


# ---------------------------------------------------------------- isolation between users


def upload_url(server: ServerProcess, key: str, session_id: str) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/rl/training-sessions/{session_id}/payloads/upload-url",
        headers=headers(key),
    )


def download_url(server: ServerProcess, key: str, session_id: str, payload_id: str):
    return httpx.post(
        f"{server.base_url}/v1/rl/training-sessions/{session_id}/payloads/{payload_id}"
        "/download-url",
        headers=headers(key),
    )


def assert_every_verb_answers_404(server: ServerProcess, objects: dict[str, str]) -> None:
    """Bob tries every route on Alice's objects."""
    bob = api(server, BOB)
    rid, sid, op_id = objects["resource"], objects["session"], objects["operation"]
    calls = {
        "resource retrieve": lambda: bob.model_resources.retrieve(rid),
        "resource extend-expiry": lambda: bob.model_resources.extend_expiry(rid, seconds=60),
        "resource stop": lambda: bob.model_resources.stop(rid),
        "resource stop force": lambda: bob.model_resources.stop(rid, force=True),
        "session create": lambda: bob.sessions.create(model_resources_id=rid),
        "session retrieve": lambda: bob.sessions.retrieve(sid),
        "session update": lambda: bob.sessions.update(sid, display_name="mine"),
        "session stop": lambda: bob.sessions.stop(sid),
        "forward-backward": lambda: bob.operations.forward_backward(
            sid, idempotency_key=new_key(), loss=CE, samples=PROBE
        ),
        "custom-forward-backward": lambda: bob.operations.custom_forward_backward(
            sid, idempotency_key=new_key(), samples=PROBE, gradients=[{"data": [0.0] * 7}]
        ),
        "optim-step": lambda: bob.operations.optim_step(sid, idempotency_key=new_key()),
        "weights-sync": lambda: bob.operations.weights_sync(
            sid, idempotency_key=new_key(), weight_sync_type="WEIGHT_SYNC_TYPE_SYNCHRONOUS"
        ),
        "sample": lambda: bob.operations.sample(
            sid,
            idempotency_key=new_key(),
            model_inputs=[{"chunks": [{"encoded_text": {"tokens": [5, 6]}}]}],
        ),
        "training-checkpoint": lambda: bob.operations.create_training_checkpoint(
            sid, idempotency_key=new_key()
        ),
        "inference-checkpoint": lambda: bob.operations.create_inference_checkpoint(
            sid, idempotency_key=new_key()
        ),
        "operation retrieve": lambda: bob.operations.retrieve_forward_backward(
            op_id, session_id=sid
        ),
        "operation under own session": lambda: bob.operations.retrieve_forward_backward(
            op_id, session_id=objects["bob_session"]
        ),
        "checkpoint retrieve": lambda: bob.checkpoints.retrieve(objects["checkpoint"]),
        "checkpoint download": lambda: bob.checkpoints.download(
            objects["checkpoint"], variant="CHECKPOINT_VARIANT_ADAPTER"
        ),
        "resume from checkpoint": lambda: bob.sessions.create(
            model_resources_id=objects["bob_resource"],
            resume_from_checkpoint_id=objects["checkpoint"],
        ),
    }
    for name, call in calls.items():
        with pytest.raises(NotFoundError):
            call()
            pytest.fail(f"{name} did not answer 404")
    assert upload_url(server, BOB, sid).status_code == 404
    assert download_url(server, BOB, sid, objects["payload"]).status_code == 404
    # Bob's own session does not unlock Alice's payload either.
    assert download_url(server, BOB, objects["bob_session"], objects["payload"]).status_code == 404


def test_users_cannot_see_or_touch_each_others_objects(server):
    alice_resources = open_resources(server, ALICE)
    alice_session = alice_resources.create_session(interval=0.2, display_name="alice run")
    trained = alice_session.trainer.forward_backward(samples=PROBE, loss=CE)
    alice_session.trainer.optim_step(adam_params={"learning_rate": 1e-2})
    checkpoint = alice_session.create_inference_checkpoint()
    alice = api(server, ALICE)
    operation = alice.operations.forward_backward(
        alice_session.session_id, idempotency_key=new_key(), loss=CE, samples=PROBE
    )
    payload = upload_url(server, ALICE, alice_session.session_id).json()
    put = httpx.put(absolute(server, payload["upload_url"]), content=b'{"samples": []}')
    assert put.status_code == 200
    bob_resources = open_resources(server, BOB)
    bob_session = bob_resources.create_session(interval=0.2)
    before = alice.sessions.retrieve(alice_session.session_id)

    assert_every_verb_answers_404(
        server,
        {
            "resource": alice_resources.model_resources_id,
            "session": alice_session.session_id,
            "operation": operation.id,
            "checkpoint": checkpoint.id,
            "payload": payload["payload_id"],
            "bob_resource": bob_resources.model_resources_id,
            "bob_session": bob_session.session_id,
        },
    )

    # Alice's objects are unchanged and still hers to use.
    after = alice.sessions.retrieve(alice_session.session_id)
    assert after.status == "TRAINING_SESSION_STATUS_RUNNING"
    assert (
        (after.display_name, after.step)
        == (before.display_name, before.step)
        == (
            "alice run",
            1,
        )
    )
    assert alice_resources.retrieve().status == "MODEL_RESOURCES_STATUS_READY"
    assert alice.checkpoints.retrieve(checkpoint.id).session_id == alice_session.session_id
    assert download_url(server, ALICE, alice_session.session_id, payload["payload_id"]).is_success
    assert trained.loss > 0

    # Lists show only the caller's objects; created_by is "me" or one's own id.
    bob = api(server, BOB)
    rid, sid = alice_resources.model_resources_id, alice_session.session_id
    for client, visible in ((alice, True), (bob, False)):
        resource_ids = {r.id for r in client.model_resources.list(limit=100).data}
        session_ids = {s.id for s in client.sessions.list(limit=100).data}
        checkpoint_ids = {c.id for c in client.checkpoints.list(limit=100).data}
        assert (rid in resource_ids, sid in session_ids) == (visible, visible)
        assert (checkpoint.id in checkpoint_ids) == visible
    for created_by, expected in (("me", True), ("user_alice", True), ("user_bob", False)):
        resource_ids = {r.id for r in alice.model_resources.list(created_by=created_by).data}
        session_ids = {s.id for s in alice.sessions.list(created_by=created_by).data}
        assert (rid in resource_ids, sid in session_ids) == (expected, expected), created_by
    assert bob.model_resources.list(created_by="user_alice").data == []
    assert bob.sessions.list(created_by="user_alice").data == []
    assert bob.sessions.list(model_resources_id=rid).data == []

    for session in (alice_session, bob_session):
        session.stop()
    alice_resources.stop()
    bob_resources.stop()


def test_a_signed_url_opens_only_its_own_object(server):
    resources = open_resources(server, ALICE)
    session = resources.create_session(interval=0.2)
    first = upload_url(server, ALICE, session.session_id).json()
    second = upload_url(server, ALICE, session.session_id).json()
    first_url = urlsplit(absolute(server, first["upload_url"]))
    query = parse_qs(first_url.query)
    reused = f"{server.base_url}/v1/rl/payloads/{second['payload_id']}?{first_url.query}"
    assert httpx.put(reused, content=b"{}").status_code == 404
    tampered = f"{server.base_url}{first_url.path}?expires={query['expires'][0]}&sig={'0' * 64}"
    assert httpx.put(tampered, content=b"{}").status_code == 404
    assert httpx.put(first_url.geturl(), content=b"{}").status_code == 200
    # A PUT URL does not read the payload back either: the method is signed too.
    assert httpx.get(first_url.geturl()).status_code == 404

    checkpoints = [session.create_inference_checkpoint().id for _ in range(2)]
    alice = api(server, ALICE)
    files = alice.checkpoints.download(checkpoints[0], variant="CHECKPOINT_VARIANT_ADAPTER").data
    url = absolute(server, files[0].url)
    assert httpx.get(url).is_success
    swapped = url.replace(checkpoints[0], checkpoints[1])
    assert swapped != url
    assert httpx.get(swapped).status_code == 404
    session.stop()
    resources.stop()


# ---------------------------------------------------------------- isolation between sessions

TASKS = (
    {"lora_config": {"rank": 2, "seed": 11}, "tokens": [5, 6, 7, 8, 9, 10, 11, 12]},
    {"lora_config": {"rank": 4, "seed": 12}, "tokens": [20, 19, 18, 17, 16, 15]},
    {"lora_config": {"rank": 8, "seed": 13}, "tokens": [30, 31, 30, 31, 30, 31, 30]},
    {"lora_config": {"rank": 4, "seed": 14, "alpha": 4}, "tokens": [40, 42, 44, 46, 48, 50]},
)
STEPS = 4


def train(session: SessionClient, tokens: list[int]) -> tuple[list[float], list[float]]:
    """STEPS steps of SFT on one sequence; the losses and the final probe logprobs."""
    losses = []
    for _ in range(STEPS):
        result = session.trainer.forward_backward(samples=[sft_sample(tokens, 2)], loss=CE)
        losses.append(result.loss)
        # A large eps: Adam's step 1 is lr * sign(g), so a gradient entry that is pure float32
        # rounding noise (a sum that cancels to ~1e-7) would move by a full learning rate in
        # a random direction; eps=1e-3 scales such entries down to nothing, so the trajectories
        # of a shared pass and a lone pass stay equal to rounding instead of diverging.
        session.trainer.optim_step(
            adam_params={"learning_rate": 5e-2, "weight_decay": 0.1, "eps": 1e-3}
        )
    return losses, probe_logprobs(session)


def test_four_sessions_trained_concurrently_equal_each_trained_alone(server):
    resources = open_resources(server, ALICE)
    sessions = [
        resources.create_session(interval=0.2, lora_config=task["lora_config"]) for task in TASKS
    ]
    together: list[tuple[list[float], list[float]] | None] = [None] * len(TASKS)

    def run(index: int) -> None:
        together[index] = train(sessions[index], TASKS[index]["tokens"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(TASKS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for session in sessions:
        session.stop()
    resources.stop()

    for index, task in enumerate(TASKS):
        alone_resources = open_resources(server, ALICE)
        alone = alone_resources.create_session(interval=0.2, lora_config=task["lora_config"])
        expected = train(alone, task["tokens"])
        alone.stop()
        alone_resources.stop()
        # Sessions that share a pass compute their rows inside larger matrix products, whose
        # float32 summation order differs from running alone: equal to rounding, not bit-exact.
        losses_together, probe_together = together[index]
        assert losses_together[0] == pytest.approx(expected[0][0], rel=1e-5), index
        assert losses_together == pytest.approx(expected[0], rel=1e-4, abs=1e-4), index
        assert probe_together == pytest.approx(expected[1], rel=1e-4, abs=1e-4), index
        losses = expected[0]
        assert losses[-1] < losses[0], losses


def test_one_sessions_optim_step_never_changes_anothers_weights(server):
    resources = open_resources(server, ALICE)
    stepping = resources.create_session(interval=0.2, lora_config={"rank": 4, "seed": 1})
    bystander = resources.create_session(interval=0.2, lora_config={"rank": 4, "seed": 2})
    # The bystander holds an accumulated gradient of its own across the other's steps.
    bystander.trainer.forward_backward(samples=[sft_sample([9, 8, 7, 6, 5], 1)], loss=CE)
    bystander_before = probe_logprobs(bystander)
    stepping_before = probe_logprobs(stepping)
    for _ in range(3):
        stepping.trainer.forward_backward(samples=PROBE, loss=CE)
        stepping.trainer.optim_step(adam_params={"learning_rate": 0.1, "weight_decay": 0.5})
    assert probe_logprobs(stepping) != stepping_before
    assert probe_logprobs(bystander) == bystander_before
    # Its own step then applies exactly its own gradient: as on a resource of its own.
    bystander.trainer.optim_step(adam_params={"learning_rate": 0.1, "weight_decay": 0.5})
    stepped = probe_logprobs(bystander)
    for session in (stepping, bystander):
        session.stop()
    resources.stop()

    control_resources = open_resources(server, ALICE)
    control = control_resources.create_session(interval=0.2, lora_config={"rank": 4, "seed": 2})
    control.trainer.forward_backward(samples=[sft_sample([9, 8, 7, 6, 5], 1)], loss=CE)
    control.trainer.optim_step(adam_params={"learning_rate": 0.1, "weight_decay": 0.5})
    assert stepped == probe_logprobs(control) != bystander_before
    control.stop()
    control_resources.stop()


# ---------------------------------------------------------------- capacity


def sessions_of(server: ServerProcess, resource_id: str, status: str) -> list:
    listed = api(server, ALICE).sessions.list(model_resources_id=resource_id, limit=100).data
    return [s for s in listed if s.status == status]


def test_a_full_lora_resource_puts_a_new_session_in_error_until_a_slot_frees(server):
    resources = open_resources(server, ALICE)
    rid = resources.model_resources_id
    sessions = [
        resources.create_session(interval=0.2, lora_config={"rank": 1 + i % 3})
        for i in range(CAPACITY)
    ]
    with pytest.raises(RuntimeError, match="TRAINING_SESSION_STATUS_ERROR"):
        resources.create_session(interval=0.2)
    # The raw create answers 200; the session then reads ERROR (api.md 7.13).
    refused = api(server, ALICE).sessions.create(model_resources_id=rid)
    assert refused.status == "TRAINING_SESSION_STATUS_ERROR"
    assert refused.error.code == "TRAINING_SESSION_ERROR_CODE_RESOURCE_AT_CAPACITY"
    assert len(sessions_of(server, rid, "TRAINING_SESSION_STATUS_ERROR")) == 2
    assert len(sessions_of(server, rid, "TRAINING_SESSION_STATUS_RUNNING")) == CAPACITY
    sessions[0].stop()
    replacement = resources.create_session(interval=0.2)
    assert replacement.retrieve().status == "TRAINING_SESSION_STATUS_RUNNING"
    resources.stop(force=True)
    assert sessions_of(server, rid, "TRAINING_SESSION_STATUS_RUNNING") == []


# ---------------------------------------------------------------- full-weight resources

FULL_WEIGHT_TASK = [sft_sample([5, 17, 23, 9, 41, 7, 0], 2), sft_sample([12, 30, 8, 44, 0], 2)]
PROMPT = {"chunks": [{"encoded_text": {"tokens": [5, 17, 23]}}]}
GREEDY = {"max_tokens": 6, "temperature": 0.0, "stop": []}


def test_a_full_weight_resource_trains_all_weights_and_hosts_one_session(server):
    resources = open_resources(server, ALICE, lora_enabled=False)
    rid = resources.model_resources_id
    assert resources.retrieve().lora_enabled is False
    alice = api(server, ALICE)
    with pytest.raises(BadRequestError) as info:
        alice.sessions.create(model_resources_id=rid, lora_config={"rank": 4})
    assert info.value.body["error"]["param"] == "lora_config"
    assert alice.sessions.list(model_resources_id=rid).data == []

    session = resources.create_session(interval=0.2)
    assert session.retrieve().lora_config is None
    base_sample = session.generator.sample(PROMPT, sampling_params=GREEDY)
    losses = []
    for _ in range(10):
        losses.append(session.trainer.forward_backward(samples=FULL_WEIGHT_TASK, loss=CE).loss)
        session.trainer.optim_step(adam_params={"learning_rate": 1e-2, "weight_decay": 0.0})
    assert losses[-1] < 0.5 * losses[0], losses
    # The generator keeps serving version 0 until weights-sync.
    stale = session.generator.sample(PROMPT, sampling_params=GREEDY)
    assert stale.sequences[0].tokens == base_sample.sequences[0].tokens
    # Equal up to the sampler's float noise (a prefix-cache hit takes another path).
    assert stale.sequences[0].logprobs == pytest.approx(base_sample.sequences[0].logprobs, abs=1e-5)
    session.trainer.weights_sync()
    fresh = session.generator.sample(PROMPT, sampling_params=GREEDY)
    assert fresh.policy_segments[0].version == 10
    sequence = fresh.sequences[0]
    assert sequence.logprobs != pytest.approx(base_sample.sequences[0].logprobs, abs=1e-3)
    scored = session.trainer.forward(
        samples=[sft_sample([5, 17, 23, *sequence.tokens], 3)], loss=CE
    )
    forward = scored.loss_fn_outputs[0].tensors["logprobs"].data[2:]
    assert max(abs(a - b) for a, b in zip(forward, sequence.logprobs, strict=True)) <= 1e-4

    with pytest.raises(RuntimeError, match="TRAINING_SESSION_STATUS_ERROR"):
        resources.create_session(interval=0.2)
    (refused,) = sessions_of(server, rid, "TRAINING_SESSION_STATUS_ERROR")
    assert refused.error.code == "TRAINING_SESSION_ERROR_CODE_RESOURCE_AT_CAPACITY"

    # Stopping frees the slot; the next session starts from the base weights again.
    session.stop()
    second = resources.create_session(interval=0.2)
    first_loss = second.trainer.forward(samples=FULL_WEIGHT_TASK, loss=CE).loss
    assert first_loss == pytest.approx(losses[0], rel=1e-6)
    second.stop()
    resources.stop()


# ---------------------------------------------------------------- bad input


def test_bad_input_answers_400_naming_the_field_and_changes_nothing(server):
    alice = api(server, ALICE)
    resources = open_resources(server, ALICE)
    rid = resources.model_resources_id
    resources_before = [r.id for r in alice.model_resources.list(limit=100).data]
    cases = [
        (
            lambda: alice.model_resources.create(base_model=BASE_MODEL, inactive_timeout=299),
            "inactive_timeout",
        ),
        (
            lambda: alice.model_resources.create(base_model=BASE_MODEL, inactive_timeout=86401),
            "inactive_timeout",
        ),
        (lambda: alice.model_resources.create(base_model="no/such-model"), "base_model"),
        (
            lambda: alice.model_resources.estimate_cost(base_model=BASE_MODEL, inactive_timeout=1),
            "inactive_timeout",
        ),
        (
            lambda: alice.sessions.create(model_resources_id=rid, lora_config={"rank": 65}),
            "lora_config.rank",
        ),
        (lambda: alice.model_resources.extend_expiry(rid, seconds=59), "seconds"),
    ]
    for call, field in cases:
        with pytest.raises(BadRequestError) as info:
            call()
        assert info.value.body["error"]["param"] == field
    assert [r.id for r in alice.model_resources.list(limit=100).data] == resources_before
    assert alice.sessions.list(model_resources_id=rid).data == []
    resources.stop()
