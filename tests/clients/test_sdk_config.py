"""Client construction, configuration from the environment, headers, ownership, public surface."""

from __future__ import annotations

import logging

import httpx
import pytest

import forkyard

BASE_URL = "http://gateway.test"


@pytest.mark.parametrize("cls", [forkyard.Client, forkyard.AsyncClient])
async def test_env_vars_are_read_at_construction(cls, monkeypatch):
    monkeypatch.setenv("FORKYARD_URL", "http://from-env:9000/")
    monkeypatch.setenv("FORKYARD_API_KEY", "sk-env")
    client = cls()
    try:
        assert client.base_url == "http://from-env:9000"
        assert client.api_key == "sk-env"
    finally:
        await _close(client)

    monkeypatch.setenv("FORKYARD_API_KEY", "sk-later")
    client = cls(base_url="http://explicit:1")
    try:
        assert client.api_key == "sk-later"
        assert client.base_url == "http://explicit:1"
    finally:
        await _close(client)


@pytest.mark.parametrize("cls", [forkyard.Client, forkyard.AsyncClient])
def test_missing_api_key_is_refused(cls, monkeypatch):
    monkeypatch.delenv("FORKYARD_API_KEY", raising=False)
    with pytest.raises(forkyard.ForkyardError, match="FORKYARD_API_KEY"):
        cls(base_url=BASE_URL)


@pytest.mark.parametrize("cls", [forkyard.Client, forkyard.AsyncClient])
@pytest.mark.parametrize("kwargs", [{"base_url": "gateway:8000"}, {"max_retries": -1}])
def test_bad_settings_are_refused(cls, kwargs):
    with pytest.raises(ValueError):
        cls(api_key="k", **{"base_url": BASE_URL, **kwargs})


@pytest.mark.parametrize("cls", [forkyard.Client, forkyard.AsyncClient])
async def test_default_base_url(cls, monkeypatch):
    monkeypatch.delenv("FORKYARD_URL", raising=False)
    client = cls(api_key="k")
    try:
        assert client.base_url == "http://127.0.0.1:8000"
        assert client.max_retries == forkyard.DEFAULT_MAX_RETRIES == 2
    finally:
        await _close(client)


async def test_requests_carry_auth_and_identify_the_sdk(twin):
    twin.respond(httpx.Response(200, json={"items": [], "next": None}))
    assert await twin.collect(twin.client.sandboxes.list()) == []
    request = twin.requests[0]
    assert request.headers["authorization"] == f"Bearer {twin.api_key}"
    assert request.headers["user-agent"] == f"forkyard-python/{forkyard.__version__}"
    assert str(request.url) == f"{BASE_URL}/v1/sandboxes"


async def test_default_headers_cannot_override_auth(make_twin):
    twin = make_twin("sync", default_headers={"X-Team": "rl", "Authorization": "Bearer other"})
    twin.respond(httpx.Response(200, json={"items": [], "next": None}))
    await twin.collect(twin.client.sandboxes.list())
    assert twin.requests[0].headers["x-team"] == "rl"
    assert twin.requests[0].headers["authorization"] == f"Bearer {twin.api_key}"


async def test_api_key_never_shows_in_repr_or_logs(twin, caplog):
    caplog.set_level(logging.DEBUG, logger="forkyard")
    twin.respond(
        twin.error(503, "unavailable", "Try again."),
        twin.error(404, "not_found", "No task 't1'."),
    )
    with pytest.raises(forkyard.NotFoundError) as info:
        await twin.call(twin.client.tasks.get, "t1")
    assert caplog.records, "expected the SDK to log the request and the retry"
    assert any(r.name.startswith("forkyard") and "Retrying" in r.getMessage() for r in caplog.records)
    for text in (repr(twin.client), caplog.text, str(info.value), repr(info.value)):
        assert twin.api_key not in text


async def test_with_options_shares_connections(twin):
    patient = twin.client.with_options(max_retries=0, timeout=5.0)
    assert type(patient) is type(twin.client)
    assert patient.max_retries == 0 and twin.client.max_retries == 2
    assert patient.timeout == httpx.Timeout(5.0)
    patient._sleep = twin.client._sleep
    twin.respond(twin.error(503, "unavailable", "Busy."))
    with pytest.raises(forkyard.InternalServerError):
        await twin.call(patient.tasks.get, "t1")
    assert len(twin.requests) == 1
    await twin.call(patient.close if twin.kind == "sync" else patient.aclose)
    assert not twin.http.is_closed, "a client must not close an httpx client it did not create"


def test_sync_client_closes_only_what_it_created():
    with forkyard.Client(base_url=BASE_URL, api_key="k") as client:
        own = client._http
    assert own.is_closed
    external = httpx.Client()
    try:
        with forkyard.Client(base_url=BASE_URL, api_key="k", http_client=external):
            pass
        assert not external.is_closed
    finally:
        external.close()


async def test_async_client_closes_only_what_it_created():
    async with forkyard.AsyncClient(base_url=BASE_URL, api_key="k") as client:
        own = client._http
    assert own.is_closed
    external = httpx.AsyncClient()
    try:
        async with forkyard.AsyncClient(base_url=BASE_URL, api_key="k", http_client=external):
            pass
        assert not external.is_closed
    finally:
        await external.aclose()


def test_public_surface_is_all():
    for name in forkyard.__all__:
        assert getattr(forkyard, name) is not None, name
    errors = [getattr(forkyard, n) for n in forkyard.__all__ if n.endswith("Error")]
    assert all(issubclass(e, forkyard.ForkyardError) for e in errors)
    assert issubclass(forkyard.APITimeoutError, forkyard.APIConnectionError)


async def _close(client):
    if isinstance(client, forkyard.AsyncClient):
        await client.aclose()
    else:
        client.close()
