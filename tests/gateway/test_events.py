"""Rollout wake-ups across gateways: a notify on one wakes the waiters of another through real Redis."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from gateway.app import create_app
from gateway.rollouts.events import RedisBridge, RolloutEvents, rollout_events
from tests.gateway.conftest import FakeRuntime, make_settings

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
async def two_gateways():
    """Two gateways' wake-ups, each bridged to the same Redis (as on two hosts)."""
    a, b = RolloutEvents(), RolloutEvents()
    bridges = [RedisBridge(a, REDIS_URL), RedisBridge(b, REDIS_URL)]
    for bridge in bridges:
        await bridge.start()
    try:
        yield a, b, bridges
    finally:
        for bridge in bridges:
            await bridge.aclose()
    assert a.bridge is None and b.bridge is None


async def test_a_notify_on_one_gateway_wakes_the_other(two_gateways):
    a, b, (bridge_a, bridge_b) = two_gateways
    rollout = f"ro_{uuid.uuid4().hex[:8]}"
    on_b = b.event(rollout)
    a.notify(rollout)
    assert await RolloutEvents.wait(on_b, 5.0)  # bounded: a lost message would fail, not hang
    assert bridge_b.received >= 1
    # A gateway does not wake itself twice through Redis (its own messages are skipped).
    on_a = a.event(rollout)
    a.notify(rollout)
    assert on_a.is_set()
    await asyncio.sleep(0.2)
    assert bridge_a.received == 0


async def test_redis_away_is_a_clear_startup_error():
    bridge = RedisBridge(RolloutEvents(), "redis://127.0.0.1:9/0")
    with pytest.raises(ConnectionError, match=r"Redis at redis://127.0.0.1:9/0 does not answer"):
        await bridge.start(timeout_s=2)
    await bridge.aclose()


async def test_the_app_bridges_its_wake_ups_when_given_redis(tmp_path):
    app = create_app(make_settings(tmp_path, redis_url=REDIS_URL), runtime=FakeRuntime())
    async with app.router.lifespan_context(app):
        assert rollout_events.bridge is not None
    assert rollout_events.bridge is None
