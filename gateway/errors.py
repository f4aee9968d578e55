"""Gateway errors and the handlers that answer every failure as one JSON shape.

Every error body is ``{"error": {"code", "message", "request_id"}}``; foreign errors
(workers, sandboxes, validation, routing) are mapped here, at the edge.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.logs import current_request_id
from sandboxes.errors import SandboxError
from workers.errors import WorkerError

logger = logging.getLogger(__name__)

#: The stable code answered for a bare HTTP status.
STATUS_CODES: dict[int, str] = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "validation_error",
    429: "rate_limited",
    500: "internal_error",
    503: "unavailable",
}


class GatewayError(Exception):
    """Root of the gateway's errors: an HTTP status, a stable snake_case code and one sentence."""

    def __init__(self, status: int, code: str, message: str, *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})


class BadRequestError(GatewayError):
    """The request is malformed in a way validation cannot name (400)."""

    def __init__(self, message: str, *, code: str = "bad_request") -> None:
        super().__init__(400, code, message)


class UnauthorizedError(GatewayError):
    """The API key is missing or not valid (401)."""

    def __init__(self, message: str) -> None:
        super().__init__(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


class NotFoundError(GatewayError):
    """The named object does not exist (404)."""

    def __init__(self, message: str) -> None:
        super().__init__(404, "not_found", message)


class ConflictError(GatewayError):
    """The request conflicts with the object's state (409)."""

    def __init__(self, message: str, *, code: str = "conflict") -> None:
        super().__init__(409, code, message)


class UnsupportedMediaTypeError(GatewayError):
    """The body's Content-Type is not one the route reads (415)."""

    def __init__(self, message: str) -> None:
        super().__init__(415, "unsupported_media_type", message)


class InvalidRequestError(GatewayError):
    """The request is well-formed but its content is not acceptable (422)."""

    def __init__(self, message: str, *, code: str = "validation_error") -> None:
        super().__init__(422, code, message)


class RateLimitedError(GatewayError):
    """A limit is reached; retry later (429)."""

    def __init__(self, message: str, *, retry_after_s: int = 5) -> None:
        super().__init__(429, "rate_limited", message, headers={"Retry-After": str(retry_after_s)})


class UnavailableError(GatewayError):
    """A dependency (sandbox backend, worker) cannot serve the request now (503)."""

    def __init__(self, message: str, *, code: str = "unavailable") -> None:
        super().__init__(503, code, message)


def request_id_of(request: Request) -> str:
    """Return the request's id as set by the request-id middleware."""
    return request.scope.get("state", {}).get("request_id") or current_request_id() or ""


def error_body(code: str, message: str, request_id: str) -> dict[str, Any]:
    """Return the one error shape every failure is answered with."""
    return {"error": {"code": code, "message": message, "request_id": request_id}}


def error_response(
    status: int, code: str, message: str, request_id: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """Return a JSON error response carrying ``request_id`` in the body and X-Request-ID."""
    all_headers = {**(headers or {}), "X-Request-ID": request_id}
    return JSONResponse(error_body(code, message, request_id), status_code=status, headers=all_headers)


def _sentence(message: str) -> str:
    message = message.strip()
    return message if message.endswith((".", "!", "?")) else message + "."


def map_foreign_error(exc: Exception) -> GatewayError | None:
    """Return the gateway error a worker or sandbox error stands for, or None."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, WorkerError):
        if exc.status == 500:  # a bug: nothing of it is the client's business
            return GatewayError(exc.status, exc.code, "An internal error occurred.")
        return GatewayError(exc.status, exc.code, _sentence(exc.message))
    if isinstance(exc, SandboxError):
        return UnavailableError(_sentence(f"Sandbox backend error: {exc}"), code="sandbox_error")
    return None


def summarize_validation_errors(errors: Sequence[Any]) -> str:
    """Return one sentence naming the first invalid field (and how many more there are)."""
    if not errors:
        return "The request is not valid."
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ())]
    where = loc[0] if loc else "request"
    path = ".".join(loc[1:])
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        message = f"The request body is not valid JSON{f' ({detail})' if detail else ''}."
    else:
        label = {"body": "body field", "query": "query parameter", "path": "path parameter",
                 "header": "header"}.get(where, where)
        msg = str(first.get("msg", "")).rstrip(".")
        text = "is required" if kind == "missing" else f"is invalid: {msg}" if msg else "is invalid"
        message = f"{label} '{path}' {text}." if path else f"The request {where} {text}."
        message = message[0].upper() + message[1:]
    if len(errors) > 1:
        more = len(errors) - 1
        message = message[:-1] + f" (and {more} more problem{'s' if more > 1 else ''})."
    return message


def as_gateway_error(exc: Exception) -> GatewayError:
    """Return the gateway error any exception answers as at an edge (REST, gRPC): a bug is a bare 500."""
    return map_foreign_error(exc) or GatewayError(500, "internal_error", "An internal error occurred.")


async def _gateway_error_handler(request: Request, exc: Exception) -> JSONResponse:
    mapped = as_gateway_error(exc)
    rid = request_id_of(request)
    if mapped.status >= 500:
        logger.warning("request %s failed with %s: %s", rid, mapped.code, exc, exc_info=exc)
    return error_response(mapped.status, mapped.code, mapped.message, rid, mapped.headers)


async def _http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    code = STATUS_CODES.get(status, "bad_request" if status < 500 else "internal_error")
    detail = exc.detail if isinstance(exc.detail, str) else ""
    if status == 404 and detail in ("", "Not Found"):
        message = f"No route matches {request.method} {request.url.path}."
    elif status == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}."
    else:
        message = _sentence(detail or f"The request failed with HTTP status {status}")
    return error_response(status, code, message, request_id_of(request), exc.headers)


async def _validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message = summarize_validation_errors(exc.errors())
    return error_response(422, "validation_error", message, request_id_of(request))


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn every known error into the JSON error shape."""
    app.add_exception_handler(GatewayError, _gateway_error_handler)
    app.add_exception_handler(WorkerError, _gateway_error_handler)
    app.add_exception_handler(SandboxError, _gateway_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
