"""What Client and AsyncClient share: configuration, request building, retries, parsing.

The retry loop is written once, as a generator that yields the I/O it needs (an
``httpx.Request`` to send, or a ``_Sleep``) and receives the outcome. The sync and
async clients only drive it: they send with their own httpx client and sleep their
own way.
"""

from __future__ import annotations

import email.utils
import logging
import os
import random
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Generic, Protocol, TypeVar, Union

import httpx
import pydantic

from ._exceptions import (
    APIConnectionError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    ForkyardError,
    error_class_for_status,
)
from ._version import __version__

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
"""Steps run commands and verifiers server-side, so reads may legitimately take minutes."""
DEFAULT_MAX_RETRIES = 2
INITIAL_RETRY_DELAY_S = 0.5
MAX_RETRY_DELAY_S = 8.0
MAX_RETRY_AFTER_S = 60.0
"""A Retry-After longer than this is not waited for: the error is raised instead."""

_IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
_RETRYABLE_STATUSES = frozenset({408, 409, 429})
# These errors mean the request never left this process, so even a POST is safe to resend.
_NOT_SENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# Programming or configuration mistakes: resending cannot help.
_NEVER_RETRY_ERRORS = (httpx.UnsupportedProtocol, httpx.LocalProtocolError, httpx.InvalidURL)

HttpxClientT = TypeVar("HttpxClientT", httpx.Client, httpx.AsyncClient)
R = TypeVar("R")
TimeoutTypes = Union[float, httpx.Timeout, None]
_ClientT = TypeVar("_ClientT", bound="BaseClient[Any]")


class _NotGiven:
    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Any = _NotGiven()


@dataclass
class RequestOptions(Generic[R]):
    """Everything needed to send one API call and turn its answer into a value of type R."""

    method: str
    path: str
    params: Mapping[str, Any] | None = None
    json: Any = None
    content: bytes | None = None
    headers: Mapping[str, str] | None = None
    cast_to: Any = None
    """A pydantic-validatable type for the JSON body, or None when the body is ignored."""
    transform: Callable[[Any], Any] | None = None
    idempotent: bool | None = None
    """Override the method-based guess, e.g. for POSTs the server deduplicates."""
    raw: bool = False
    """Return the body's bytes as they came (a file), not parsed JSON."""

    @property
    def is_idempotent(self) -> bool:
        """Return whether resending this call after an unknown outcome is safe."""
        if self.idempotent is not None:
            return self.idempotent
        return self.method.upper() in _IDEMPOTENT_METHODS


@dataclass(frozen=True)
class _Sleep:
    seconds: float


_Flow = Generator[Union[httpx.Request, _Sleep], Any, Any]


@cache
def _adapter(tp: Any) -> pydantic.TypeAdapter[Any]:
    return pydantic.TypeAdapter(tp)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or repr(tp)


def parse_retry_after(response: httpx.Response) -> float | None:
    """Return the delay in seconds a response asks for (Retry-After / Retry-After-Ms), if any."""
    raw_ms = response.headers.get("retry-after-ms")
    if raw_ms is not None:
        try:
            return max(float(raw_ms) / 1000.0, 0.0)
        except ValueError:
            pass
    raw = response.headers.get("retry-after")
    if raw is None:
        return None
    try:
        return max(float(raw), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


def backoff_delay(retries_done: int) -> float:
    """Return a jittered exponential delay for the next retry."""
    delay = min(INITIAL_RETRY_DELAY_S * (2.0**retries_done), MAX_RETRY_DELAY_S)
    return delay * (1.0 - 0.25 * random.random())


def _clean_params(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not params:
        return None
    return {key: value for key, value in params.items() if value is not None} or None


def _error_parts(response: httpx.Response) -> tuple[Any, str | None, str, str | None]:
    """Return (body, code, message, request_id) from an error response of any shape."""
    body: Any
    try:
        body = response.json()
    except ValueError:
        body = response.text or None
    code: Any = None
    message: Any = None
    request_id: Any = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            code = error.get("code")
            message = error.get("message")
            request_id = error.get("request_id")
        elif isinstance(error, str):
            message = error
        detail = body.get("detail")
        if message is None and isinstance(detail, str):
            message = detail
        elif message is None and isinstance(detail, list):
            # FastAPI's default validation answer, in case a route bypasses the gateway's handler.
            parts = []
            for item in detail:
                if isinstance(item, dict):
                    loc = ".".join(str(p) for p in item.get("loc", ()))
                    parts.append(f"{loc}: {item.get('msg')}" if loc else str(item.get("msg")))
            message = "; ".join(parts) or None
    elif isinstance(body, str) and body.strip():
        message = body.strip()[:500]
    request_id = request_id or response.headers.get("x-request-id")
    if not message:
        message = response.reason_phrase or f"HTTP {response.status_code}"
    return body, (str(code) if code is not None else None), str(message), (str(request_id) if request_id else None)


class BaseClient(Generic[HttpxClientT]):
    """Hold the connection settings and the logic shared by Client and AsyncClient."""

    base_url: str
    api_key: str
    timeout: httpx.Timeout
    max_retries: int
    _http: HttpxClientT
    _owns_http: bool

    def __init__(
        self,
        *,
        base_url: str | None,
        api_key: str | None,
        timeout: TimeoutTypes,
        max_retries: int,
        default_headers: Mapping[str, str] | None,
        http_client: HttpxClientT | None,
    ) -> None:
        if base_url is None:
            base_url = os.environ.get("FORKYARD_URL") or DEFAULT_BASE_URL
        if api_key is None:
            api_key = os.environ.get("FORKYARD_API_KEY")
        if not api_key:
            raise ForkyardError("No API key given: pass api_key=... or set FORKYARD_API_KEY.")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be a non-negative integer, got {max_retries!r}.")
        url = httpx.URL(base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"base_url must be an http(s) URL such as {DEFAULT_BASE_URL}, got {base_url!r}.")
        self.base_url = str(url).rstrip("/")
        self.api_key = api_key
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self.max_retries = max_retries
        self._default_headers = dict(default_headers or {})
        if http_client is None:
            self._http = self._make_http_client()
            self._owns_http = True
        else:
            self._http = http_client
            self._owns_http = False

    def _make_http_client(self) -> HttpxClientT:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r}, max_retries={self.max_retries})"

    def with_options(self: _ClientT, *, timeout: TimeoutTypes = NOT_GIVEN, max_retries: int | None = None) -> _ClientT:
        """Return a client with other timeout/retry settings that shares this one's connections."""
        return type(self)(
            base_url=self.base_url,
            api_key=self.api_key,
            timeout=self.timeout if timeout is NOT_GIVEN else timeout,
            max_retries=self.max_retries if max_retries is None else max_retries,
            default_headers=self._default_headers,
            http_client=self._http,
        )

    # -- requests -------------------------------------------------------------

    def _build_request(self, options: RequestOptions[Any], retries_done: int) -> httpx.Request:
        headers = {
            "Accept": "application/json",
            "User-Agent": f"forkyard-python/{__version__}",
            **self._default_headers,
            **(options.headers or {}),
            "Authorization": f"Bearer {self.api_key}",
        }
        if retries_done:
            headers["X-Forkyard-Retry-Count"] = str(retries_done)
        return self._http.build_request(
            options.method,
            self.base_url + options.path,
            params=_clean_params(options.params),
            json=options.json,
            content=options.content,
            headers=headers,
            timeout=self.timeout,
        )

    def _request_flow(self, options: RequestOptions[Any]) -> _Flow:
        """Send one call with retries; yields requests to send and sleeps, returns the parsed value."""
        retries_done = 0
        idempotent = options.is_idempotent
        what = f"{options.method} {options.path}"
        while True:
            request = self._build_request(options, retries_done)
            logger.debug("Sending %s", what)
            failure: httpx.TransportError | None = None
            response: httpx.Response | None = None
            try:
                response = yield request
            except httpx.TransportError as exc:
                failure = exc

            if failure is not None:
                if retries_done < self.max_retries and self._should_retry_error(failure, idempotent):
                    delay = backoff_delay(retries_done)
                    retries_done += 1
                    logger.info(
                        "Retrying %s in %.2fs (retry %d of %d) after %s",
                        what, delay, retries_done, self.max_retries, type(failure).__name__,
                    )
                    yield _Sleep(delay)
                    continue
                if isinstance(failure, httpx.TimeoutException):
                    raise APITimeoutError(f"{what} to {self.base_url} timed out.", request=request) from failure
                detail = str(failure) or type(failure).__name__
                raise APIConnectionError(
                    f"Could not reach the Forkyard gateway at {self.base_url} for {what}: {detail}", request=request
                ) from failure

            assert response is not None
            logger.debug(
                "%s -> %s (request id %s)", what, response.status_code, response.headers.get("x-request-id")
            )
            if response.is_success:
                return self._process_response(options, response)
            if retries_done < self.max_retries:
                wait = self._retry_delay_for_response(response, idempotent, retries_done)
                if wait is not None:
                    retries_done += 1
                    logger.info(
                        "Retrying %s in %.2fs (retry %d of %d) after status %d",
                        what, wait, retries_done, self.max_retries, response.status_code,
                    )
                    yield _Sleep(wait)
                    continue
            raise self._make_status_error(response)

    @staticmethod
    def _should_retry_error(error: httpx.TransportError, idempotent: bool) -> bool:
        if isinstance(error, _NEVER_RETRY_ERRORS):
            return False
        return idempotent or isinstance(error, _NOT_SENT_ERRORS)

    @staticmethod
    def _retry_delay_for_response(response: httpx.Response, idempotent: bool, retries_done: int) -> float | None:
        """Return how long to wait before resending, or None when this answer must be raised."""
        status = response.status_code
        retry_after = parse_retry_after(response)
        if idempotent:
            if status not in _RETRYABLE_STATUSES and status < 500:
                return None
        elif status not in (429, 503) or retry_after is None:
            # A non-idempotent call may already have taken effect; only an explicit
            # "come back later" proves it did not.
            return None
        if retry_after is None:
            return backoff_delay(retries_done)
        if retry_after > MAX_RETRY_AFTER_S:
            return None
        return retry_after

    def _make_status_error(self, response: httpx.Response) -> APIStatusError:
        body, code, message, request_id = _error_parts(response)
        error_cls = error_class_for_status(response.status_code)
        return error_cls(message, response=response, code=code, request_id=request_id, body=body)

    def _process_response(self, options: RequestOptions[Any], response: httpx.Response) -> Any:
        if options.raw:
            return response.content
        result: Any = None
        if options.cast_to is not None and response.status_code != 204:
            try:
                data = response.json()
            except ValueError as exc:
                raise APIResponseValidationError(
                    f"The gateway's answer to {options.method} {options.path} is not JSON.", response=response
                ) from exc
            try:
                result = _adapter(options.cast_to).validate_python(data)
            except pydantic.ValidationError as exc:
                first = exc.errors()[0]
                loc = ".".join(str(p) for p in first["loc"]) or "body"
                raise APIResponseValidationError(
                    f"The gateway's answer to {options.method} {options.path} is not a valid "
                    f"{_type_name(options.cast_to)}: {loc}: {first['msg']}.",
                    response=response,
                    body=data,
                ) from exc
        if options.transform is not None:
            result = options.transform(result)
        return result


class Requester(Protocol):
    """What an event stream's flow uses of either client: how it builds requests and reads failed answers."""

    def _build_request(self, options: RequestOptions[Any], retries_done: int) -> httpx.Request: ...

    def _retry_delay_for_response(self, response: httpx.Response, idempotent: bool,
                                  retries_done: int) -> float | None: ...

    def _make_status_error(self, response: httpx.Response) -> APIStatusError: ...


class SyncRequester(Requester, Protocol):
    """What resources, pagers and streams use of a :class:`~forkyard.Client`: its requests, its HTTP client
    and its sleep (the seam between them and the client that owns them)."""

    _http: httpx.Client

    def _request(self, options: RequestOptions[R]) -> R: ...

    def _sleep(self, seconds: float) -> None: ...


class AsyncRequester(Requester, Protocol):
    """What resources, pagers and streams use of an :class:`~forkyard.AsyncClient`."""

    _http: httpx.AsyncClient

    async def _request(self, options: RequestOptions[R]) -> R: ...

    async def _sleep(self, seconds: float) -> None: ...
