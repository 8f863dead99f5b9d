"""The posttrainError hierarchy. The service and engine raise these; api/app.py maps them to
HTTP status codes in one place, and the scheduler maps them to operation error codes.

Imports nothing from posttrain.
"""


class posttrainError(Exception):  # noqa: N801 - the project name is lower case on purpose
    """Base of every error posttrain raises on purpose."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(posttrainError, ValueError):
    """The request is malformed or asks for something invalid (HTTP 400, INVALID_INPUT)."""


class NotFound(posttrainError):
    """The object does not exist or is not the caller's (HTTP 404)."""


class Conflict(posttrainError):
    """The request conflicts with earlier state, e.g. a reused Idempotency-Key (HTTP 422)."""


class Unsupported(posttrainError):
    """A valid request for something this server does not implement (HTTP 400)."""


class Unauthorized(posttrainError):
    """Missing or unknown API key (HTTP 401)."""


class EngineFailure(posttrainError):
    """The engine failed while running an operation (INTERNAL_ERROR)."""


class NonFiniteLoss(EngineFailure):
    """A loss or gradient was NaN or infinite; the operation's contribution was discarded."""


class SessionNotActive(posttrainError):
    """The session is not RUNNING, so the operation cannot run (SESSION_NOT_ACTIVE)."""
