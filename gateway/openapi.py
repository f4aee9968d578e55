"""The OpenAPI document: every error status a route can answer, declared with the one error shape.

Routes declare their success responses; the errors come from shared machinery (the API
key check, validation, the body-size limit, the error mapping of :mod:`gateway.errors`),
so they are declared here, by what a route has: a body can be too large, malformed or
of the wrong type; a path id can name nothing; a call that changes state can conflict;
a route that reaches sandboxes can find the backend unavailable.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA_NAME = "Error"
ERROR_SCHEMA: dict[str, Any] = {
    "title": ERROR_SCHEMA_NAME,
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message", "request_id"],
            "properties": {
                "code": {"type": "string", "description": "Stable snake_case code, e.g. session_busy."},
                "message": {"type": "string", "description": "One sentence saying what was wrong."},
                "request_id": {"type": "string"},
            },
        }
    },
}

_DESCRIPTIONS = {
    400: "Bad request (malformed in a way validation cannot name)",
    401: "Missing or invalid API key",
    404: "Not found",
    409: "Conflict with the object's state",
    413: "Request body too large",
    415: "Unsupported media type",
    422: "Validation error naming the field",
    429: "Too many (open sessions, requests)",
    503: "The sandbox backend or worker runtime is unavailable",
}
_STATEFUL = {"post", "put", "patch", "delete"}


def _errors_of(path: str, method: str, operation: dict[str, Any]) -> set[int]:
    codes = {400, 422}
    if path.startswith("/v1/"):
        codes.add(401)
    if "{" in path:
        codes.add(404)
    if method in _STATEFUL:
        codes |= {404, 409, 429, 503}
        codes |= {413, 415}
    elif path.startswith("/v1/"):
        codes |= {404, 409, 503}  # a read of a live object can find it gone or its node down
    return codes


def declare_error_responses(app: FastAPI) -> None:
    """Make ``app.openapi()`` declare every error status of every route, with the error schema."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        doc.setdefault("components", {}).setdefault("schemas", {})[ERROR_SCHEMA_NAME] = ERROR_SCHEMA
        ref = {"$ref": f"#/components/schemas/{ERROR_SCHEMA_NAME}"}
        for path, operations in doc.get("paths", {}).items():
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                for status in sorted(_errors_of(path, method, operation)):
                    entry = responses.setdefault(str(status), {"description": _DESCRIPTIONS[status]})
                    entry["content"] = {"application/json": {"schema": ref}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


__all__ = ["declare_error_responses"]
