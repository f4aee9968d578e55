"""The database reporter: policy state read once per refresh for every episode, pushed by the policies API."""

from __future__ import annotations

import asyncio

from gateway.rollouts.reporting import DatabaseReporter, PolicyStates
from workers.protocol import EpisodeReporter


async def test_many_episodes_share_one_read_per_refresh(gateway):
    await gateway.client.post("/v1/policies/trainer-r/version", json={"version": 5})
    states = PolicyStates(gateway.app.state.sessionmaker, refresh_s=60.0)
    got = await asyncio.gather(*(states.get("trainer-r") for _ in range(200)))
    assert {(s.version, s.paused) for s in got} == {(5, False)}
    assert states.reads == 1  # 200 episodes' turns, one query


async def test_a_change_through_the_api_reaches_running_episodes_at_once(gateway):
    states: PolicyStates = gateway.app.state.policy_states
    reporter = DatabaseReporter(gateway.app.state.sessionmaker, node="n1", policy_name="trainer-p",
                                policies=states, on_store_failure=_never)
    assert isinstance(reporter, EpisodeReporter)
    assert (await reporter.policy_state()).version == 0
    await gateway.client.post("/v1/policies/trainer-p/version", json={"version": 7})
    assert (await reporter.policy_state()).version == 7  # pushed: no wait for the refresh

    await gateway.client.post("/v1/policies/trainer-p/pause")
    waiter = asyncio.create_task(reporter.wait_until_unpaused())
    await asyncio.sleep(0.6)  # past two refresh intervals: still paused
    assert not waiter.done()
    await gateway.client.post("/v1/policies/trainer-p/resume")
    await asyncio.wait_for(waiter, 2)


async def _never(episode_id: str, error: str) -> None:
    raise AssertionError(f"{episode_id}: {error}")
