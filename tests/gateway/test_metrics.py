"""``GET /metrics``: open like /healthz, Prometheus text, the runtime's counters and the setup cache."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from gateway.app import create_app
from sandboxes.base import SandboxSpec
from tests.gateway.conftest import FakeRuntime, Gateway, asgi_client, make_settings
from workers.setup_cache import SetupCache, SetupCacheKey

FAMILIES = {
    "forkyard_env_resets_total": "counter",
    "forkyard_env_steps_total": "counter",
    "forkyard_env_setup_runs_total": "counter",
    "forkyard_env_setup_uncacheable_total": "counter",
    "forkyard_setup_cache_hits_total": "counter",
    "forkyard_setup_cache_misses_total": "counter",
    "forkyard_setup_cache_evictions_total": "counter",
    "forkyard_setup_cache_entries": "gauge",
    "forkyard_setup_cache_bytes": "gauge",
    "forkyard_pool_hits_total": "counter",
    "forkyard_pool_misses_total": "counter",
    "forkyard_pool_fills_total": "counter",
    "forkyard_pool_fill_failures_total": "counter",
    "forkyard_pool_breaker_trips_total": "counter",
    "forkyard_pool_claim_seconds_total": "counter",
    "forkyard_pool_fill_seconds_total": "counter",
    "forkyard_pool_idle": "gauge",
    "forkyard_pool_keys": "gauge",
}


def parse(text: str) -> dict[str, float]:
    """Parse Prometheus text into {name: value}, checking every sample has its HELP and TYPE lines."""
    samples: dict[str, float] = {}
    helps: set[str] = set()
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helps.add(line.split(" ")[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        else:
            name, value = line.split(" ")
            assert name in helps and name in types, f"{name} has no HELP/TYPE line"
            samples[name] = float(value)
    assert types == FAMILIES
    return samples


async def test_metrics_are_open_and_in_prometheus_text_format(gateway: Gateway) -> None:
    async with asgi_client(gateway.app, api_key=None) as anonymous:
        response = await anonymous.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert response.text.endswith("\n")
    assert parse(response.text) == dict.fromkeys(FAMILIES, 0)


async def test_metrics_count_resets_and_steps(gateway: Gateway) -> None:
    task = await gateway.import_task()
    session = await gateway.open_session(task["id"])
    for command in ("echo one", "echo two"):
        response = await gateway.client.post(f"/v1/sessions/{session['id']}/step",
                                             json={"action": {"tool": "bash", "arguments": {"command": command}}})
        assert response.status_code == 200, response.text
    samples = parse((await gateway.client.get("/metrics")).text)
    assert samples["forkyard_env_resets_total"] == 1
    assert samples["forkyard_env_steps_total"] == 2
    # The session's environment version keys the setup cache: the default environment is terminal@1.
    assert gateway.runtime.sessions[session["id"]]["env_version"] == "terminal@1"


@pytest.mark.local
async def test_metrics_export_the_setup_cache(tmp_path: Path) -> None:
    from sandboxes.backends import create_backend
    from tests.conftest import base_image

    root = Path(tempfile.mkdtemp(prefix="forkyard-metrics-"))
    backend = create_backend("local", node=f"test-metrics-{uuid.uuid4().hex[:8]}", root_dir=root)
    cache = SetupCache(backend, tmp_path / "setup-cache")
    runtime = FakeRuntime()
    runtime.setup_cache = cache
    try:
        image = await base_image(backend)
        keys = [SetupCacheKey("terminal@1", name * 64, "sha256:0") for name in "abc"]

        async def fill(key: SetupCacheKey) -> None:
            async with cache.claim(key) as entry:
                assert entry is None
                sandbox = await backend.create(SandboxSpec(image=image))
                try:
                    await backend.write_file(sandbox.id, "/opt/setup.bin", b"x" * 65536)
                    await cache.put(key, await backend.snapshot(sandbox.id), {"workdir": "/"})
                finally:
                    await backend.destroy(sandbox.id)

        await fill(keys[0])
        await fill(keys[1])
        async with cache.claim(keys[0]) as entry:  # a hit: keys[1] is now the least recently used
            assert entry is not None
        cache.max_bytes = 2 * max(e.bytes for e in cache.entries())
        await fill(keys[2])
        assert [e.key for e in cache.entries()] == [keys[0], keys[2]]

        app = create_app(make_settings(tmp_path), runtime=runtime)
        async with app.router.lifespan_context(app), asgi_client(app, api_key=None) as client:
            samples = parse((await client.get("/metrics")).text)
        assert samples["forkyard_setup_cache_hits_total"] == 1
        assert samples["forkyard_setup_cache_misses_total"] == 3
        assert samples["forkyard_setup_cache_evictions_total"] == 1
        assert samples["forkyard_setup_cache_entries"] == 2
        assert samples["forkyard_setup_cache_bytes"] == sum(e.bytes for e in cache.entries()) >= 2 * 65536
    finally:
        try:
            await cache.clear()
            assert await backend.list_snapshots() == []
        finally:
            await backend.aclose()
            shutil.rmtree(root, ignore_errors=True)


async def test_metrics_export_the_warm_pool(tmp_path: Path) -> None:
    from sandboxes.base import SandboxSpec as Spec
    from tests.workers.test_pool import FakeBackend, settle
    from workers.pool import PoolPolicy, WarmPool

    runtime = FakeRuntime()
    runtime.pool = WarmPool(FakeBackend(), PoolPolicy(max_idle=4))  # type: ignore[arg-type]
    await runtime.pool.create(Spec(image="img"))  # a miss: the key now wants ceil(1.2) = 2
    await settle(runtime.pool, idle=2)
    await runtime.pool.create(Spec(image="img"))  # a hit
    app = create_app(make_settings(tmp_path), runtime=runtime)
    async with app.router.lifespan_context(app), asgi_client(app, api_key=None) as client:
        samples = parse((await client.get("/metrics")).text)
    await runtime.pool.aclose()
    assert samples["forkyard_pool_hits_total"] == 1 and samples["forkyard_pool_misses_total"] == 1
    assert samples["forkyard_pool_fills_total"] == 2 and samples["forkyard_pool_idle"] == 1
    assert samples["forkyard_pool_keys"] == 1 and samples["forkyard_pool_fill_seconds_total"] > 0
