"""The distributed mode's database side: placing episodes on nodes, and the lease that fences each attempt."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import update

from gateway.db import utcnow
from gateway.episodes import service as episodes_service
from gateway.episodes.models import Episode
from tests.gateway.rollout_helpers import (
    RecordingDispatcher,
    create_rollout,
    episodes_of,
    import_tasks,
    recording_dispatcher,
)


@pytest.fixture(autouse=True)
def dispatcher(gateway) -> Iterator[RecordingDispatcher]:
    """Keep the app's dispatcher off these rollouts: the tests place and claim episodes themselves."""
    with recording_dispatcher(gateway.app) as recorder:
        yield recorder


def an_hour_ago():
    return utcnow() - timedelta(hours=1)


async def test_placement_fills_the_least_loaded_nodes_within_the_rollouts_concurrency(gateway):
    sessionmaker = gateway.app.state.sessionmaker
    task_ids = await import_tasks(gateway.client, ["a", "b"])
    rollout = await create_rollout(gateway.client, task_ids, group_size=4, concurrency=5)
    free = {"n1": 2, "n2": 4}
    async with sessionmaker() as db:
        placed = await episodes_service.dispatch_queued(db_session=db, rollout_id=rollout["id"], free=free,
                                                        sent_after=an_hour_ago())
    assert len(placed) == 5, "no more than the rollout's concurrency at once"
    by_node = {n: sum(1 for _, node in placed if node == n) for n in ("n1", "n2")}
    assert by_node == {"n1": 2, "n2": 3} and free == {"n1": 0, "n2": 1}
    async with sessionmaker() as db:
        again = await episodes_service.dispatch_queued(db_session=db, rollout_id=rollout["id"], free={"n3": 10},
                                                       sent_after=an_hour_ago())
        assert again == [], "what was sent holds the rollout's slots until it runs or is lost"
        busy = await episodes_service.in_flight_by_node(db_session=db, sent_after=an_hour_ago())
    assert busy == {"n1": 2, "n2": 3}

    # A node found down gives its unclaimed episodes back; so does a job sent too long ago (lost with Redis).
    async with sessionmaker() as db:
        back = await episodes_service.dispatch_queued(db_session=db, rollout_id=rollout["id"], free={"n3": 10},
                                                      sent_after=an_hour_ago(), down=["n1"])
    assert len(back) == 2 and {node for _, node in back} == {"n3"}
    async with sessionmaker() as db:
        lost = await episodes_service.dispatch_queued(db_session=db, rollout_id=rollout["id"], free={"n4": 10},
                                                      sent_after=utcnow() + timedelta(seconds=1))
    assert len(lost) == 5 and {node for _, node in lost} == {"n4"}


async def test_a_duplicate_claim_fails_and_a_lost_lease_refuses_every_write(gateway):
    sessionmaker = gateway.app.state.sessionmaker
    task_ids = await import_tasks(gateway.client, ["a"])
    rollout = await create_rollout(gateway.client, task_ids, group_size=1)
    (episode,) = await episodes_of(sessionmaker, rollout["id"])
    async with sessionmaker() as db:
        assert await episodes_service.mark_episode_running(db_session=db, episode_id=episode.id, node="n1",
                                                           lease="lease_one")
        assert not await episodes_service.mark_episode_running(db_session=db, episode_id=episode.id, node="n2",
                                                               lease="lease_two"), "a duplicate never runs"
    step = {"index": 0, "text": "hi", "observation": "ok"}
    async with sessionmaker() as db:
        with pytest.raises(episodes_service.LeaseLostError, match=episode.id):
            await episodes_service.record_step(db_session=db, episode_id=episode.id, step=step, lease="lease_two")
        assert await episodes_service.record_step(db_session=db, episode_id=episode.id, step=step,
                                                  lease="lease_one") is not None
    # The node running it was found down and another attempt took over: the old runner's writes bounce.
    async with sessionmaker() as db:
        await db.execute(update(Episode).where(Episode.id == episode.id).values(lease="lease_three"))
        await db.commit()
    async with sessionmaker() as db:
        with pytest.raises(episodes_service.LeaseLostError):
            await episodes_service.finish_episode(db_session=db, episode_id=episode.id, status="completed",
                                                  termination="submitted", reward=1.0, lease="lease_one")
        with pytest.raises(episodes_service.LeaseLostError):
            await episodes_service.spawn_branches(db_session=db, parent_episode_id=episode.id, turn=1, n=2,
                                                  lease="lease_one")
        done = await episodes_service.finish_episode(db_session=db, episode_id=episode.id, status="completed",
                                                     termination="submitted", reward=1.0, lease="lease_three")
    assert done.status.value == "completed" and done.reward == 1.0 and done.num_turns == 1


async def test_each_node_reads_the_demand_queued_for_it_by_task(gateway):
    """A node's warm pool sizes from the episodes sent to it plus its share of those not sent yet."""
    from gateway.nodes import service as nodes_service
    from gateway.nodes.heartbeat import Heartbeat

    sessionmaker = gateway.app.state.sessionmaker
    task_ids = await import_tasks(gateway.client, ["a", "b"])
    rollout = await create_rollout(gateway.client, task_ids, group_size=4, concurrency=3)
    async with sessionmaker() as db:
        for name in ("n1", "n2"):
            await nodes_service.heartbeat(db_session=db, name=name, backend="local", capacity=4, load={},
                                          heartbeat_s=60)
        placed = await episodes_service.dispatch_queued(db_session=db, rollout_id=rollout["id"], free={"n1": 3},
                                                        sent_after=an_hour_ago())
        up = sum(1 for n in await nodes_service.list_nodes(db_session=db) if n.state == "up")
    assert len(placed) == 3 and up >= 3  # n1, n2 and the gateway's own node
    # Sent to n1: three of a's four samples. Not sent yet: a's fourth and b's four, split over the nodes up.
    expected_n1 = {"a": 3 + -(-1 // up), "b": -(-4 // up)}
    seen: list[dict[str, int]] = []
    beat = Heartbeat(sessionmaker, node="n1", backend="local", capacity=4, load=dict, interval_s=60,
                     demand=seen.append)
    assert await beat.read_demand() == expected_n1 and seen == [expected_n1]
    async with sessionmaker() as db:
        assert await nodes_service.queued_demand(db_session=db, node="n2") == {"a": -(-1 // up), "b": -(-4 // up)}

    assert (await gateway.client.post(f"/v1/rollouts/{rollout['id']}/cancel")).status_code == 200
    assert await beat.read_demand() == {}, "a cancelled rollout wants nothing warmed"
