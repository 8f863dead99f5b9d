"""Each error class carries its HTTP answer and the operation error code it records."""

from __future__ import annotations

import pytest

from posttrain.errors import (
    ConfigError,
    Conflict,
    EngineFailure,
    InvalidRequest,
    NonFiniteLoss,
    NotFound,
    ResourceExhausted,
    SessionNotActive,
    Unauthorized,
    Unsupported,
    operation_error_code,
)
from posttrain.statuses import OperationErrorCode


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (InvalidRequest("x"), 400, "invalid_request_error"),
        (Unsupported("x"), 400, "invalid_request_error"),
        (Unauthorized("x"), 401, "authentication_error"),
        (NotFound("x"), 404, "not_found_error"),
        (Conflict("x"), 422, "conflict_error"),
        (EngineFailure("x"), 500, "server_error"),
        (ConfigError("x"), 500, "server_error"),
    ],
)
def test_http_answer_per_class(error, status, kind):
    assert (error.http_status, error.error_type) == (status, kind)


class OutOfMemoryError(RuntimeError):
    """Named like torch's device OOM, which is a RuntimeError and not a MemoryError."""


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidRequest("x"), OperationErrorCode.INVALID_INPUT),
        (NonFiniteLoss("x"), OperationErrorCode.NON_FINITE_LOSS),
        (SessionNotActive("x"), OperationErrorCode.SESSION_NOT_ACTIVE),
        (EngineFailure("x"), OperationErrorCode.INTERNAL_ERROR),
        (ResourceExhausted("x"), OperationErrorCode.RESOURCE_EXHAUSTED),
        (MemoryError(), OperationErrorCode.RESOURCE_EXHAUSTED),
        (OutOfMemoryError("CUDA out of memory"), OperationErrorCode.RESOURCE_EXHAUSTED),
        (RuntimeError("boom"), OperationErrorCode.INTERNAL_ERROR),
        (KeyError("k"), OperationErrorCode.INTERNAL_ERROR),
    ],
)
def test_operation_error_code_per_class(error, code):
    # Every value is a member of the wire enum (errors.py spells them as plain strings).
    assert OperationErrorCode(operation_error_code(error)) is code
