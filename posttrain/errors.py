"""The posttrainError hierarchy. The service and engine raise these; each class carries what it
means on the wire, so there is one place per rule: `http_status` and `error_type` (api.md 6.1,
6.2) for api/app.py, `error_code` (an OperationErrorCode value) for an operation it fails.

Imports nothing from posttrain (the codes are the string values of statuses.OperationErrorCode).
"""

from __future__ import annotations

INVALID_INPUT = "TRAINING_OPERATION_ERROR_CODE_INVALID_INPUT"
INTERNAL_ERROR = "TRAINING_OPERATION_ERROR_CODE_INTERNAL_ERROR"
RESOURCE_EXHAUSTED = "TRAINING_OPERATION_ERROR_CODE_RESOURCE_EXHAUSTED"


class posttrainError(Exception):  # noqa: N801 - the project name is lower case on purpose
    """Base of every error posttrain raises on purpose. An error that reaches the HTTP edge
    without a class of its own below is a server error."""

    http_status = 500
    error_type = "server_error"
    error_code = INTERNAL_ERROR

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(posttrainError, ValueError):
    """The request is malformed or asks for something invalid."""

    http_status = 400
    error_type = "invalid_request_error"
    error_code = INVALID_INPUT


class NotFound(posttrainError):
    """The object does not exist or is not the caller's."""

    http_status = 404
    error_type = "not_found_error"


class Conflict(posttrainError):
    """The request conflicts with earlier state, e.g. a reused Idempotency-Key."""

    http_status = 422
    error_type = "conflict_error"


class Unsupported(posttrainError):
    """A valid request for something this server does not implement."""

    http_status = 400
    error_type = "invalid_request_error"
    error_code = INVALID_INPUT


class PayloadTooLarge(posttrainError):
    """A request body over the server's size limit; refused before the rest is read."""

    http_status = 413
    error_type = "invalid_request_error"
    error_code = INVALID_INPUT


class Unauthorized(posttrainError):
    """Missing or unknown API key."""

    http_status = 401
    error_type = "authentication_error"


class EngineFailure(posttrainError):
    """The engine failed while running an operation."""


class WorkerDied(EngineFailure):
    """The worker process of a model resource ended while (or before) serving a call
    (engine/hosts/process/worker.py); the service reloads the resource and restores its sessions."""


class GeneratorReplicaDied(EngineFailure):
    """A generator replica process ended while serving a sample (engine/hosts/replicas/engine.py);
    the trainer is untouched and the next sample starts a new replica."""


class NonFiniteLoss(EngineFailure):
    """A loss or gradient was NaN or infinite; the operation's contribution was discarded."""

    error_code = "TRAINING_OPERATION_ERROR_CODE_NON_FINITE_LOSS"


class ResourceExhausted(EngineFailure):
    """The operation needs more memory than is free: refused before it ran, state unchanged."""

    error_code = RESOURCE_EXHAUSTED


class SessionNotActive(posttrainError):
    """The session is not RUNNING, so the operation cannot run."""

    http_status = 400
    error_type = "invalid_request_error"
    error_code = "TRAINING_OPERATION_ERROR_CODE_SESSION_NOT_ACTIVE"


class ConfigError(posttrainError):
    """The server's own configuration (flags, environment, keys file, model directory) is
    invalid: raised before the server starts, printed by the CLI, never an HTTP answer."""


def operation_error_code(exc: BaseException) -> str:
    """The OperationErrorCode value an operation failed by `exc` records."""
    if isinstance(exc, posttrainError):
        return exc.error_code
    # Host memory, or torch's device OutOfMemoryError (a RuntimeError, matched by name since
    # this module imports no torch); torch's CPU allocator and C++'s operator new fail with a
    # plain RuntimeError whose message names them.
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return RESOURCE_EXHAUSTED
    if isinstance(exc, RuntimeError) and any(m in str(exc) for m in ALLOCATOR_FAILURES):
        return RESOURCE_EXHAUSTED
    return INTERNAL_ERROR


ALLOCATOR_FAILURES = (
    "DefaultCPUAllocator: can't allocate memory",
    "std::bad_alloc",
    "CUDA out of memory",
    "out of memory",
)
