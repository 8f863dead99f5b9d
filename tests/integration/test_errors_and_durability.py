"""Bad input gets a clear error and changes nothing; records survive a restart; large bodies go
through the payload offload path."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
from helpers import API_KEY, low_level, open_session, sft_sample
from together import BadRequestError, NotFoundError

OFFLOAD_THRESHOLD_BYTES = 512 * 1024  # together.post_training._payloads threshold (0.5 MiB)

HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}


def probe_loss(session) -> float:
    """Forward-only loss on a fixed sample: changes iff the session's weights changed."""
    result = session.trainer.forward(samples=[sft_sample([5, 6, 7, 8, 9], 2)], loss=CE)
    return result.loss


def test_unknown_and_malformed_ids_answer_404(shared_server):
    resources, session = open_session(shared_server.base_url)
    client = low_level(shared_server.base_url).post_training
    with pytest.raises(NotFoundError):
        client.model_resources.retrieve("mr-doesnotexist")
    with pytest.raises(NotFoundError):
        client.sessions.retrieve("not a valid id")
    with pytest.raises(NotFoundError):
        client.operations.retrieve_optim_step("op-nope", session_id=session.session_id)
    op = client.operations.optim_step(session.session_id, idempotency_key=str(uuid.uuid4()))
    with pytest.raises(NotFoundError):  # right id, wrong kind
        client.operations.retrieve_sample(op.id, session_id=session.session_id)
    with pytest.raises(NotFoundError):
        client.operations.optim_step("ts-unknown", idempotency_key=str(uuid.uuid4()))
    session.stop()
    resources.stop()


def post_fb(server, session_id: str, body: dict, key: str | None = "k") -> httpx.Response:
    headers = dict(HEADERS)
    if key is not None:
        headers["Idempotency-Key"] = f"{key}-{uuid.uuid4()}"
    return httpx.post(
        f"{server.base_url}/v1/rl/training-sessions/{session_id}/operations/forward-backward",
        content=body if isinstance(body, str | bytes) else json.dumps(body),
        headers=headers,
    )


GOOD = sft_sample([5, 6, 7, 8, 9], 2)
DONE = ("TRAINING_OPERATION_STATUS_COMPLETED", "TRAINING_OPERATION_STATUS_FAILED")


def with_inputs(**changes) -> dict:
    sample = json.loads(json.dumps(GOOD))
    for key, value in changes.items():
        if value is None:
            sample["loss_fn_inputs"].pop(key)
        else:
            sample["loss_fn_inputs"][key] = value
    return sample


BAD_BODIES = {
    "mismatched length": (
        {"loss": CE, "samples": [with_inputs(weights={"data": [1, 1], "dtype": "float32"})]},
        "samples[0].loss_fn_inputs.weights",
    ),
    "token outside vocabulary": (
        {
            "loss": CE,
            "samples": [with_inputs(target_tokens={"data": [6, 7, 8, 100000], "dtype": "int64"})],
        },
        "samples[0].loss_fn_inputs.target_tokens",
    ),
    "unknown loss_fn_inputs key": (
        {
            "loss": CE,
            "samples": [with_inputs(advantage={"data": [0, 0, 0, 0], "dtype": "float32"})],
        },
        "samples[0].loss_fn_inputs.advantage",
    ),
    "unknown loss type": (
        {"loss": {"type": "LOSS_TYPE_MAGIC"}, "samples": [GOOD]},
        "loss.type",
    ),
    "missing samples": ({"loss": CE}, "samples"),
    "float target tokens": (
        {
            "loss": CE,
            "samples": [with_inputs(target_tokens={"data": [6, 7, 8.5, 9], "dtype": "float32"})],
        },
        "samples[0].loss_fn_inputs.target_tokens.dtype",
    ),
    "negative model input token": (
        {
            "loss": CE,
            "samples": [
                {**GOOD, "model_input": {"chunks": [{"encoded_text": {"tokens": [5, -6, 7, 8]}}]}}
            ],
        },
        "samples[0].model_input",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_bad_forward_backward_body_is_400_naming_the_field_and_changes_nothing(shared_server, case):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 5})
    session.trainer.forward_backward(samples=[GOOD], loss=CE)  # accumulated gradient exists
    before_loss = probe_loss(session)
    body, param = BAD_BODIES[case]
    response = post_fb(shared_server, session.session_id, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    # Nothing changed: an optim step now applies exactly the gradient accumulated before.
    assert probe_loss(session) == before_loss
    assert session.retrieve().step == 0
    session.stop()
    resources.stop()


def test_non_finite_numbers_and_missing_idempotency_key_are_400(shared_server):
    resources, session = open_session(shared_server.base_url)
    nan_body = json.dumps({"loss": CE, "samples": [GOOD]}).replace('"data": [0.0', '"data": [NaN')
    assert "NaN" in nan_body
    assert post_fb(shared_server, session.session_id, nan_body).status_code == 400
    response = post_fb(shared_server, session.session_id, {"loss": CE, "samples": [GOOD]}, key=None)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "Idempotency-Key"
    assert post_fb(shared_server, session.session_id, b"{not json").status_code == 400
    session.stop()
    resources.stop()


def test_bad_sampling_and_resource_requests_are_400(shared_server):
    resources, session = open_session(shared_server.base_url)
    client = low_level(shared_server.base_url).post_training
    prompt = [{"chunks": [{"encoded_text": {"tokens": [5, 6]}}]}]
    for params, field in (
        ({"top_p": 0.0}, "sampling_params.top_p"),
        ({"temperature": -1}, "sampling_params.temperature"),
        ({"max_tokens": 100000}, "sampling_params.max_tokens"),
    ):
        with pytest.raises(BadRequestError) as info:
            client.operations.sample(
                session.session_id,
                idempotency_key=str(uuid.uuid4()),
                model_inputs=prompt,
                sampling_params=params,
            )
        assert info.value.body["error"]["param"] == field
    with pytest.raises(BadRequestError) as info:
        client.model_resources.create(base_model="no/such-model")
    assert info.value.body["error"]["param"] == "base_model"
    with pytest.raises(BadRequestError):
        client.model_resources.create(base_model="posttrain/tiny-qwen3", inactive_timeout=5)
    with pytest.raises(BadRequestError):  # active session, no force
        client.model_resources.stop(resources.model_resources_id)
    session.stop()
    resources.stop()


def test_records_survive_a_restart_and_unfinished_operations_run_again(server):
    """Completed operations and live LoRA sessions survive `kill -9`; operations still queued
    or running then run again after the restart, in their order."""
    resources, session = open_session(server.base_url, lora_config={"rank": 4})
    client = low_level(server.base_url).post_training
    sid, rid = session.session_id, resources.model_resources_id
    done = client.operations.forward_backward(
        sid, idempotency_key=str(uuid.uuid4()), loss=CE, samples=[GOOD]
    )
    # A long generation keeps the worker busy; the op queued behind it is PENDING when the
    # server dies.
    long_sample = client.operations.sample(
        sid,
        idempotency_key=str(uuid.uuid4()),
        model_inputs=[{"chunks": [{"encoded_text": {"tokens": [5, 6]}}]}],
        num_samples=64,
        sampling_params={"max_tokens": 200, "stop": []},
    )
    queued = client.operations.optim_step(sid, idempotency_key=str(uuid.uuid4()))
    deadline = time.monotonic() + 600  # a safety net, not a speed check
    while client.operations.retrieve_forward_backward(done.id, session_id=sid).status != (
        "TRAINING_OPERATION_STATUS_COMPLETED"
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    server.stop(kill=True)
    server.start()
    client = low_level(server.base_url).post_training
    assert client.model_resources.retrieve(rid).status == "MODEL_RESOURCES_STATUS_READY"
    restored = client.sessions.retrieve(sid)
    # A LoRA session is durable: it is back, with the completed forward-backward's gradients
    # (tests/integration/test_durable_sessions.py checks its state bit for bit).
    assert restored.status == "TRAINING_SESSION_STATUS_RUNNING"
    completed = client.operations.retrieve_forward_backward(done.id, session_id=sid)
    assert completed.status == "TRAINING_OPERATION_STATUS_COMPLETED"
    assert completed.output.loss > 0
    # The operations that had not finished run again, in their order, on the session that
    # came back: the sample, then the optim-step, which applies the kept gradients.
    finished = {}
    for op_id, retrieve in (
        (long_sample.id, client.operations.retrieve_sample),
        (queued.id, client.operations.retrieve_optim_step),
    ):
        deadline = time.monotonic() + 600  # a safety net, not a speed check
        while (op := retrieve(op_id, session_id=sid)).status not in DONE:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert op.status == "TRAINING_OPERATION_STATUS_COMPLETED", op.error
        finished[op_id] = op
    assert len(finished[long_sample.id].output.results[0].sequences) == 64
    assert finished[queued.id].output.step == 1
    # The resource still serves new sessions after the restart.
    _, fresh = open_session(server.base_url)
    assert fresh.trainer.forward(samples=[GOOD], loss=CE).loss > 0


def test_a_batch_over_half_a_mebibyte_goes_through_the_payload_offload(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 9})
    samples = []
    for i in range(64):
        sample = sft_sample([(5 + i + j) % 90 + 3 for j in range(400)], 10)
        weights = sample["loss_fn_inputs"]["weights"]["data"]
        # Fractional weights make the JSON body large (and CE honours them).
        sample["loss_fn_inputs"]["weights"]["data"] = [w / 3 for w in weights]
        samples.append(sample)
    size = len(json.dumps({"loss": CE, "samples": samples}, separators=(",", ":")))
    assert size > OFFLOAD_THRESHOLD_BYTES
    whole = session.trainer.forward(samples=samples, loss=CE)
    parts = [session.trainer.forward(samples=samples[i : i + 8], loss=CE) for i in range(0, 64, 8)]
    # The server trained on the uploaded payload, not the 8-token inline stand-in.
    assert whole.loss == pytest.approx(sum(p.loss for p in parts), rel=1e-5)
    assert len(whole.loss_fn_outputs) == 64
    assert len(whole.loss_fn_outputs[0].tensors["logprobs"].data) == 399
    payload_files = list((shared_server.data_dir / "payloads").glob("*.json"))
    assert payload_files
    session.stop()
    resources.stop()
