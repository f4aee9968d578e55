"""The durable delivery stream: pull/ack, leases and redelivery, reconnects, group modes, dead letters,
staleness at finish and at delivery, restarts, SSE on a real uvicorn server, and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

import forkyard
from gateway.app import create_app
from gateway.episodes import service as episodes_service
from gateway.rollouts import delivery
from tests.fleet import postgres_database
from tests.gateway.conftest import API_KEY, FakeRuntime, asgi_client, assert_error, make_settings
from tests.gateway.rollout_helpers import (
    RecordingDispatcher,
    create_rollout,
    episodes_of,
    import_tasks,
    play_episode,
    recording_dispatcher,
)
from tests.live import free_port
from workers.protocol import EpisodeOutcome
from workers.runner import failure_info


@pytest.fixture(autouse=True)
def dispatcher(request: pytest.FixtureRequest) -> Iterator[RecordingDispatcher | None]:
    """Keep the app's dispatcher off these rollouts: the tests play the runner themselves."""
    if "gateway" not in request.fixturenames:
        yield None
        return
    with recording_dispatcher(request.getfixturevalue("gateway").app) as recorder:
        yield recorder


async def pull(client: httpx.AsyncClient, rollout_id: str, consumer: str = "trainer", **fields: Any) -> dict:
    response = await client.post(f"/v1/rollouts/{rollout_id}/pull", json={"consumer": consumer, **fields})
    assert response.status_code == 200, response.text
    return response.json()


async def ack(client: httpx.AsyncClient, rollout_id: str, episode_ids: list[str], consumer: str = "trainer") -> int:
    response = await client.post(f"/v1/rollouts/{rollout_id}/ack",
                                 json={"consumer": consumer, "episode_ids": episode_ids})
    assert response.status_code == 200, response.text
    return response.json()["acked"]


def ids_of(batch: dict) -> list[str]:
    return [e["episode_id"] for e in batch["episodes"]]


async def test_pull_and_ack_deliver_each_group_once_in_seq_order(gateway):
    client, sessionmaker = gateway.client, gateway.app.state.sessionmaker
    task_ids = await import_tasks(client, ["a", "b"])
    rollout = await create_rollout(client, task_ids, group_size=2)
    rid = rollout["id"]
    e = await episodes_of(sessionmaker, rid)

    empty = await pull(client, rid)
    assert empty == {"episodes": [], "cursor": 0, "done": False}
    await play_episode(sessionmaker, e[2].id, reward=0.0)
    assert (await pull(client, rid))["episodes"] == []  # group b is not complete yet
    await play_episode(sessionmaker, e[3].id, reward=1.0)
    await play_episode(sessionmaker, e[0].id, reward=0.5)
    await play_episode(sessionmaker, e[1].id, reward=0.5)

    first = await pull(client, rid, max_episodes=3)
    assert ids_of(first) == [e[2].id, e[3].id, e[0].id]  # group b released first, then group a
    assert [x["seq"] for x in first["episodes"]] == [1, 2, 3] and first["cursor"] == 3
    assert first["done"] is False
    item = first["episodes"][0]
    assert item["group_id"] == e[2].group_id and item["rollout_id"] == rid and item["delivery_count"] == 1
    assert item["task_id"] == task_ids[1] and item["sample_index"] == 0 and item["attempt"] == 1
    assert sum(item["loss_mask"]) == len(item["logprobs"]) and item["reward"] == 0.0
    training = (await client.get(f"/v1/episodes/{e[2].id}/training")).json()
    assert {k: item[k] for k in training} == training

    second = await pull(client, rid, max_episodes=3)
    assert ids_of(second) == [e[1].id] and second["cursor"] == 4 and second["done"] is False
    assert await ack(client, rid, ids_of(first) + ids_of(second) + ["ep_unknown"]) == 4
    assert await ack(client, rid, ids_of(first)) == 0  # acking again settles nothing
    final = await pull(client, rid)
    assert final == {"episodes": [], "cursor": 4, "done": True}

    # Another consumer group reads the whole stream on its own.
    other = await pull(client, rid, consumer="evaluator", max_episodes=10)
    assert [x["seq"] for x in other["episodes"]] == [1, 2, 3, 4]
    body = (await client.get(f"/v1/rollouts/{rid}")).json()
    assert body["progress"] == {"total": 4, "finished": 4, "streamed": 4, "delivered": 4}


async def test_pull_and_ack_validation(gateway):
    client = gateway.client
    task_ids = await import_tasks(client, ["a"])
    rid = (await create_rollout(client, task_ids, group_size=1))["id"]
    assert_error(await client.post(f"/v1/rollouts/{rid}/pull", json={"consumer": "no spaces"}), 422,
                 "validation_error")
    assert_error(await client.post(f"/v1/rollouts/{rid}/pull", json={"consumer": "c", "wait_s": 31}), 422,
                 "validation_error")
    assert_error(await client.post(f"/v1/rollouts/{rid}/ack", json={"consumer": "c", "episode_ids": []}), 422,
                 "validation_error")
    error = assert_error(await client.post("/v1/rollouts/ro_missing/pull", json={"consumer": "c"}), 404, "not_found")
    assert "ro_missing" in error["message"]
    assert_error(await client.post("/v1/rollouts/ro_missing/ack", json={"consumer": "c", "episode_ids": ["x"]}),
                 404, "not_found")
    assert_error(await client.get("/v1/rollouts/ro_missing/stream", params={"consumer": "c"}), 404, "not_found")
    assert_error(await client.get(f"/v1/rollouts/{rid}/stream", params={"consumer": "c"},
                                  headers={"Last-Event-ID": "abc"}), 400, "bad_request")
    assert_error(await client.get("/v1/rollouts/ro_missing/dead_letters"), 404, "not_found")


async def test_unacked_episodes_are_redelivered_after_the_visibility_timeout(gateway):
    client, sessionmaker = gateway.client, gateway.app.state.sessionmaker
    task_ids = await import_tasks(client, ["a", "b"])
    rid = (await create_rollout(client, task_ids, group_size=1))["id"]
    a, b = await episodes_of(sessionmaker, rid)
    await play_episode(sessionmaker, a.id)
    await play_episode(sessionmaker, b.id)

    held = await pull(client, rid, max_episodes=1, visibility_timeout_s=60)
    assert ids_of(held) == [a.id]
    # A live lease is not redelivered: the next pull moves on.
    nxt = await pull(client, rid, max_episodes=5, visibility_timeout_s=0)
    assert ids_of(nxt) == [b.id]
    # b's lease expired at once (timeout 0): it comes back, counted, before anything new.
    again = await pull(client, rid, max_episodes=5, visibility_timeout_s=0)
    assert ids_of(again) == [b.id] and again["episodes"][0]["delivery_count"] == 2
    assert await ack(client, rid, [b.id]) == 1
    assert (await pull(client, rid, max_episodes=5))["episodes"] == []
    # a is still leased for a minute: not done, nothing to deliver.
    assert (await pull(client, rid))["done"] is False
    # Asking for every pending entry brings a back now.
    forced = await pull(client, rid, redeliver=True)
    assert ids_of(forced) == [a.id] and forced["episodes"][0]["delivery_count"] == 2
    assert await ack(client, rid, [a.id]) == 1
    assert (await pull(client, rid, redeliver=True)) == {"episodes": [], "cursor": 2, "done": True}


async def test_reconnect_with_cursor_redelivers_what_was_lost_without_acked_duplicates(gateway):
    client, sessionmaker = gateway.client, gateway.app.state.sessionmaker
    task_ids = await import_tasks(client, [f"t{i}" for i in range(5)])
    rid = (await create_rollout(client, task_ids, group_size=1))["id"]
    episodes = await episodes_of(sessionmaker, rid)
    for i, episode in enumerate(episodes):
        await play_episode(sessionmaker, episode.id, seed=i)

    batch = await pull(client, rid, max_episodes=4, visibility_timeout_s=600)
    assert [x["seq"] for x in batch["episodes"]] == [1, 2, 3, 4]
    # The client processed seq 1 and 2, acked seq 1, then crashed; seq 3 and 4 never reached it.
    assert await ack(client, rid, [batch["episodes"][0]["episode_id"]]) == 1
    resumed = await pull(client, rid, max_episodes=10, cursor=2, visibility_timeout_s=600)
    got = [(x["seq"], x["delivery_count"]) for x in resumed["episodes"]]
    assert got == [(3, 2), (4, 2), (5, 1)]  # lost entries first, then the new one; seq 2 keeps its lease
    assert await ack(client, rid, [x["episode_id"] for x in resumed["episodes"]]) == 3
    everything = await pull(client, rid, cursor=0, visibility_timeout_s=600)
    assert ids_of(everything) == [episodes[1].id]  # only the unacked seq 2, never an acked one
    assert await ack(client, rid, ids_of(everything)) == 1
    assert (await pull(client, rid, cursor=0))["done"] is True


async def test_complete_mode_waits_for_every_sample_and_dead_letters_failures(gateway):
    client, sessionmaker = gateway.client, gateway.app.state.sessionmaker
    task_ids = await import_tasks(client, ["a"])
    rid = (await create_rollout(client, task_ids, group_size=3))["id"]
    e = await episodes_of(sessionmaker, rid)
    await play_episode(sessionmaker, e[0].id)
    await play_episode(sessionmaker, e[1].id, status="truncated", termination="timeout", reward=0.0)
    assert (await pull(client, rid))["episodes"] == []
    await play_episode(sessionmaker, e[2].id, status="failed", termination="error", reward=None,
                       error="policy server http://10.0.0.1:8000 answered HTTP 500")
    batch = await pull(client, rid)
    assert ids_of(batch) == [e[0].id, e[1].id]  # the failed sample counts as finished, not as usable
    assert {x["group_id"] for x in batch["episodes"]} == {e[0].group_id}
    letters = (await client.get(f"/v1/rollouts/{rid}/dead_letters")).json()
    assert [(x["id"], x["status"]) for x in letters["items"]] == [(e[2].id, "failed")]
    assert "HTTP 500" in letters["items"][0]["reason"] and letters["next"] is None


async def test_early_mode_streams_min_group_size_and_stores_the_rest(gateway):
    client, sessionmaker = gateway.client, gateway.app.state.sessionmaker
    task_ids = await import_tasks(client, ["a", "b"])
    rid = (await create_rollout(client, task_ids, group_size=4,
                                group_mode={"mode": "early", "min_group_size": 2}))["id"]
    e = await episodes_of(sessionmaker, rid)
    group_a, group_b = e[:4], e[4:]
    await play_episode(sessionmaker, group_a[3].id)
    assert (await pull(client, rid))["episodes"] == []
    await play_episode(sessionmaker, group_a[1].id, status="failed", termination="error", reward=None, error="x")
    assert (await pull(client, rid))["episodes"] == []
    await play_episode(sessionmaker, group_a[0].id)
    batch = await pull(client, rid)
    assert ids_of(batch) == [group_a[0].id, group_a[3].id]  # released at 2 usable, in sample order
    await play_episode(sessionmaker, group_a[2].id)  # after the release: stored, not streamed
    stored = (await client.get(f"/v1/episodes/{group_a[2].id}")).json()
    assert stored["status"] == "completed" and stored["seq"] is None and stored["dead_letter_reason"] is None

    # Group b never reaches min_group_size: it is released with what it has once every sample ended.
    await play_episode(sessionmaker, group_b[0].id)
    for episode in group_b[1:]:
        assert (await pull(client, rid))["episodes"] == []
        await play_episode(sessionmaker, episode.id, status="failed", termination="error", reward=None, error="y")
    last = await pull(client, rid)
    assert ids_of(last) == [group_b[0].id]
    assert await ack(client, rid, ids_of(batch) + ids_of(last)) == 3
    assert (await pull(client, rid))["done"] is True
    body = (await client.get(f"/v1/rollouts/{rid}")).json()
    assert body["status"] == "completed" and body["progress"]["streamed"] == 3


VERIFIER_ERROR = {**failure_info(EpisodeOutcome.VERIFIER_ERROR), "verifier_error": "the verifier timed out after 30s"}


async def test_a_verifier_error_is_retried_never_trained_on_and_delivered_masked_on_request(gateway):
    client, sessionmaker = gateway.client, gateway.app.state.sessionmaker
    task_ids = await import_tasks(client, ["a"])
    rid = (await create_rollout(client, task_ids, group_size=1, max_attempts=2))["id"]
    (first,) = await episodes_of(sessionmaker, rid)
    await play_episode(sessionmaker, first.id, status="failed", termination="submitted", reward=None,
                       error="verifier_error: the verifier timed out after 30s", info=VERIFIER_ERROR, versions=(0, 0))
    rows = await episodes_of(sessionmaker, rid)
    assert [(r.attempt, r.status.value, r.outcome and r.outcome.value) for r in rows] == [
        (1, "failed", "verifier_error"), (2, "queued", None)]  # a fresh attempt, never a reward of 0
    assert rows[0].dead_letter_reason is None and rows[1].info == {"previous": first.id}
    assert (await pull(client, rid))["episodes"] == []
    assert (await client.get(f"/v1/rollouts/{rid}")).json()["status"] == "running"

    await play_episode(sessionmaker, rows[1].id, status="failed", termination="timeout", reward=None,
                       error="verifier_error: no reward file", info=VERIFIER_ERROR, seed=1)
    assert len(await episodes_of(sessionmaker, rid)) == 2  # max_attempts reached
    trainer = await pull(client, rid)
    assert trainer == {"episodes": [], "cursor": 2, "done": True}, "a failure is never training data"

    masked = await pull(client, rid, consumer="inspector", include=["failed"], max_episodes=10)
    assert ids_of(masked) == [first.id, rows[1].id] and masked["done"] is False
    for entry, error in zip(masked["episodes"], ("timed out after 30s", "no reward file"), strict=True):
        assert entry["outcome"] == "verifier_error" and error in entry["error"] and entry["status"] == "failed"
        assert entry["reward"] is None and entry["logprobs"] == []
        assert entry["input_ids"] and entry["loss_mask"] == [0] * len(entry["input_ids"])
        assert entry["group_partial"] is True and "1 of 1 samples failed for good: verifier_error" in entry[
            "group_reason"]
    training = (await client.get(f"/v1/episodes/{first.id}/training")).json()
    assert {k: masked["episodes"][0][k] for k in training} == training
    assert await ack(client, rid, ids_of(masked), consumer="inspector") == 2
    assert (await pull(client, rid, consumer="inspector", include=["failed"]))["done"] is True

    body = (await client.get(f"/v1/rollouts/{rid}")).json()
    assert body["status"] == "completed" and body["partial_groups"] == 1
    assert body["failures"] == {"verifier_error": 2} and body["counts"] == {"failed": 2}
    assert body["progress"] == {"total": 1, "finished": 1, "streamed": 0, "delivered": 0}
    (letter,) = (await client.get(f"/v1/rollouts/{rid}/dead_letters")).json()["items"]
    assert letter["id"] == rows[1].id and letter["outcome"] == "verifier_error"
    assert letter["reason"] == "verifier_error: no reward file; no attempts left (max_attempts 2)"
    assert_error(await client.post(f"/v1/rollouts/{rid}/pull", json={"consumer": "c", "include": ["stale"]}), 422,
                 "validation_error")


async def test_an_infra_failure_is_retried_and_a_short_group_arrives_flagged_partial(gateway):
    client, sessionmaker = gateway.client, gateway.app.state.sessionmaker
    task_ids = await import_tasks(client, ["a", "b"])
    rid = (await create_rollout(client, task_ids, group_size=2, max_attempts=2))["id"]
    a0, a1, b0, b1 = await episodes_of(sessionmaker, rid)
    await play_episode(sessionmaker, a0.id)
    # A sandbox that died under the episode (not a dead node): the runner marks it infra.
    await play_episode(sessionmaker, a1.id, status="failed", termination="error", reward=None,
                       error="SandboxBackendError: the engine stopped answering", info=failure_info(EpisodeOutcome.INFRA))
    (retry,) = [r for r in await episodes_of(sessionmaker, rid) if r.attempt == 2]
    assert (retry.group_id, retry.sample_index, retry.status.value) == (a1.group_id, 1, "queued")
    # Group b: the retry succeeds, and the group is delivered whole.
    await play_episode(sessionmaker, b0.id)
    await play_episode(sessionmaker, b1.id, status="failed", termination="error", reward=None,
                       error="ImageBuildError: RUN exited 7", info={"infra": True})  # a path with no typed outcome
    (b_retry,) = [r for r in await episodes_of(sessionmaker, rid) if r.attempt == 2 and r.group_id == b1.group_id]
    await play_episode(sessionmaker, b_retry.id, reward=0.0)
    whole = await pull(client, rid, max_episodes=10)
    assert ids_of(whole) == [b0.id, b_retry.id] and whole["episodes"][1]["reward"] == 0.0
    assert {(x["group_partial"], x["group_reason"], x["outcome"]) for x in whole["episodes"]} == {
        (False, None, "reward")}

    await play_episode(sessionmaker, retry.id, status="failed", termination="error", reward=None,
                       error="SandboxBackendError: the engine stopped answering again",
                       info=failure_info(EpisodeOutcome.INFRA))
    short = await pull(client, rid, max_episodes=10)
    assert ids_of(short) == [a0.id], "the failed sample is never a reward"
    (entry,) = short["episodes"]
    assert entry["group_partial"] is True and entry["group_reason"] == (
        "1 of 2 samples failed for good: infra: SandboxBackendError: the engine stopped answering again")
    body = (await client.get(f"/v1/rollouts/{rid}")).json()
    assert body["status"] == "completed" and body["partial_groups"] == 1
    assert body["failures"] == {"infra": 3} and body["counts"] == {"completed": 3, "failed": 3}
    detail = (await client.get(f"/v1/episodes/{retry.id}")).json()
    assert detail["outcome"] == "infra" and "no attempts left" in detail["dead_letter_reason"]
    listed = (await client.get("/v1/episodes", params={"rollout_id": rid})).json()["items"]
    assert sorted((x["outcome"], x["attempt"]) for x in listed) == [
        ("infra", 1), ("infra", 1), ("infra", 2), ("reward", 1), ("reward", 1), ("reward", 2)]


async def test_group_spare_delivers_the_first_group_size_usable_samples(gateway):
    client, sessionmaker = gateway.client, gateway.app.state.sessionmaker
    task_ids = await import_tasks(client, ["a", "b", "c"])
    created = await create_rollout(client, task_ids, group_size=2, group_spare=1, max_attempts=1)
    rid = created["id"]
    assert created["group_spare"] == 1 and created["progress"]["total"] == 9
    rows = await episodes_of(sessionmaker, rid)
    a, b, c = rows[:3], rows[3:6], rows[6:]
    assert {len({e.group_id for e in g}) for g in (a, b, c)} == {1}  # group_size + group_spare samples per group

    # Group a: a sample fails for good, the spare covers it: whole, not partial.
    await play_episode(sessionmaker, a[0].id)
    await play_episode(sessionmaker, a[1].id, status="failed", termination="error", reward=None,
                       error="SandboxBackendError: gone", info=failure_info(EpisodeOutcome.INFRA))
    await play_episode(sessionmaker, a[2].id, reward=0.0)
    # Group b: the first two to finish win; the one still running is kept, not streamed.
    async with sessionmaker() as db:
        assert await episodes_service.mark_episode_running(db_session=db, episode_id=b[0].id, node="test-node")
    await play_episode(sessionmaker, b[2].id)
    await play_episode(sessionmaker, b[1].id)
    # Group c: two usable samples; the queued spare is cancelled, never run.
    await play_episode(sessionmaker, c[0].id)
    await play_episode(sessionmaker, c[1].id)
    async with sessionmaker() as db:
        assert await episodes_service.mark_episode_running(db_session=db, episode_id=c[2].id) is False
    batch = await pull(client, rid, max_episodes=10)
    assert ids_of(batch) == [a[0].id, a[2].id, b[1].id, b[2].id, c[0].id, c[1].id]
    assert not any(x["group_partial"] for x in batch["episodes"])
    async with sessionmaker() as db:  # the sample still running when its group was released ends
        await episodes_service.finish_episode(db_session=db, episode_id=b[0].id, status="completed",
                                              termination="submitted", reward=1.0)
    late = (await client.get(f"/v1/episodes/{b[0].id}")).json()
    assert late["status"] == "completed" and late["seq"] is None and late["dead_letter_reason"] is None
    spare = (await client.get(f"/v1/episodes/{c[2].id}")).json()
    assert (spare["status"], spare["termination"], spare["outcome"], spare["num_turns"]) == (
        "failed", "cancelled", None, 0)
    assert "already has 2 usable samples" in spare["dead_letter_reason"]
    assert ids_of(await pull(client, rid, max_episodes=10)) == []
    body = (await client.get(f"/v1/rollouts/{rid}")).json()
    assert body["status"] == "completed" and body["partial_groups"] == 0 and body["failures"] == {"infra": 1}
    assert body["counts"] == {"completed": 7, "failed": 2} and body["progress"]["streamed"] == 6
    assert_error(await client.post("/v1/rollouts", json={
        "tasks": task_ids, "group_size": 2, "group_spare": 1, "policy": {"name": "p", "api": "scripted"},
        "branching": {"at_turns": [1], "fanout": 2}}), 422, "validation_error")


async def test_stale_at_finish_reruns_until_attempts_run_out(gateway):
    client, sessionmaker = gateway.client, gateway.app.state.sessionmaker
    task_ids = await import_tasks(client, ["a"])
    rid = (await create_rollout(client, task_ids, group_size=2, max_staleness=1, staleness_action="rerun",
                                max_attempts=2, policy={"name": "pol-stale", "api": "scripted"}))["id"]
    assert (await client.post("/v1/policies/pol-stale/version", json={"version": 5})).status_code == 200
    e = await episodes_of(sessionmaker, rid)
    fresh, _ = await play_episode(sessionmaker, e[0].id, versions=(4, 5))
    assert fresh.status.value == "completed"
    stale, _ = await play_episode(sessionmaker, e[1].id, versions=(3, 5))  # oldest turn 2 versions behind
    assert stale.status.value == "stale" and stale.termination.value == "stale"
    assert stale.info["stale"]["oldest_version"] == 3 and stale.info["stale"]["termination"] == "submitted"
    rows = await episodes_of(sessionmaker, rid)
    rerun = next(r for r in rows if r.attempt == 2)
    assert (rerun.group_id, rerun.sample_index, rerun.status.value) == (e[1].group_id, 1, "queued")
    assert (await pull(client, rid))["episodes"] == []  # the group waits for the rerun
    assert (await client.get(f"/v1/rollouts/{rid}")).json()["status"] == "running"

    # The rerun is stale again (explicit current_version) and no attempt is left: dead-lettered.
    again, _ = await play_episode(sessionmaker, rerun.id, versions=(3,), current_version=7)
    assert again.status.value == "stale" and "no attempts left" in again.dead_letter_reason
    batch = await pull(client, rid)
    assert ids_of(batch) == [e[0].id]
    letters = (await client.get(f"/v1/rollouts/{rid}/dead_letters")).json()["items"]
    assert [x["id"] for x in letters] == [rerun.id] and "stale" in letters[0]["reason"]
    body = (await client.get(f"/v1/rollouts/{rid}")).json()
    assert body["status"] == "completed" and body["counts"] == {"completed": 1, "stale": 2}


async def test_stale_at_finish_dead_letters_when_asked(gateway):
    client, sessionmaker = gateway.client, gateway.app.state.sessionmaker
    task_ids = await import_tasks(client, ["a"])
    rid = (await create_rollout(client, task_ids, group_size=2, max_staleness=0,
                                policy={"name": "pol-dl", "api": "scripted"}))["id"]
    e = await episodes_of(sessionmaker, rid)
    await play_episode(sessionmaker, e[0].id, versions=(2,), current_version=2)
    dead, _ = await play_episode(sessionmaker, e[1].id, versions=(1, 2), current_version=2)
    assert dead.status.value == "stale" and dead.dead_letter_reason.startswith("stale")
    assert len(await episodes_of(sessionmaker, rid)) == 2  # no rerun
    assert ids_of(await pull(client, rid)) == [e[0].id]


async def test_staleness_is_checked_again_at_delivery(gateway, dispatcher):
    client, sessionmaker = gateway.client, gateway.app.state.sessionmaker
    task_ids = await import_tasks(client, ["a", "b"])
    rid = (await create_rollout(client, task_ids, group_size=1, max_staleness=1, staleness_action="rerun",
                                policy={"name": "pol-late", "api": "scripted"}))["id"]
    a, b = await episodes_of(sessionmaker, rid)
    await play_episode(sessionmaker, a.id, versions=(0,))
    await play_episode(sessionmaker, b.id, versions=(0,))
    fast = await pull(client, rid, consumer="fast")
    assert ids_of(fast) == [a.id, b.id]
    assert await ack(client, rid, ids_of(fast), consumer="fast") == 2
    assert (await client.get(f"/v1/rollouts/{rid}")).json()["status"] == "completed"

    # The trainer moves on two versions; a slower consumer must not get these episodes as fresh.
    await client.post("/v1/policies/pol-late/version", json={"version": 2})
    slow = await pull(client, rid, consumer="slow")
    assert slow["episodes"] == [] and slow["cursor"] == 2 and slow["done"] is False
    for episode in (a, b):
        got = (await client.get(f"/v1/episodes/{episode.id}")).json()
        assert got["status"] == "stale" and got["info"]["stale"]["detected"] == "delivery"
    body = (await client.get(f"/v1/rollouts/{rid}")).json()
    assert body["status"] == "running" and body["counts"] == {"stale": 2, "queued": 2}  # reruns reopen it
    assert dispatcher.submitted == [rid, rid]  # created, then reopened
    reruns = [r for r in await episodes_of(sessionmaker, rid) if r.attempt == 2]
    for rerun in reruns:
        await play_episode(sessionmaker, rerun.id, versions=(2,))
    fresh = await pull(client, rid, consumer="slow")
    assert sorted(ids_of(fresh)) == sorted(r.id for r in reruns)
    assert [x["seq"] for x in fresh["episodes"]] == [3, 4] and {x["attempt"] for x in fresh["episodes"]} == {2}
    assert await ack(client, rid, ids_of(fresh), consumer="slow") == 2
    assert (await pull(client, rid, consumer="slow"))["done"] is True
    assert (await client.get(f"/v1/rollouts/{rid}")).json()["status"] == "completed"


async def test_a_lease_on_an_episode_gone_stale_is_dropped_and_dead_lettered(gateway):
    client, sessionmaker = gateway.client, gateway.app.state.sessionmaker
    task_ids = await import_tasks(client, ["a"])
    rid = (await create_rollout(client, task_ids, group_size=1, max_staleness=0,
                                policy={"name": "pol-drop", "api": "scripted"}))["id"]
    (episode,) = await episodes_of(sessionmaker, rid)
    await play_episode(sessionmaker, episode.id, versions=(0,))
    first = await pull(client, rid, visibility_timeout_s=0)
    assert ids_of(first) == [episode.id]
    await client.post("/v1/policies/pol-drop/version", json={"version": 1})
    after = await pull(client, rid)
    assert after == {"episodes": [], "cursor": 1, "done": True}
    assert await ack(client, rid, [episode.id]) == 0  # the lease was dropped
    letters = (await client.get(f"/v1/rollouts/{rid}/dead_letters")).json()["items"]
    assert [x["id"] for x in letters] == [episode.id] and letters[0]["status"] == "stale"


async def test_long_poll_returns_when_a_group_is_released(gateway):
    client, sessionmaker = gateway.client, gateway.app.state.sessionmaker
    task_ids = await import_tasks(client, ["a"])
    rid = (await create_rollout(client, task_ids, group_size=1))["id"]
    (episode,) = await episodes_of(sessionmaker, rid)
    assert (await pull(client, rid, wait_s=0.3))["episodes"] == []

    waiting = asyncio.create_task(pull(client, rid, wait_s=20))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await play_episode(sessionmaker, episode.id)
    batch = await asyncio.wait_for(waiting, 30)
    assert ids_of(batch) == [episode.id]


async def test_delivery_state_survives_a_gateway_restart(tmp_path):
    settings = make_settings(tmp_path)
    app = create_app(settings, runtime=FakeRuntime())
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        with recording_dispatcher(app):
            task_ids = await import_tasks(client, ["a", "b", "c"])
            rid = (await create_rollout(client, task_ids, group_size=1))["id"]
            episodes = await episodes_of(app.state.sessionmaker, rid)
            for episode in episodes[:2]:
                await play_episode(app.state.sessionmaker, episode.id)
            batch = await pull(client, rid, visibility_timeout_s=600)
            assert [x["seq"] for x in batch["episodes"]] == [1, 2]
            assert await ack(client, rid, [episodes[0].id]) == 1
            # The last episode ends unseen by the consumer just before the gateway goes down.
            await play_episode(app.state.sessionmaker, episodes[2].id)

    restarted = create_app(settings, runtime=FakeRuntime())
    async with restarted.router.lifespan_context(restarted), asgi_client(restarted) as client:
        # The consumer's cursor survived (no duplicate of seq 1 or 2); the unacked seq 2 keeps its lease...
        assert ids_of(await pull(client, rid, visibility_timeout_s=600)) == [episodes[2].id]
        # ...and comes back when asked, or once its lease expires; the acked seq 1 never does.
        again = await pull(client, rid, redeliver=True)
        assert ids_of(again) == [episodes[1].id, episodes[2].id]
        assert [x["delivery_count"] for x in again["episodes"]] == [2, 2]
        assert await ack(client, rid, ids_of(again)) == 2
        assert (await pull(client, rid))["done"] is True
        body = (await client.get(f"/v1/rollouts/{rid}")).json()
        assert body["status"] == "completed" and body["progress"]["delivered"] == 3


# --------------------------------------------------------------------------- SSE on a real server


@asynccontextmanager
async def serve(app: FastAPI) -> AsyncIterator[str]:
    """Serve ``app`` (lifespan already running) with uvicorn on 127.0.0.1; yield its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning",
                                           timeout_graceful_shutdown=5))
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(200):
            if server.started or task.done():
                break
            await asyncio.sleep(0.05)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


class SSEReader:
    """Parse a text/event-stream into events ({"id", "event", "data"}) and comments."""

    def __init__(self, response: httpx.Response) -> None:
        self.lines = response.aiter_lines()
        self.comments: list[str] = []

    async def next_event(self) -> dict[str, Any]:
        event: dict[str, Any] = {}
        data: list[str] = []
        async for line in self.lines:
            if line == "":
                if data or "event" in event:
                    event["data"] = json.loads("\n".join(data)) if data else None
                    return event
                continue
            if line.startswith(":"):
                self.comments.append(line[1:].strip())
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "data":
                data.append(value)
            elif field in ("id", "event", "retry"):
                event[field] = value
        raise AssertionError("the stream ended before an event")

    async def next_comment(self) -> str:
        seen = len(self.comments)
        async for line in self.lines:
            if line.startswith(":"):
                self.comments.append(line[1:].strip())
                if len(self.comments) > seen and self.comments[-1] != "connected":
                    return self.comments[-1]
        raise AssertionError("the stream ended before a comment")


async def test_sse_stream_delivers_and_resumes_from_last_event_id(gateway, monkeypatch):
    monkeypatch.setattr(delivery, "HEARTBEAT_S", 0.3)
    client, sessionmaker = gateway.client, gateway.app.state.sessionmaker
    task_ids = await import_tasks(client, ["a", "b", "c"])
    rid = (await create_rollout(client, task_ids, group_size=1))["id"]
    a, b, c = await episodes_of(sessionmaker, rid)
    stream_url = f"/v1/rollouts/{rid}/stream"
    params = {"consumer": "sse", "batch_size": 1, "visibility_timeout_s": 600}
    async with serve(gateway.app) as url, httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as http:
        async with http.stream("GET", stream_url, params=params) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            reader = SSEReader(response)
            assert await asyncio.wait_for(reader.next_comment(), 20) == "heartbeat"
            await play_episode(sessionmaker, a.id)
            first = await asyncio.wait_for(reader.next_event(), 20)
            assert first["event"] == "episodes" and first["id"] == "1"
            assert [x["episode_id"] for x in first["data"]] == [a.id] and first["data"][0]["seq"] == 1
            await play_episode(sessionmaker, b.id)
            second = await asyncio.wait_for(reader.next_event(), 20)
            assert second["id"] == "2" and [x["episode_id"] for x in second["data"]] == [b.id]
        # The client "lost" event 2: it reconnects with the last id it processed.
        async with http.stream("GET", stream_url, params=params, headers={"Last-Event-ID": "1"}) as response:
            reader = SSEReader(response)
            resent = await asyncio.wait_for(reader.next_event(), 20)
            assert [x["episode_id"] for x in resent["data"]] == [b.id]
            assert resent["data"][0]["delivery_count"] == 2 and resent["id"] == "2"
            assert await ack(client, rid, [a.id, b.id], consumer="sse") == 2
            await play_episode(sessionmaker, c.id)
            third = await asyncio.wait_for(reader.next_event(), 20)
            assert third["id"] == "3" and [x["episode_id"] for x in third["data"]] == [c.id]
            assert await ack(client, rid, [c.id], consumer="sse") == 1
            end = await asyncio.wait_for(reader.next_event(), 20)
            assert end == {"event": "end", "id": "3", "data": {"cursor": 3}}
        # A finished consumer's stream ends at once.
        async with http.stream("GET", stream_url, params=params) as response:
            end = await asyncio.wait_for(SSEReader(response).next_event(), 20)
            assert end["event"] == "end"


async def test_the_sdk_streams_failed_episodes_masked_only_to_a_consumer_that_asks(gateway):
    client, sessionmaker = gateway.client, gateway.app.state.sessionmaker
    task_ids = await import_tasks(client, ["a", "b"])
    rid = (await create_rollout(client, task_ids, group_size=1, max_attempts=1))["id"]
    ok, bad = await episodes_of(sessionmaker, rid)
    await play_episode(sessionmaker, ok.id)
    await play_episode(sessionmaker, bad.id, status="failed", termination="submitted", reward=None,
                       error="verifier_error: the verifier timed out after 30s", info=VERIFIER_ERROR)

    async def drain(sdk: forkyard.AsyncClient, **options: Any) -> list[forkyard.Episode]:
        got: list[forkyard.Episode] = []
        async with sdk.rollouts.stream(rid, **options) as stream:
            async for batch in stream:
                got.extend(batch)
                await batch.ack()
        return got

    async with serve(gateway.app) as url, forkyard.AsyncClient(base_url=url, api_key=API_KEY) as sdk:
        rollout = await sdk.rollouts.get(rid)
        assert (rollout.partial_groups, rollout.failures, rollout.group_spare) == (1, {"verifier_error": 1}, 0)
        (trained,) = await asyncio.wait_for(drain(sdk, consumer="trainer"), 30)  # the stream ends: done
        assert trained.episode_id == ok.id and not trained.masked and trained.outcome == "reward"
        everything = await asyncio.wait_for(drain(sdk, consumer="inspector", include_failed=True), 30)
        assert [e.episode_id for e in everything] == [ok.id, bad.id]
        failed = everything[1]
        assert failed.masked and failed.outcome is forkyard.EpisodeOutcome.VERIFIER_ERROR and failed.reward is None
        assert failed.loss_mask == [0] * len(failed.input_ids) and failed.logprobs == []
        assert failed.group_partial and "verifier_error: the verifier timed out" in failed.group_reason
        pulled = await sdk.rollouts.pull(rid, consumer="puller", include_failed=True, max_episodes=10)
        assert pulled.episode_ids == [ok.id, bad.id] and await pulled.ack() == 2
        assert (await sdk.rollouts.pull(rid, consumer="puller", include_failed=True)).done
        [letter] = [d async for d in sdk.rollouts.dead_letters(rid)]
        assert letter.id == bad.id and letter.outcome is forkyard.EpisodeOutcome.VERIFIER_ERROR
        spared = await sdk.rollouts.create(tasks=task_ids[:1], group_size=2, group_spare=1,
                                           policy={"name": "p", "api": "scripted"})
        assert spared.group_spare == 1 and spared.progress.total == 3


# --------------------------------------------------------------------------- PostgreSQL


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for one test, dropped afterwards."""
    with postgres_database() as url:
        yield url


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
async def test_delivery_flow_with_concurrent_finishes(backend, tmp_path, request):
    url = f"sqlite:///{tmp_path / 'c.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    app = create_app(make_settings(tmp_path, database_url=url), runtime=FakeRuntime())
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        with recording_dispatcher(app):
            sessionmaker = app.state.sessionmaker
            task_ids = await import_tasks(client, ["a", "b", "c"])
            rid = (await create_rollout(client, task_ids, group_size=3, max_staleness=2, staleness_action="rerun",
                                        policy={"name": "pol-pg", "api": "scripted"}))["id"]
            episodes = await episodes_of(sessionmaker, rid)
            # Every episode finishes at once: group release and completion must still happen exactly once.
            await asyncio.gather(*(play_episode(sessionmaker, e.id, seed=i) for i, e in enumerate(episodes)))
            body = (await client.get(f"/v1/rollouts/{rid}")).json()
            assert body["status"] == "completed" and body["progress"]["streamed"] == 9

            batches = await asyncio.gather(pull(client, rid, consumer="x", max_episodes=5, visibility_timeout_s=600),
                                           pull(client, rid, consumer="x", max_episodes=5, visibility_timeout_s=600))
            seqs = sorted(x["seq"] for batch in batches for x in batch["episodes"])
            assert seqs == list(range(1, 10))  # two concurrent pulls of one consumer split the stream
            redelivered = await pull(client, rid, consumer="x", max_episodes=20, redeliver=True)
            assert sorted(x["seq"] for x in redelivered["episodes"]) == list(range(1, 10))
            assert {x["delivery_count"] for x in redelivered["episodes"]} == {2}
            assert await ack(client, rid, ids_of(redelivered), consumer="x") == 9
            assert (await pull(client, rid, consumer="x")) == {"episodes": [], "cursor": 9, "done": True}

            # Staleness at delivery: a new consumer after a version jump gets reruns, not stale data.
            await client.post("/v1/policies/pol-pg/version", json={"version": 3})
            assert (await pull(client, rid, consumer="y", max_episodes=20))["episodes"] == []
            reruns = [e for e in await episodes_of(sessionmaker, rid) if e.attempt == 2]
            assert len(reruns) == 9
            await asyncio.gather(*(play_episode(sessionmaker, e.id, versions=(3,)) for e in reruns))
            fresh = await pull(client, rid, consumer="y", max_episodes=20)
            assert sorted(ids_of(fresh)) == sorted(e.id for e in reruns)
            assert (await client.get(f"/v1/rollouts/{rid}")).json()["status"] == "completed"
