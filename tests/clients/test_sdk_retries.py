"""Retries: which calls are resent, after what, and how long the SDK waits in between."""

from __future__ import annotations

import email.utils
import time

import httpx
import pytest

import forkyard

TASK = {"id": "t1", "name": "hello", "environment": "terminal", "content_hash": "ab", "instruction": "Say hi."}
STEP = {"observation": "ok", "reward": None, "terminated": False, "truncated": False, "info": {}}


def _backoff_bounds(retry: int) -> tuple[float, float]:
    full = min(0.5 * 2**retry, 8.0)
    return full * 0.75, full


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504])
async def test_get_is_retried_with_jittered_exponential_backoff(twin, status):
    twin.respond(twin.error(status, "x", "Busy."), twin.error(status, "x", "Busy."), httpx.Response(200, json=TASK))
    task = await twin.call(twin.client.tasks.get, "t1")
    assert task.name == "hello"
    assert len(twin.requests) == 3
    assert len(twin.sleeps) == 2
    for retry, delay in enumerate(twin.sleeps):
        low, high = _backoff_bounds(retry)
        assert low <= delay <= high
    assert [r.headers.get("x-forkyard-retry-count") for r in twin.requests] == [None, "1", "2"]


async def test_retries_stop_after_max_retries(twin):
    twin.handle(lambda request: twin.error(503, "unavailable", "Down.", request_id="req-last"))
    with pytest.raises(forkyard.InternalServerError) as info:
        await twin.call(twin.client.tasks.get, "t1")
    assert info.value.request_id == "req-last"
    assert len(twin.requests) == 1 + twin.client.max_retries
    assert len(twin.sleeps) == twin.client.max_retries


@pytest.mark.parametrize("max_retries", [0, 1, 4])
async def test_max_retries_is_configurable(make_twin, kind, max_retries):
    twin = make_twin(kind, max_retries=max_retries)
    twin.handle(lambda request: twin.error(500, "internal_error", "Boom."))
    with pytest.raises(forkyard.InternalServerError):
        await twin.call(twin.client.tasks.get, "t1")
    assert len(twin.requests) == max_retries + 1
    # The cap holds however many retries there are.
    assert all(delay <= 8.0 for delay in twin.sleeps)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
async def test_client_errors_are_not_retried(twin, status):
    twin.respond(twin.error(status, "x", "No."))
    with pytest.raises(forkyard.APIStatusError):
        await twin.call(twin.client.tasks.get, "t1")
    assert len(twin.requests) == 1 and twin.sleeps == []


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"Retry-After": "3"}, 3.0),
        ({"Retry-After": "0.25"}, 0.25),
        ({"Retry-After": "0"}, 0.0),
        ({"Retry-After-Ms": "1500"}, 1.5),
    ],
)
async def test_retry_after_is_honoured(twin, headers, expected):
    twin.respond(twin.error(429, "rate_limited", "Slow down.", headers=headers), httpx.Response(200, json=TASK))
    await twin.call(twin.client.tasks.get, "t1")
    assert twin.sleeps == [expected]


async def test_retry_after_http_date_is_honoured(twin):
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    twin.respond(
        twin.error(503, "unavailable", "Later.", headers={"Retry-After": when}), httpx.Response(200, json=TASK)
    )
    await twin.call(twin.client.tasks.get, "t1")
    assert len(twin.sleeps) == 1
    assert 0 < twin.sleeps[0] <= 30


async def test_garbage_retry_after_falls_back_to_backoff(twin):
    twin.respond(
        twin.error(503, "unavailable", "Later.", headers={"Retry-After": "soon"}), httpx.Response(200, json=TASK)
    )
    await twin.call(twin.client.tasks.get, "t1")
    low, high = _backoff_bounds(0)
    assert len(twin.sleeps) == 1 and low <= twin.sleeps[0] <= high


async def test_long_retry_after_is_raised_not_waited(twin):
    twin.respond(twin.error(429, "rate_limited", "Come back in an hour.", headers={"Retry-After": "3600"}))
    with pytest.raises(forkyard.RateLimitError) as info:
        await twin.call(twin.client.tasks.get, "t1")
    assert info.value.response.headers["retry-after"] == "3600"
    assert len(twin.requests) == 1 and twin.sleeps == []


@pytest.mark.parametrize("status", [409, 429, 500, 502, 503])
async def test_post_is_not_retried_on_errors_without_retry_after(twin, status):
    twin.respond(twin.error(status, "x", "Maybe it ran."))
    with pytest.raises(forkyard.APIStatusError):
        await twin.call(twin.client.sessions.step, "s1", "bash", command="rm -rf /tmp/x")
    assert len(twin.requests) == 1 and twin.sleeps == []


@pytest.mark.parametrize("status", [429, 503])
async def test_post_is_retried_on_429_and_503_with_retry_after(twin, status):
    twin.respond(twin.error(status, "x", "Not now.", headers={"Retry-After": "2"}), httpx.Response(200, json=STEP))
    result = await twin.call(twin.client.sessions.step, "s1", "bash", command="ls")
    assert result.observation == "ok"
    assert len(twin.requests) == 2 and twin.sleeps == [2.0]
    assert twin.body(0) == twin.body(1) == {"action": {"tool": "bash", "arguments": {"command": "ls"}}}


async def test_post_with_retry_after_on_500_is_not_retried(twin):
    twin.respond(twin.error(500, "internal_error", "Boom.", headers={"Retry-After": "1"}))
    with pytest.raises(forkyard.InternalServerError):
        await twin.call(twin.client.sessions.step, "s1", "submit")
    assert len(twin.requests) == 1


@pytest.mark.parametrize("error_cls", [httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout])
async def test_post_is_retried_when_the_request_was_never_sent(twin, error_cls):
    twin.respond(error_cls("refused"), httpx.Response(200, json=STEP))
    result = await twin.call(twin.client.sessions.step, "s1", "bash", command="ls")
    assert result.observation == "ok"
    assert len(twin.requests) == 2 and len(twin.sleeps) == 1


@pytest.mark.parametrize(
    ("error_cls", "sdk_error"),
    [
        (httpx.ReadError, forkyard.APIConnectionError),
        (httpx.RemoteProtocolError, forkyard.APIConnectionError),
        (httpx.ReadTimeout, forkyard.APITimeoutError),
        (httpx.WriteTimeout, forkyard.APITimeoutError),
    ],
)
async def test_post_is_not_retried_once_sent(twin, error_cls, sdk_error):
    twin.respond(error_cls("mid-flight"))
    with pytest.raises(sdk_error) as info:
        await twin.call(twin.client.sessions.step, "s1", "bash", command="make")
    assert type(info.value.__cause__) is error_cls
    assert info.value.request is not None
    assert len(twin.requests) == 1 and twin.sleeps == []


@pytest.mark.parametrize(
    ("error_cls", "sdk_error"),
    [(httpx.ReadError, forkyard.APIConnectionError), (httpx.ReadTimeout, forkyard.APITimeoutError)],
)
async def test_get_and_delete_are_retried_on_any_transport_error(twin, error_cls, sdk_error):
    twin.respond(error_cls("flaky"), httpx.Response(200, json=TASK), error_cls("flaky"), httpx.Response(204))
    assert (await twin.call(twin.client.tasks.get, "t1")).id == "t1"
    assert await twin.call(twin.client.sessions.close, "s1") is None
    assert [r.method for r in twin.requests] == ["GET", "GET", "DELETE", "DELETE"]

    twin.handle(lambda request: error_cls("still down"))
    with pytest.raises(sdk_error):
        await twin.call(twin.client.tasks.get, "t1")
    assert len(twin.requests) == 4 + 1 + twin.client.max_retries


async def test_connection_error_message_names_the_gateway(make_twin, kind):
    twin = make_twin(kind, max_retries=0)
    twin.respond(httpx.ConnectError("[Errno 111] Connection refused"))
    with pytest.raises(forkyard.APIConnectionError) as info:
        await twin.call(twin.client.tasks.get, "t1")
    assert str(info.value) == (
        f"Could not reach the Forkyard gateway at {twin.base_url} for GET /v1/tasks/t1: [Errno 111] Connection refused"
    )


async def test_task_import_is_retried_because_the_gateway_deduplicates(twin):
    twin.respond(twin.error(502, "bad_gateway", "Hiccup."), httpx.Response(201, json={"items": [TASK]}))
    spec = {"name": "hello", "files": {"instruction.md": "Say hi.", "task.toml": ""}}
    tasks = await twin.call(twin.client.tasks.import_specs, [spec])
    assert [t.id for t in tasks] == ["t1"]
    assert len(twin.requests) == 2 and twin.body(0) == twin.body(1)
