"""The served OpenAPI document, built without a server: every body a route parses is
described, every route that takes the key says so, every error is the envelope at a status the
route really answers (FastAPI's 422 validation error never answers here), and the configured
limits are the schema's maxima."""

from __future__ import annotations

from pathlib import Path

from posttrain.api.app import create_app
from posttrain.config import LimitsConfig
from posttrain.config_sources import build_config

BODIES = {
    ("post", "/v1/rl/model-resources"): "ResourceCreateIn",
    ("post", "/v1/rl/model-resources/estimate-cost"): "ResourceCreateIn",
    ("post", "/v1/rl/model-resources/{resource_id}/extend-expiry"): "ExtendExpiryIn",
    ("post", "/v1/rl/training-sessions"): "SessionCreateIn",
    ("patch", "/v1/rl/training-sessions/{session_id}"): "SessionUpdateIn",
    ("post", "/v1/rl/training-sessions/{session_id}/operations/forward-backward"): (
        "ForwardBackwardIn"
    ),
    ("post", "/v1/rl/training-sessions/{session_id}/operations/custom-forward-backward"): (
        "CustomForwardBackwardIn"
    ),
    ("post", "/v1/rl/training-sessions/{session_id}/operations/optim-step"): "OptimStepIn",
    ("post", "/v1/rl/training-sessions/{session_id}/operations/weights-sync"): "WeightsSyncIn",
    ("post", "/v1/rl/training-sessions/{session_id}/operations/sample"): "SampleIn",
    ("post", "/v1/rl/training-sessions/{session_id}:sample"): "SampleIn",
    ("put", "/v1/rl/payloads/{payload_id}"): "JsonObject",
}
SIGNED = {
    ("put", "/v1/rl/payloads/{payload_id}"),
    ("get", "/v1/rl/payloads/{payload_id}"),
    ("get", "/v1/rl/checkpoints/{checkpoint_id}/files/{part}/{filename}"),
}


def document(tmp_path: Path, limits: LimitsConfig | None = None) -> dict:
    config = build_config(data_dir=tmp_path, limits=limits)
    return create_app(config).openapi()


def operations(doc: dict):
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            yield method, path, operation


def test_every_parsed_body_is_described_by_its_wire_model(tmp_path):
    doc = document(tmp_path)
    found = {}
    for method, path, operation in operations(doc):
        if "requestBody" in operation:
            ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            found[(method, path)] = ref.rsplit("/", 1)[1]
    assert found == BODIES
    schemas = doc["components"]["schemas"]
    assert schemas["ResourceCreateIn"]["required"] == ["base_model"]
    assert schemas["ResourceCreateIn"]["additionalProperties"] is False  # unknown fields: 400


def test_every_route_taking_the_key_requires_bearer_auth_and_answers_401(tmp_path):
    doc = document(tmp_path)
    assert doc["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    for method, path, operation in operations(doc):
        takes_key = path.startswith(("/v1/", "/v3/")) and (method, path) not in SIGNED
        assert ("security" in operation) == takes_key, (method, path)
        assert ("401" in operation["responses"]) == takes_key, (method, path)


def test_errors_are_the_envelope_at_real_statuses(tmp_path):
    doc = document(tmp_path)
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for method, path, operation in operations(doc):
        for status, response in operation["responses"].items():
            if status == "200":
                continue
            schema = response["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorEnvelope"}, (method, path)
        statuses = set(operation["responses"])
        if method in ("post", "put", "patch"):
            assert {"400", "413"} <= statuses, (method, path)
        creates_operation = method == "post" and ("/operations/" in path or ":sample" in path)
        assert ("422" in statuses) == creates_operation, (method, path)
    create = doc["paths"]["/v1/rl/training-sessions/{session_id}/operations/sample"]["post"]
    key = next(p for p in create["parameters"] if p["name"] == "Idempotency-Key")
    assert key["required"] is True


def test_replies_are_documented_for_every_route(tmp_path):
    doc = document(tmp_path)
    for method, path, operation in operations(doc):
        content = operation["responses"]["200"]["content"]
        schema = next(iter(content.values()))["schema"]
        if (method, path) in SIGNED and method == "get":
            continue  # a file
        assert schema.get("$ref", "").startswith("#/components/schemas/"), (method, path)


def test_the_configured_limits_are_the_schemas_maxima(tmp_path):
    limits = LimitsConfig(max_sequences=16, max_operation_tokens=512)
    schemas = document(tmp_path, limits)["components"]["schemas"]
    num_samples = schemas["SampleIn"]["properties"]["num_samples"]["anyOf"][0]
    max_tokens = schemas["SamplingParamsIn"]["properties"]["max_tokens"]["anyOf"][0]
    assert (num_samples["maximum"], max_tokens["maximum"]) == (16, 512)
