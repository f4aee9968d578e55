"""Python SDK for the Forkyard rollout gateway."""

from ._base_client import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT
from ._client import AsyncClient, Client
from ._exceptions import (
    APIConnectionError,
    APIError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    ForkyardError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitError,
    UnprocessableEntityError,
)
from ._models import Environment, Page, Sandbox, SandboxState, SessionInfo, SessionState, StepResult, Task
from ._pagination import AsyncPager, Pager
from ._version import __version__
from .resources.sessions import AsyncSession, AsyncSessionOpener, Session

__all__ = [
    "__version__",
    "Client",
    "AsyncClient",
    "DEFAULT_TIMEOUT",
    "DEFAULT_MAX_RETRIES",
    # sessions
    "Session",
    "AsyncSession",
    "AsyncSessionOpener",
    # models
    "Environment",
    "Task",
    "SessionInfo",
    "SessionState",
    "StepResult",
    "Sandbox",
    "SandboxState",
    "Page",
    "Pager",
    "AsyncPager",
    # errors
    "ForkyardError",
    "APIError",
    "APIConnectionError",
    "APITimeoutError",
    "APIResponseValidationError",
    "APIStatusError",
    "BadRequestError",
    "AuthenticationError",
    "PermissionDeniedError",
    "NotFoundError",
    "ConflictError",
    "PayloadTooLargeError",
    "UnprocessableEntityError",
    "RateLimitError",
    "InternalServerError",
]
