"""Pure-ASGI middleware: request ids, access log, crash safety and the body size limit."""

from __future__ import annotations

import logging
import re
import secrets
import time
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.db import close_request_db_session
from gateway.errors import error_response
from gateway.logs import request_id_var
from gateway.sessions.gate import HeldRecords, holding

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("gateway.access")

REQUEST_ID_HEADER = "X-Request-ID"
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
def new_request_id() -> str:
    """Return a fresh request id."""
    return "req_" + secrets.token_hex(10)


class BodyTooLargeError(StarletteHTTPException):
    """The request body grew past the configured limit while being read."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body is larger than the limit of {limit} bytes.")


class RequestIdMiddleware:
    """Give every request an id (X-Request-ID in and out), log it, answer crashes with a 500, close its DB session.

    It also holds the session records the request makes until its answer is sent (see
    :mod:`gateway.sessions.gate`).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = ""
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                incoming = value.decode("latin-1")
                break
        rid = incoming if _VALID_REQUEST_ID.match(incoming) else new_request_id()
        scope.setdefault("state", {})["request_id"] = rid
        token = request_id_var.set(rid)
        started = False
        status = 500
        t0 = time.monotonic()

        async def send_with_id(message: Message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)
            if message["type"] == "http.response.body":
                held.release()  # the answer (or a stream's first chunk) is out: write what it recorded

        held = HeldRecords()
        try:
            with holding(held):
                await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("request %s (%s %s) failed with an unexpected error", rid, scope["method"], scope["path"])
            if started:
                raise
            response = error_response(500, "internal_error", f"An internal error occurred (request {rid}).", rid)
            await response(scope, receive, send_with_id)
        finally:
            held.release()
            await close_request_db_session(scope["state"])
            access_logger.info(
                "%s %s %s %.1fms request_id=%s",
                scope["method"], scope["path"], status, (time.monotonic() - t0) * 1000, rid,
            )
            request_id_var.reset(token)


class BodySizeLimitMiddleware:
    """Refuse request bodies over ``max_body_bytes`` with 413 before reading them whole."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    rid = scope.get("state", {}).get("request_id", "")
                    response = error_response(
                        413, "payload_too_large",
                        f"The request body ({declared} bytes) is larger than the limit of {limit} bytes.", rid,
                        headers={"Connection": "close"},
                    )
                    await response(scope, receive, send)
                    return
                break
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLargeError(limit)
            return message

        await self.app(scope, limited_receive, send)
