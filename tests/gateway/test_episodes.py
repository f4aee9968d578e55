"""Episodes through the API: list, detail, the token-exact training view, and step recording rules."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from gateway.episodes import service as episodes_service
from gateway.episodes.models import Episode, EpisodeStep
from tests.gateway.conftest import assert_error
from tests.gateway.rollout_helpers import (
    RecordingDispatcher,
    create_rollout,
    episodes_of,
    float32,
    import_tasks,
    make_step,
    play_episode,
    recording_dispatcher,
)
from workers.protocol import EpisodeStatus, Termination


@pytest.fixture(autouse=True)
def dispatcher(request: pytest.FixtureRequest) -> Iterator[RecordingDispatcher | None]:
    """Keep the app's dispatcher off these rollouts: the tests play the runner themselves."""
    if "gateway" not in request.fixturenames:
        yield None
        return
    with recording_dispatcher(request.getfixturevalue("gateway").app) as recorder:
        yield recorder


async def test_training_view_is_token_exact(gateway):
    sessionmaker = gateway.app.state.sessionmaker
    task_ids = await import_tasks(gateway.client, ["hello"])
    rollout = await create_rollout(gateway.client, task_ids, group_size=1)
    (episode,) = await episodes_of(sessionmaker, rollout["id"])
    _, steps = await play_episode(sessionmaker, episode.id, versions=(3, 3, 4), reward=0.25, seed=7)

    response = await gateway.client.get(f"/v1/episodes/{episode.id}/training")
    assert response.status_code == 200, response.text
    view = response.json()
    assert view["episode_id"] == episode.id and view["group_id"] == episode.group_id
    assert view["reward"] == 0.25 and view["weight_versions"] == [3, 3, 4]
    assert view["status"] == "completed" and view["termination"] == "submitted"

    expected_ids = [t for s in steps for t in s["prompt_ids"] + s["completion_ids"]]
    assert view["input_ids"] == expected_ids
    assert len(view["loss_mask"]) == len(view["input_ids"])
    sampled = [t for s in steps for t in s["completion_ids"]]
    assert sum(view["loss_mask"]) == len(sampled) == len(view["logprobs"])
    assert [t for t, m in zip(view["input_ids"], view["loss_mask"], strict=True) if m] == sampled
    # Prompt and observation tokens carry no loss.
    offset = 0
    for step in steps:
        assert view["loss_mask"][offset:offset + len(step["prompt_ids"])] == [0] * len(step["prompt_ids"])
        offset += len(step["prompt_ids"]) + len(step["completion_ids"])
    # float32 logprobs come back bit for bit, in sampled-token order.
    expected_logprobs = [lp for s in steps for lp in s["logprobs"]]
    assert view["logprobs"] == expected_logprobs
    assert all(float32(lp) == lp for lp in view["logprobs"])


async def test_episode_detail_has_messages_steps_and_timings(gateway):
    sessionmaker = gateway.app.state.sessionmaker
    task_ids = await import_tasks(gateway.client, ["hello"])
    rollout = await create_rollout(gateway.client, task_ids, group_size=1)
    (episode,) = await episodes_of(sessionmaker, rollout["id"])
    _, steps = await play_episode(sessionmaker, episode.id, versions=(1, 2), status="truncated",
                                  termination="max_turns", reward=0.0)
    detail = (await gateway.client.get(f"/v1/episodes/{episode.id}")).json()
    assert detail["status"] == "truncated" and detail["termination"] == "max_turns" and detail["reward"] == 0.0
    assert detail["num_turns"] == 2 and detail["messages"] == [{"role": "user", "content": "do it"}]
    assert detail["timings"] == {"total_s": 0.1} and detail["weight_versions"] == [1, 2]
    assert detail["info"] == {"seed": 0} and detail["seq"] == 1 and detail["dead_letter_reason"] is None
    assert [s["index"] for s in detail["steps"]] == [0, 1]
    for got, sent in zip(detail["steps"], steps, strict=True):
        assert got["action"] == sent["action"] and got["observation"] == sent["observation"]
        assert got["text"] == sent["text"] and got["weight_version"] == sent["weight_version"]
        assert got["finish_reason"] == "stop" and got["timings"] == sent["timings"]
        assert got["num_prompt_tokens"] == len(sent["prompt_ids"])
        assert got["num_completion_tokens"] == len(sent["completion_ids"])
    error = assert_error(await gateway.client.get("/v1/episodes/ep_missing"), 404, "not_found")
    assert "ep_missing" in error["message"]
    assert_error(await gateway.client.get("/v1/episodes/ep_missing/training"), 404, "not_found")


async def test_list_episodes_filters_and_pages(gateway):
    sessionmaker = gateway.app.state.sessionmaker
    task_ids = await import_tasks(gateway.client, ["a", "b"])
    first = await create_rollout(gateway.client, task_ids, group_size=3)
    second = await create_rollout(gateway.client, task_ids[:1], group_size=1)
    rows = await episodes_of(sessionmaker, first["id"])
    await play_episode(sessionmaker, rows[0].id)
    await play_episode(sessionmaker, rows[1].id, status="failed", termination="error", reward=None, error="boom")

    seen: list[str] = []
    cursor = None
    while True:
        params = {"rollout_id": first["id"], "limit": 4, **({"cursor": cursor} if cursor else {})}
        page = (await gateway.client.get("/v1/episodes", params=params)).json()
        seen += [e["id"] for e in page["items"]]
        cursor = page["next"]
        if cursor is None:
            break
    assert sorted(seen) == sorted(r.id for r in rows) and len(seen) == 6

    failed = (await gateway.client.get("/v1/episodes", params={"rollout_id": first["id"], "status": "failed"})).json()
    assert [(e["id"], e["error"]) for e in failed["items"]] == [(rows[1].id, "boom")]
    group = (await gateway.client.get("/v1/episodes", params={"group_id": rows[0].group_id})).json()
    assert sorted(e["sample_index"] for e in group["items"]) == [0, 1, 2]
    by_task = (await gateway.client.get("/v1/episodes", params={"task_id": task_ids[0], "limit": 500})).json()
    assert len(by_task["items"]) == 4
    everything = (await gateway.client.get("/v1/episodes", params={"limit": 500})).json()
    assert {e["rollout_id"] for e in everything["items"]} == {first["id"], second["id"]}
    assert_error(await gateway.client.get("/v1/episodes", params={"status": "lost"}), 422, "validation_error")
    assert_error(await gateway.client.get("/v1/episodes", params={"cursor": "%%%"}), 400, "bad_request")


async def test_record_step_rules(gateway):
    sessionmaker = gateway.app.state.sessionmaker
    task_ids = await import_tasks(gateway.client, ["hello"])
    rollout = await create_rollout(gateway.client, task_ids, group_size=1)
    (episode,) = await episodes_of(sessionmaker, rollout["id"])
    rng = random.Random(1)
    async with sessionmaker() as db:
        assert await episodes_service.mark_episode_running(db_session=db, episode_id=episode.id)
        assert await episodes_service.mark_episode_running(db_session=db, episode_id=episode.id) is False
        bad = make_step(0, rng, version=0, first=True)
        bad["logprobs"] = bad["logprobs"][:-1]
        with pytest.raises(ValueError, match="logprobs"):
            await episodes_service.record_step(db_session=db, episode_id=episode.id, step=bad)
        step = make_step(0, rng, version=0, first=True)
        step["logprobs"][0] = float("-inf")
        stored = await episodes_service.record_step(db_session=db, episode_id=episode.id, step=step)
        assert stored is not None and stored.logprobs[0] is None and stored.logprobs[1:] == step["logprobs"][1:]
        with pytest.raises(ValueError, match="already has a step 0"):
            await episodes_service.record_step(db_session=db, episode_id=episode.id, step=step)
        with pytest.raises(ValueError, match="final state"):
            await episodes_service.finish_episode(db_session=db, episode_id=episode.id, status="running",
                                                  termination=None, reward=None)
        finished = await episodes_service.finish_episode(
            db_session=db, episode_id=episode.id, status="completed", termination="submitted",
            reward=float("nan"), weight_versions=[0])
        assert finished.reward is None and finished.num_turns == 1
        # Late steps and repeated finishes change nothing.
        late = make_step(1, rng, version=0, first=False)
        assert await episodes_service.record_step(db_session=db, episode_id=episode.id, step=late) is None
        again = await episodes_service.finish_episode(db_session=db, episode_id=episode.id, status="failed",
                                                      termination="error", reward=None, error="late")
        assert again.status == EpisodeStatus.COMPLETED and again.error is None
    view = (await gateway.client.get(f"/v1/episodes/{episode.id}/training")).json()
    assert view["logprobs"][0] is None and sum(view["loss_mask"]) == len(view["logprobs"])


def test_training_view_orders_steps_and_pads_missing_logprobs():
    episode = Episode(id="ep_x", group_id="grp_x", reward=1.0, weight_versions=[0, 1],
                      termination=Termination.SUBMITTED, status=EpisodeStatus.COMPLETED)
    steps = [
        EpisodeStep(index=1, prompt_ids=[7], completion_ids=[8, 9], logprobs=None),
        EpisodeStep(index=0, prompt_ids=[1, 2, 3], completion_ids=[4, 5], logprobs=[-0.5, -0.25]),
    ]
    view = episodes_service.training_view(episode, steps)
    assert view["input_ids"] == [1, 2, 3, 4, 5, 7, 8, 9]
    assert view["loss_mask"] == [0, 0, 0, 1, 1, 0, 1, 1]
    assert view["logprobs"] == [-0.5, -0.25, None, None]
    assert (view["status"], view["termination"], view["group_id"]) == ("completed", "submitted", "grp_x")
