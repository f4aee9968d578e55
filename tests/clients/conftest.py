"""Fixtures for the SDK unit tests: a scripted fake gateway behind httpx.MockTransport."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

import forkyard

API_KEY = "sk-test-5f1c0ffee"
BASE_URL = "http://gateway.test"

Handler = Callable[[httpx.Request], "httpx.Response | Exception"]


def error_response(status: int, code: str, message: str, request_id: str = "req-1", **kw: Any) -> httpx.Response:
    """Build a gateway-shaped error answer."""
    body = {"error": {"code": code, "message": message, "request_id": request_id}}
    headers = {"X-Request-ID": request_id, **kw.pop("headers", {})}
    return httpx.Response(status, json=body, headers=headers, **kw)


class Twin:
    """One SDK client (sync or async) wired to a fake gateway, driven the same way from a test."""

    api_key = API_KEY
    base_url = BASE_URL
    error = staticmethod(error_response)

    def __init__(self, kind: str, **client_kwargs: Any) -> None:
        self.kind = kind
        self.requests: list[httpx.Request] = []
        self.sleeps: list[float] = []
        self._handler: Handler | None = None
        self._queue: list[httpx.Response | Exception] = []
        transport = httpx.MockTransport(self._handle)
        options = {"base_url": BASE_URL, "api_key": API_KEY, **client_kwargs}
        if kind == "sync":
            self.http = httpx.Client(transport=transport)
            self.client: forkyard.Client | forkyard.AsyncClient = forkyard.Client(http_client=self.http, **options)
            self.client._sleep = self.sleeps.append  # type: ignore[method-assign]
        else:
            self.http = httpx.AsyncClient(transport=transport)
            self.client = forkyard.AsyncClient(http_client=self.http, **options)

            async def fake_sleep(seconds: float) -> None:
                self.sleeps.append(seconds)

            self.client._sleep = fake_sleep  # type: ignore[method-assign]

    # -- scripting the gateway ------------------------------------------------

    def respond(self, *answers: httpx.Response | Exception) -> None:
        """Queue answers (responses, or transport errors to raise) for the next requests, in order."""
        self._queue.extend(answers)

    def handle(self, handler: Handler) -> None:
        """Answer every request with handler (used once the queue is empty); it may return an exception to raise."""
        self._handler = handler

    def _handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self._queue:
            answer = self._queue.pop(0)
        elif self._handler is not None:
            answer = self._handler(request)
        else:
            raise AssertionError(f"unexpected request {request.method} {request.url}")
        if isinstance(answer, Exception):
            raise answer
        return answer

    # -- driving the client the same way for both kinds -----------------------

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call an SDK method and await it when it is async."""
        result = fn(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def collect(self, iterable: Any) -> list[Any]:
        """Drain a sync or async iterator into a list."""
        if hasattr(iterable, "__aiter__"):
            return [item async for item in iterable]
        return list(iterable)

    def body(self, index: int = -1) -> Any:
        """Return the JSON body of a recorded request."""
        return json.loads(self.requests[index].content)

    async def aclose(self) -> None:
        if self.kind == "sync":
            self.client.close()
            self.http.close()
        else:
            await self.client.aclose()
            await self.http.aclose()


@pytest.fixture(params=["sync", "async"])
async def twin(request: pytest.FixtureRequest):
    """A Client or an AsyncClient on a fake gateway; tests run once for each."""
    t = Twin(request.param)
    try:
        yield t
    finally:
        await t.aclose()


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    """Which twin a make_twin-based test builds."""
    return request.param


@pytest.fixture
async def make_twin():
    """Build twins with custom client options; closes them at teardown."""
    made: list[Twin] = []

    def make(kind: str, **client_kwargs: Any) -> Twin:
        t = Twin(kind, **client_kwargs)
        made.append(t)
        return t

    yield make
    for t in made:
        await t.aclose()
