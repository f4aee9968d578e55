"""Server-sent events: a parser, a resuming reader, and the Stream / AsyncStream that drive it.

As with plain requests (``_base_client``), the logic is written once, as a generator
(``sse_flow``) that yields the I/O it needs: open a streaming request, read the next
chunk, close a response, sleep, or hand an item to the caller. ``Stream`` and
``AsyncStream`` only perform that I/O, each its own way.

The reader follows the EventSource model: when the connection drops (a network
error, or the server closing before the stream's end), it reconnects after a backoff
and sends ``Last-Event-ID`` with the id of the last event it received, so the server
resumes after it. Reconnects are bounded: after ``max_reconnects`` attempts in a row
without receiving an event, the error is raised.
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass, replace
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar, Union

import httpx

from ._base_client import _NEVER_RETRY_ERRORS, Requester, RequestOptions, _Sleep, backoff_delay
from ._exceptions import APIConnectionError, APIResponseValidationError, APITimeoutError

if TYPE_CHECKING:
    from ._base_client import AsyncRequester, SyncRequester

__all__ = [
    "ServerSentEvent",
    "SSEDecoder",
    "STOP",
    "Reconnect",
    "Stream",
    "AsyncStream",
    "sse_flow",
    "DEFAULT_MAX_RECONNECTS",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_RECONNECTS = 5
"""Reconnect attempts in a row (without an event received in between) before giving up."""
MAX_SERVER_RETRY_S = 60.0
"""A server's `retry:` hint above this is capped."""


@dataclass(frozen=True)
class ServerSentEvent:
    """One dispatched event: its type ("message" when unnamed), data lines joined by newlines, and id."""

    event: str = "message"
    data: str = ""
    id: str | None = None
    retry_ms: int | None = None


class SSEDecoder:
    """Turn the bytes of a text/event-stream into events (the WHATWG EventSource parsing rules).

    Feed it chunks as they arrive, split anywhere (even inside a UTF-8 character or a
    CRLF). Comments (lines starting with ":") are heartbeats and are skipped. An event
    is dispatched at a blank line when it has data or a type; a half-received event is
    dropped when the stream ends, as the spec says.
    """

    def __init__(self, last_event_id: str | None = None) -> None:
        self.last_event_id = last_event_id
        """The id of the last dispatched event (an id carries over to later events, as in the spec)."""
        self._id_buffer = last_event_id
        self.retry_ms: int | None = None
        """The reconnection delay the server asked for with a `retry:` field, if any."""
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        self._first = True
        self._reset_event()

    def _reset_event(self) -> None:
        self._event_type = ""
        self._data: list[str] = []
        self._has_fields = False

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """Consume a chunk of bytes and return the events it completed."""
        text = self._text.decode(chunk)
        if self._first and text:
            text = text.removeprefix("\ufeff")
            self._first = False
        self._buffer += text
        events: list[ServerSentEvent] = []
        start = 0
        buffer = self._buffer
        while True:
            cr = buffer.find("\r", start)
            lf = buffer.find("\n", start)
            if cr == -1 and lf == -1:
                break
            if cr != -1 and (lf == -1 or cr < lf):
                if cr + 1 == len(buffer):
                    break  # a CR at the very end may be the first half of a CRLF
                end, next_start = cr, cr + (2 if buffer[cr + 1] == "\n" else 1)
            else:
                end, next_start = lf, lf + 1
            event = self._line(buffer[start:end])
            if event is not None:
                events.append(event)
            start = next_start
        self._buffer = buffer[start:]
        return events

    def _line(self, line: str) -> ServerSentEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._has_fields = True
        elif name == "event":
            self._event_type = value
            self._has_fields = True
        elif name == "id":
            if "\0" not in value:
                self._id_buffer = value or None
        elif name == "retry":
            if value.isdigit():
                self.retry_ms = int(value)
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        # An id counts once its event is complete, so a resumed stream repeats a
        # half-received event instead of skipping it.
        self.last_event_id = self._id_buffer
        # The spec drops events without data; an event with only a type (e.g. a bare
        # `event: end`) is still delivered here, since a server may well send one.
        if not self._has_fields:
            self._reset_event()
            return None
        event = ServerSentEvent(
            event=self._event_type or "message",
            data="\n".join(self._data),
            id=self.last_event_id,
            retry_ms=self.retry_ms,
        )
        self._reset_event()
        return event


# -- the resuming reader, written once ----------------------------------------------


@dataclass(frozen=True)
class _Open:
    """Send this request with a streamed body; answer with the response (an error's body read)."""

    request: httpx.Request


@dataclass(frozen=True)
class _Read:
    """Answer with the response's next chunk of bytes, b"" at its end."""

    response: httpx.Response


@dataclass(frozen=True)
class _Close:
    """Close this response."""

    response: httpx.Response


@dataclass(frozen=True)
class _Emit:
    """Hand this item to the caller."""

    item: Any


class _Stop:
    def __repr__(self) -> str:
        return "STOP"


STOP: Any = _Stop()
"""What an event handler returns to end the stream normally."""


@dataclass(frozen=True)
class Reconnect:
    """What an event handler returns when the server reports a failure it expects a reconnect to cure."""

    reason: str


EventHandler = Callable[[ServerSentEvent], Any]
"""Turn an event into an item for the caller, None to skip it, STOP to end the stream, or a Reconnect."""

_Action = Union[_Open, _Read, _Close, _Sleep, _Emit]
_StreamFlow = Generator[_Action, Any, None]


def _is_event_stream(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").split(";")[0].strip().lower() == "text/event-stream"


def sse_flow(
    client: Requester,
    options: RequestOptions[Any],
    handle: EventHandler,
    *,
    what: str,
    last_event_id: str | None = None,
    max_reconnects: int = DEFAULT_MAX_RECONNECTS,
) -> _StreamFlow:
    """Read an event stream, reconnecting with Last-Event-ID on drops; yields the I/O it needs."""
    failures = 0
    retry_ms: int | None = None
    while True:
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache", **(options.headers or {})}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        request = client._build_request(replace(options, headers=headers), failures)
        error: Exception | None = None
        reason: str
        try:
            response = yield _Open(request)
        except httpx.TransportError as exc:
            if isinstance(exc, _NEVER_RETRY_ERRORS):
                raise APIConnectionError(f"Could not open {what}: {exc}", request=request) from exc
            error, reason = exc, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        else:
            if not response.is_success:
                delay = None
                if failures < max_reconnects:
                    delay = client._retry_delay_for_response(response, True, failures)
                if delay is None:
                    raise client._make_status_error(response)
                failures += 1
                logger.info(
                    "Reopening %s in %.2fs (attempt %d of %d) after status %d",
                    what, delay, failures, max_reconnects, response.status_code,
                )
                yield _Sleep(delay)
                continue
            if not _is_event_stream(response):
                yield _Close(response)
                raise APIResponseValidationError(
                    f"The gateway answered {what} with {response.headers.get('content-type')!r}, "
                    "not an event stream (text/event-stream).",
                    response=response,
                )
            decoder = SSEDecoder(last_event_id)
            reason = "the gateway closed the stream before its end"
            try:
                reading = True
                while reading:
                    chunk = yield _Read(response)
                    if not chunk:
                        break
                    for event in decoder.feed(chunk):
                        last_event_id = decoder.last_event_id
                        item = handle(event)
                        if item is STOP:
                            yield _Close(response)
                            return
                        if isinstance(item, Reconnect):
                            reason, reading = item.reason, False
                            break
                        failures = 0
                        if item is not None:
                            yield _Emit(item)
            except httpx.TransportError as exc:
                error, reason = exc, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            last_event_id = decoder.last_event_id
            retry_ms = decoder.retry_ms if decoder.retry_ms is not None else retry_ms
            yield _Close(response)

        if failures >= max_reconnects:
            message = f"{what} dropped and could not be resumed after {failures} reconnect attempts: {reason}."
            if isinstance(error, httpx.TimeoutException):
                raise APITimeoutError(message, request=request) from error
            raise APIConnectionError(message, request=request) from error
        delay = backoff_delay(failures)
        if retry_ms is not None:
            delay = max(delay, min(retry_ms / 1000.0, MAX_SERVER_RETRY_S))
        failures += 1
        logger.info(
            "Resuming %s after event %s in %.2fs (attempt %d of %d) after %s",
            what, last_event_id, delay, failures, max_reconnects, reason,
        )
        yield _Sleep(delay)


# -- drivers ----------------------------------------------------------------------------


class Stream(Generic[T]):
    """Iterate over the items of a server-sent event stream; close it (or use `with`) when leaving early."""

    def __init__(self, client: SyncRequester, flow: _StreamFlow) -> None:
        self._client = client
        self._iterator = self._drive(flow)

    def _drive(self, flow: _StreamFlow) -> Iterator[T]:
        response: httpx.Response | None = None
        chunks: Iterator[bytes] | None = None
        try:
            action = next(flow)
            while True:
                try:
                    if isinstance(action, _Read):
                        assert chunks is not None
                        result: Any = next(chunks, b"")
                    elif isinstance(action, _Emit):
                        yield action.item
                        result = None
                    elif isinstance(action, _Open):
                        response = self._client._http.send(action.request, stream=True)
                        if not response.is_success:
                            response.read()
                        chunks = response.iter_bytes()
                        result = response
                    elif isinstance(action, _Close):
                        action.response.close()
                        result = None
                    else:
                        self._client._sleep(action.seconds)
                        result = None
                except httpx.TransportError as exc:
                    action = flow.throw(exc)
                else:
                    action = flow.send(result)
        except StopIteration:
            return
        finally:
            flow.close()
            if response is not None:
                response.close()

    def __iter__(self) -> Iterator[T]:
        return self._iterator

    def __next__(self) -> T:
        return next(self._iterator)

    def close(self) -> None:
        """Stop reading and close the connection (idempotent)."""
        self._iterator.close()  # type: ignore[attr-defined]

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncStream(Generic[T]):
    """Iterate (`async for`) over the items of a server-sent event stream; aclose it when leaving early."""

    def __init__(self, client: AsyncRequester, flow: _StreamFlow) -> None:
        self._client = client
        self._iterator = self._drive(flow)

    async def _drive(self, flow: _StreamFlow) -> AsyncIterator[T]:
        response: httpx.Response | None = None
        chunks: AsyncIterator[bytes] | None = None
        try:
            action = next(flow)
            while True:
                try:
                    if isinstance(action, _Read):
                        assert chunks is not None
                        result: Any = await anext(chunks, b"")
                    elif isinstance(action, _Emit):
                        yield action.item
                        result = None
                    elif isinstance(action, _Open):
                        response = await self._client._http.send(action.request, stream=True)
                        if not response.is_success:
                            await response.aread()
                        chunks = response.aiter_bytes()
                        result = response
                    elif isinstance(action, _Close):
                        await action.response.aclose()
                        result = None
                    else:
                        await self._client._sleep(action.seconds)
                        result = None
                except httpx.TransportError as exc:
                    action = flow.throw(exc)
                else:
                    action = flow.send(result)
        except StopIteration:
            return
        finally:
            flow.close()
            if response is not None:
                await response.aclose()

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iterator

    async def __anext__(self) -> T:
        return await self._iterator.__anext__()

    async def aclose(self) -> None:
        """Stop reading and close the connection (idempotent)."""
        await self._iterator.aclose()  # type: ignore[attr-defined]

    async def __aenter__(self) -> AsyncStream[T]:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
