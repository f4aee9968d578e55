"""The SDK's exception tree, rooted at ForkyardError."""

from __future__ import annotations

from typing import Any

import httpx

__all__ = [
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


class ForkyardError(Exception):
    """Root of every error the Forkyard SDK raises."""


class APIError(ForkyardError):
    """An error talking to the gateway about one request."""

    message: str
    request: httpx.Request | None

    def __init__(self, message: str, *, request: httpx.Request | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request = request


class APIConnectionError(APIError):
    """Raise when the gateway could not be reached or the connection broke."""

    def __init__(
        self, message: str = "Could not connect to the Forkyard gateway.", *, request: httpx.Request | None = None
    ) -> None:
        super().__init__(message, request=request)


class APITimeoutError(APIConnectionError):
    """Raise when a request to the gateway timed out."""

    def __init__(
        self, message: str = "The request to the Forkyard gateway timed out.", *, request: httpx.Request | None = None
    ) -> None:
        super().__init__(message, request=request)


class APIResponseValidationError(APIError):
    """Raise when a successful response does not have the shape the SDK expects."""

    def __init__(self, message: str, *, response: httpx.Response, body: Any = None) -> None:
        super().__init__(message, request=response.request)
        self.response = response
        self.status_code = response.status_code
        self.body = body


class APIStatusError(APIError):
    """Raise when the gateway answered with a 4xx or 5xx status."""

    status_code: int
    code: str | None
    request_id: str | None
    body: Any
    response: httpx.Response

    def __init__(
        self,
        message: str,
        *,
        response: httpx.Response,
        code: str | None = None,
        request_id: str | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(message, request=response.request)
        self.response = response
        self.status_code = response.status_code
        self.code = code
        self.request_id = request_id
        self.body = body

    def __str__(self) -> str:
        text = f"{self.status_code} {self.code or 'error'}: {self.message}"
        if self.request_id:
            text += f" (request id: {self.request_id})"
        return text


class BadRequestError(APIStatusError):
    """The gateway rejected the request as malformed (400)."""


class AuthenticationError(APIStatusError):
    """The API key is missing or wrong (401)."""


class PermissionDeniedError(APIStatusError):
    """The API key may not do this (403)."""


class NotFoundError(APIStatusError):
    """The addressed object does not exist (404)."""


class ConflictError(APIStatusError):
    """The request conflicts with the object's state, e.g. a closed session (409)."""


class PayloadTooLargeError(APIStatusError):
    """The upload is larger than the gateway accepts (413)."""


class UnprocessableEntityError(APIStatusError):
    """The request was well formed but its content is invalid (422)."""


class RateLimitError(APIStatusError):
    """Too many requests (429)."""


class InternalServerError(APIStatusError):
    """The gateway failed or is unavailable (5xx)."""


_STATUS_ERRORS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    413: PayloadTooLargeError,
    422: UnprocessableEntityError,
    429: RateLimitError,
}


def error_class_for_status(status_code: int) -> type[APIStatusError]:
    """Return the APIStatusError subclass that stands for an HTTP status."""
    if status_code >= 500:
        return InternalServerError
    return _STATUS_ERRORS.get(status_code, APIStatusError)
