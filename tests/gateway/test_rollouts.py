"""Rollouts through the API: create (and its validation), read, list, cancel, fail, restart repair, policies."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.episodes import service as episodes_service
from gateway.rollouts import service as rollouts_service
from tests.gateway.conftest import assert_error
from tests.gateway.rollout_helpers import (
    SCRIPTED_POLICY,
    RecordingDispatcher,
    create_rollout,
    episodes_of,
    import_tasks,
    play_episode,
    recording_dispatcher,
)


@pytest.fixture(autouse=True)
def dispatcher(request: pytest.FixtureRequest) -> Iterator[RecordingDispatcher | None]:
    """Keep the app's dispatcher off these rollouts: the tests play the runner themselves."""
    if "gateway" not in request.fixturenames:
        yield None
        return
    with recording_dispatcher(request.getfixturevalue("gateway").app) as recorder:
        yield recorder


TOKENS_POLICY = {"name": "Qwen/Qwen3-0.6B", "api": "tokens", "model": "Qwen/Qwen3-0.6B",
                 "base_urls": ["http://127.0.0.1:9/"], "sampling": {"temperature": 0.7, "max_tokens": 64}}


@pytest.mark.parametrize(("change", "field"), [
    ({"group_size": 0}, "group_size"),
    ({"group_size": 1025}, "group_size"),
    ({"policy": {**SCRIPTED_POLICY, "api": "completions"}}, "policy.api"),
    ({"policy": {**TOKENS_POLICY, "base_urls": []}}, "base_urls"),
    ({"policy": {**TOKENS_POLICY, "model": ""}}, "model"),
    ({"policy": {**TOKENS_POLICY, "base_urls": ["not a url"]}}, "policy.base_urls"),
    ({"policy": {**SCRIPTED_POLICY, "name": "bad name!"}}, "policy.name"),
    ({"group_mode": {"mode": "early"}}, "min_group_size"),
    ({"group_size": 2, "group_mode": {"mode": "early", "min_group_size": 3}}, "min_group_size"),
    ({"group_mode": {"mode": "complete", "min_group_size": 1}}, "min_group_size"),
    ({"staleness_action": "ignore"}, "staleness_action"),
    ({"max_staleness": -1}, "max_staleness"),
    ({"surprise": 1}, "surprise"),
])
async def test_create_rejects_invalid_bodies_naming_the_field(gateway, change, field):
    task_ids = await import_tasks(gateway.client, ["hello"])
    body = {"tasks": task_ids, "group_size": 2, "policy": SCRIPTED_POLICY, **change}
    error = assert_error(await gateway.client.post("/v1/rollouts", json=body), 422, "validation_error")
    assert field in error["message"]
    assert (await gateway.client.get("/v1/rollouts")).json()["items"] == []


async def test_policy_api_key_is_kept_as_a_secret(gateway):
    """The key reaches the row's secret column (and the dispatcher), never a response or a log line."""
    import logging

    from gateway.logs import RedactingFormatter
    from gateway.rollouts.models import Rollout

    key = "sk-vllm-" + "k3y" * 8
    (task_id,) = await import_tasks(gateway.client, ["hello"])
    policy = {**TOKENS_POLICY, "api_key": key}
    created = await create_rollout(gateway.client, [task_id], policy=policy)
    assert "api_key" not in created["policy"] and key not in str(created)
    assert created["policy"]["base_urls"] == ["http://127.0.0.1:9"]
    for path in (f"/v1/rollouts/{created['id']}", "/v1/rollouts", "/v1/episodes", "/openapi.json"):
        response = await gateway.client.get(path)
        assert response.status_code == 200 and key not in response.text, path
    async with gateway.app.state.sessionmaker() as db:
        row = await db.get(Rollout, created["id"])
        assert row.policy_api_key == key and "api_key" not in row.policy
    # Loaded once (creating the rollout), the key is redacted from every later log line.
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "calling %s with Bearer %s", ("srv", key), None)
    assert RedactingFormatter("%(message)s").format(record) == "calling srv with Bearer ***"


@pytest.mark.parametrize(("policy", "status"), [
    ({**TOKENS_POLICY, "api": "chat", "tool_choice": "required"}, 201),
    ({**TOKENS_POLICY, "api": "chat", "tool_choice": "always"}, 422),
    ({**TOKENS_POLICY, "tool_choice": "auto"}, 422),  # the tokens api has no tool_choice
    ({**TOKENS_POLICY, "api_key": ""}, 422),
])
async def test_policy_tool_choice_and_api_key_are_checked(gateway, policy, status):
    (task_id,) = await import_tasks(gateway.client, ["hello"])
    response = await gateway.client.post("/v1/rollouts", json={"tasks": [task_id], "group_size": 1, "policy": policy})
    assert response.status_code == status, response.text
    if status == 201:
        assert response.json()["policy"]["tool_choice"] == "required"
    else:
        field = "tool_choice" if "tool_choice" in policy else "api_key"
        assert field in assert_error(response, 422, "validation_error")["message"]


async def test_create_rejects_unknown_and_repeated_tasks_naming_them(gateway):
    (known,) = await import_tasks(gateway.client, ["hello"])
    body = {"tasks": {"ids": [known, "task_nope1", "task_nope2"]}, "group_size": 2, "policy": SCRIPTED_POLICY}
    error = assert_error(await gateway.client.post("/v1/rollouts", json=body), 422, "unknown_tasks")
    assert "'task_nope1'" in error["message"] and "'task_nope2'" in error["message"]
    assert known not in error["message"]

    body["tasks"] = {"ids": [known, known]}
    error = assert_error(await gateway.client.post("/v1/rollouts", json=body), 422, "validation_error")
    assert known in error["message"] and "group_size" in error["message"]

    body["tasks"] = {"environment": "terminal", "names": ["hello", "missing-task"]}
    error = assert_error(await gateway.client.post("/v1/rollouts", json=body), 422, "unknown_tasks")
    assert "'missing-task'" in error["message"]

    body["tasks"] = {"environment": "no-such-env"}
    error = assert_error(await gateway.client.post("/v1/rollouts", json=body), 422, "unknown_environment")
    assert "no-such-env" in error["message"]
    assert (await gateway.client.get("/v1/episodes")).json()["items"] == []


async def test_create_makes_one_group_per_task_and_group_size_queued_episodes(gateway, dispatcher):
    task_ids = await import_tasks(gateway.client, ["alpha", "beta", "gamma"])
    rollout = await create_rollout(gateway.client, task_ids, group_size=4, policy=TOKENS_POLICY,
                                   agent={"max_turns": 5}, priority=3, max_staleness=2)
    assert dispatcher.submitted == [rollout["id"]]  # handed to the dispatcher at once
    assert rollout["id"].startswith("ro_") and rollout["status"] == "queued"
    assert rollout["task_ids"] == task_ids and rollout["group_size"] == 4
    assert rollout["counts"] == {"queued": 12}
    assert rollout["progress"] == {"total": 12, "finished": 0, "streamed": 0, "delivered": 0}
    assert rollout["policy"]["base_urls"] == ["http://127.0.0.1:9"]
    assert rollout["policy"]["sampling"]["temperature"] == 0.7 and rollout["agent"]["max_turns"] == 5
    assert rollout["group_mode"] == {"mode": "complete", "min_group_size": None}
    assert rollout["started_at"] is None and rollout["finished_at"] is None

    episodes = await episodes_of(gateway.app.state.sessionmaker, rollout["id"])
    groups: dict[str, list] = {}
    for episode in episodes:
        groups.setdefault(episode.group_id, []).append(episode)
        assert episode.status.value == "queued" and episode.attempt == 1
    assert len(groups) == 3
    for members in groups.values():
        assert len({e.task_id for e in members}) == 1
        assert sorted(e.sample_index for e in members) == [0, 1, 2, 3]
    assert [members[0].task_id for members in groups.values()] == task_ids

    # An unreachable server is not the API's business: the rollout is accepted, episodes fail later.
    listed = (await gateway.client.get("/v1/episodes", params={"rollout_id": rollout["id"], "limit": 500})).json()
    assert {e["id"] for e in listed["items"]} == {e.id for e in episodes}
    # Naming a policy makes it known at version 0.
    policy = (await gateway.client.get("/v1/policies/Qwen/Qwen3-0.6B")).json()
    assert policy["version"] == 0 and policy["paused"] is False


async def test_create_accepts_a_bare_list_and_environment_selection(gateway):
    task_ids = await import_tasks(gateway.client, ["one", "two"])
    bare = await create_rollout(gateway.client, task_ids, group_size=1)
    assert bare["task_ids"] == task_ids
    by_env = (await gateway.client.post("/v1/rollouts", json={
        "tasks": {"environment": "terminal"}, "group_size": 1, "policy": SCRIPTED_POLICY})).json()
    assert sorted(by_env["task_ids"]) == sorted(task_ids)
    by_name = (await gateway.client.post("/v1/rollouts", json={
        "tasks": {"environment": "terminal", "names": ["two"]}, "group_size": 1, "policy": SCRIPTED_POLICY})).json()
    assert by_name["task_ids"] == [task_ids[1]]


async def test_get_list_and_page_rollouts(gateway):
    task_ids = await import_tasks(gateway.client, ["hello"])
    created = [await create_rollout(gateway.client, task_ids, group_size=1) for _ in range(3)]
    first = (await gateway.client.get("/v1/rollouts", params={"limit": 2})).json()
    second = (await gateway.client.get("/v1/rollouts", params={"limit": 2, "cursor": first["next"]})).json()
    assert [r["id"] for r in first["items"] + second["items"]] == [r["id"] for r in created]
    assert second["next"] is None
    one = (await gateway.client.get(f"/v1/rollouts/{created[1]['id']}")).json()
    assert one["id"] == created[1]["id"] and one["counts"] == {"queued": 1}
    queued = (await gateway.client.get("/v1/rollouts", params={"status": "queued"})).json()
    assert len(queued["items"]) == 3
    assert (await gateway.client.get("/v1/rollouts", params={"status": "running"})).json()["items"] == []
    error = assert_error(await gateway.client.get("/v1/rollouts/ro_missing"), 404, "not_found")
    assert "ro_missing" in error["message"]


async def test_rollout_runs_to_completed_with_counts_and_progress(gateway):
    sessionmaker = gateway.app.state.sessionmaker
    task_ids = await import_tasks(gateway.client, ["a", "b"])
    rollout = await create_rollout(gateway.client, task_ids, group_size=2)
    episodes = await episodes_of(sessionmaker, rollout["id"])
    async with sessionmaker() as db:
        queued = await episodes_service.list_queued_episodes(db_session=db, rollout_id=rollout["id"], limit=3)
        assert [(e.task_index, e.sample_index) for e in queued] == [(0, 0), (0, 1), (1, 0)]
        active = await rollouts_service.list_active_rollouts(db_session=db)
        assert rollout["id"] in [r.id for r in active]
    await play_episode(sessionmaker, episodes[0].id, reward=1.0)
    running = (await gateway.client.get(f"/v1/rollouts/{rollout['id']}")).json()
    assert running["status"] == "running" and running["started_at"] is not None
    assert running["counts"] == {"queued": 3, "completed": 1} and running["progress"]["finished"] == 1
    await play_episode(sessionmaker, episodes[1].id, status="truncated", termination="max_turns", reward=0.0)
    await play_episode(sessionmaker, episodes[2].id, status="failed", termination="error", reward=None,
                       error="policy server http://127.0.0.1:9 unreachable: connection refused")
    await play_episode(sessionmaker, episodes[3].id, reward=0.5)
    done = (await gateway.client.get(f"/v1/rollouts/{rollout['id']}")).json()
    assert done["status"] == "completed" and done["finished_at"] is not None
    assert done["counts"] == {"completed": 2, "truncated": 1, "failed": 1}
    assert done["progress"] == {"total": 4, "finished": 4, "streamed": 3, "delivered": 0}
    async with sessionmaker() as db:
        assert rollout["id"] not in [r.id for r in await rollouts_service.list_active_rollouts(db_session=db)]


async def test_cancel_fails_queued_episodes_and_keeps_finished_groups(gateway, dispatcher):
    sessionmaker = gateway.app.state.sessionmaker
    task_ids = await import_tasks(gateway.client, ["a", "b"])
    rollout = await create_rollout(gateway.client, task_ids, group_size=2)
    rid = rollout["id"]
    e = await episodes_of(sessionmaker, rid)
    await play_episode(sessionmaker, e[0].id)
    await play_episode(sessionmaker, e[1].id)  # group a is complete and streamed
    async with sessionmaker() as db:
        assert await episodes_service.mark_episode_running(db_session=db, episode_id=e[2].id)

    cancelled = await gateway.client.post(f"/v1/rollouts/{rid}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    body = cancelled.json()
    assert body["status"] == "cancelled" and body["finished_at"] is not None
    assert body["counts"] == {"completed": 2, "running": 1, "failed": 1}
    assert dispatcher.cancelled == [rid]  # the dispatcher is told to stop the running episode
    async with sessionmaker() as db:
        # The dispatcher must not start a queued episode of a cancelled rollout.
        queued = await episodes_service.list_queued_episodes(db_session=db, rollout_id=rid, limit=10)
        assert queued == []
        assert await episodes_service.mark_episode_running(db_session=db, episode_id=e[3].id) is False
        # The dispatcher stops the running one; it finishes as cancelled.
        await episodes_service.finish_episode(
            db_session=db, episode_id=e[2].id, status="failed", termination="cancelled", reward=None,
            error="the rollout was cancelled", messages=[], timings={}, weight_versions=[], info={})
    cancelled_ep = (await gateway.client.get(f"/v1/episodes/{e[3].id}")).json()
    assert cancelled_ep["status"] == "failed" and cancelled_ep["termination"] == "cancelled"
    assert cancelled_ep["dead_letter_reason"] == "the rollout was cancelled"

    again = await gateway.client.post(f"/v1/rollouts/{rid}/cancel")
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    # Group a was released before the cancel and stays deliverable.
    pulled = (await gateway.client.post(f"/v1/rollouts/{rid}/pull", json={"consumer": "trainer"})).json()
    assert sorted(x["episode_id"] for x in pulled["episodes"]) == sorted([e[0].id, e[1].id])
    letters = (await gateway.client.get(f"/v1/rollouts/{rid}/dead_letters")).json()["items"]
    assert sorted(x["id"] for x in letters) == sorted([e[2].id, e[3].id])

    other = await create_rollout(gateway.client, task_ids[:1], group_size=1)
    only = (await episodes_of(sessionmaker, other["id"]))[0]
    await play_episode(sessionmaker, only.id)
    error = assert_error(await gateway.client.post(f"/v1/rollouts/{other['id']}/cancel"), 409, "rollout_finished")
    assert "completed" in error["message"]
    assert_error(await gateway.client.post("/v1/rollouts/ro_missing/cancel"), 404, "not_found")


async def test_fail_rollout_fails_queued_episodes_with_the_reason(gateway):
    sessionmaker = gateway.app.state.sessionmaker
    task_ids = await import_tasks(gateway.client, ["a"])
    rollout = await create_rollout(gateway.client, task_ids, group_size=3)
    async with sessionmaker() as db:
        row = await rollouts_service.fail_rollout(db_session=db, rollout_id=rollout["id"],
                                                  error="tokenizer /models/x is missing")
    assert row.status.value == "failed"
    body = (await gateway.client.get(f"/v1/rollouts/{rollout['id']}")).json()
    assert body["status"] == "failed" and body["error"] == "tokenizer /models/x is missing"
    assert body["counts"] == {"failed": 3}
    letters = (await gateway.client.get(f"/v1/rollouts/{rollout['id']}/dead_letters")).json()["items"]
    assert len(letters) == 3 and all("tokenizer /models/x is missing" in x["reason"] for x in letters)
    assert all(x["termination"] == "error" for x in letters)


async def test_requeue_interrupted_fails_running_episodes_and_queues_a_new_attempt(gateway):
    sessionmaker = gateway.app.state.sessionmaker
    task_ids = await import_tasks(gateway.client, ["a", "b"])
    retrying = await create_rollout(gateway.client, task_ids[:1], group_size=1, max_attempts=2)
    last_try = await create_rollout(gateway.client, task_ids[1:], group_size=1, max_attempts=1)
    (first,) = await episodes_of(sessionmaker, retrying["id"])
    (only,) = await episodes_of(sessionmaker, last_try["id"])
    async with sessionmaker() as db:
        assert await episodes_service.mark_episode_running(db_session=db, episode_id=first.id, node="test-node")
        assert await episodes_service.mark_episode_running(db_session=db, episode_id=only.id, node="test-node")
        assert await episodes_service.requeue_interrupted(db_session=db, node="another-node") == 0
        assert await episodes_service.requeue_interrupted(db_session=db, node="test-node") == 2
        assert await episodes_service.requeue_interrupted(db_session=db) == 0

    rows = await episodes_of(sessionmaker, retrying["id"])
    assert [(r.attempt, r.status.value) for r in rows] == [(1, "failed"), (2, "queued")]
    assert rows[0].error == episodes_service.INTERRUPTED_ERROR and rows[0].dead_letter_reason is None
    assert (rows[1].group_id, rows[1].sample_index) == (rows[0].group_id, rows[0].sample_index)
    assert (await gateway.client.get(f"/v1/rollouts/{retrying['id']}")).json()["status"] == "running"
    await play_episode(sessionmaker, rows[1].id)
    pulled = (await gateway.client.post(f"/v1/rollouts/{retrying['id']}/pull", json={"consumer": "c"})).json()
    assert [x["episode_id"] for x in pulled["episodes"]] == [rows[1].id]
    assert pulled["episodes"][0]["attempt"] == 2

    (dead,) = await episodes_of(sessionmaker, last_try["id"])
    assert dead.status.value == "failed" and dead.outcome.value == "infra"
    assert dead.dead_letter_reason == f"{episodes_service.INTERRUPTED_ERROR}; no attempts left (max_attempts 1)"
    assert (await gateway.client.get(f"/v1/rollouts/{last_try['id']}")).json()["status"] == "completed"


async def test_policy_version_pause_and_resume(gateway):
    error = assert_error(await gateway.client.get("/v1/policies/trainer-a"), 404, "not_found")
    assert "trainer-a" in error["message"]
    set_v = await gateway.client.post("/v1/policies/trainer-a/version", json={"version": 3})
    assert set_v.status_code == 200, set_v.text
    assert {k: set_v.json()[k] for k in ("name", "version", "paused")} == {"name": "trainer-a", "version": 3,
                                                                          "paused": False}
    assert (await gateway.client.post("/v1/policies/trainer-a/version", json={"version": 3})).status_code == 200
    error = assert_error(await gateway.client.post("/v1/policies/trainer-a/version", json={"version": 2}),
                         409, "version_regression")
    assert "3" in error["message"] and "2" in error["message"]
    assert_error(await gateway.client.post("/v1/policies/trainer-a/version", json={"version": -1}),
                 422, "validation_error")
    paused = (await gateway.client.post("/v1/policies/trainer-a/pause")).json()
    assert paused["paused"] is True and paused["version"] == 3
    async with gateway.app.state.sessionmaker() as db:
        from gateway.policies import service as policies_service

        assert await policies_service.is_paused(db_session=db, name="trainer-a") is True
        assert await policies_service.current_version(db_session=db, name="trainer-a") == 3
        assert await policies_service.current_version(db_session=db, name="never-announced") == 0
    resumed = (await gateway.client.post("/v1/policies/trainer-a/resume")).json()
    assert resumed["paused"] is False
    assert (await gateway.client.get("/v1/policies/trainer-a")).json()["paused"] is False
    # Names with a slash (model names) work in the path.
    slashed = (await gateway.client.post("/v1/policies/org/model-7b/version", json={"version": 1})).json()
    assert slashed["name"] == "org/model-7b" and slashed["version"] == 1
    assert_error(await gateway.client.post("/v1/policies/bad name!/pause"), 422, "validation_error")
