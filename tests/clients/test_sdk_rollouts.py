"""Rollouts, policies and episodes through the SDK against a fake gateway (both twins)."""

from __future__ import annotations

import json
from datetime import datetime

import httpx
import pytest

import forkyard

ORACLE = {"name": "oracle", "api": "scripted", "model": "oracle"}


def rollout_json(rid: str = "r1", status: str = "queued", **extra) -> dict:
    return {
        "id": rid, "status": status, "group_size": 4, "policy": ORACLE,
        "counts": {"queued": 8}, "progress": {"total": 8, "finished": 0, "delivered": 0},
        "created_at": "2025-03-01T10:00:00Z", "started_at": None, "finished_at": None, "error": None,
        **extra,
    }


def training_json(n: int, *, group: str = "g0", reward: float | None = 1.0, seq: int | None = None) -> dict:
    return {
        "episode_id": f"e{n}", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1], "logprobs": [-0.1, -0.2],
        "reward": reward, "group_id": group, "weight_versions": [3, 4], "termination": "submitted",
        "status": "completed", **({"seq": seq} if seq is not None else {}),
    }


def episode_info_json(n: int, status: str = "completed") -> dict:
    return {
        "id": f"e{n}", "rollout_id": "r1", "task_id": "t1", "group_id": "g0", "sample_index": n, "attempt": 1,
        "status": status, "termination": "submitted", "reward": 1.0, "error": None, "num_turns": 2,
        "created_at": "2025-03-01T10:00:00Z", "finished_at": "2025-03-01T10:01:00Z",
    }


# -- create / get / list / cancel -----------------------------------------------------------


async def test_create_sends_the_rollout_and_returns_it(twin):
    twin.respond(httpx.Response(201, json=rollout_json()))
    rollout = await twin.call(
        twin.client.rollouts.create,
        tasks=["t1", "t2"], group_size=4, policy=ORACLE,
        agent={"max_turns": 5}, limits={"episode_timeout_s": 120.0},
        max_staleness=2, group_mode="early", priority=3,
    )
    request = twin.requests[0]
    assert request.method == "POST" and request.url.path == "/v1/rollouts"
    assert twin.body() == {
        "tasks": {"ids": ["t1", "t2"]}, "group_size": 4, "policy": ORACLE,
        "agent": {"max_turns": 5}, "limits": {"episode_timeout_s": 120.0},
        "max_staleness": 2, "group_mode": {"mode": "early"}, "priority": 3,
    }, "options left unset are not sent, so the gateway's defaults apply"
    assert isinstance(rollout, forkyard.Rollout)
    assert rollout.status is forkyard.RolloutStatus.QUEUED and not rollout.done
    assert rollout.progress == forkyard.RolloutProgress(total=8, finished=0, delivered=0)
    assert rollout.counts == {"queued": 8}
    assert rollout.created_at == datetime.fromisoformat("2025-03-01T10:00:00+00:00")


async def test_create_accepts_task_objects_and_task_selectors(twin):
    twin.handle(lambda r: httpx.Response(201, json=rollout_json()))
    task = forkyard.Task(id="t7", name="seven", environment="terminal", content_hash="ab")
    await twin.call(twin.client.rollouts.create, tasks=[task, "t8"], group_size=1, policy=ORACLE)
    assert twin.body()["tasks"] == {"ids": ["t7", "t8"]}
    selector = {"environment": "terminal", "names": ["hello"]}
    await twin.call(
        twin.client.rollouts.create, tasks=selector, group_size=2, policy=ORACLE,
        group_mode={"mode": "early", "min_group_size": 1}, extra_body={"concurrency": 2, "new_option": True},
    )
    body = twin.body()
    assert body["tasks"] == selector
    assert body["group_mode"] == {"mode": "early", "min_group_size": 1}
    assert body["concurrency"] == 2 and body["new_option"] is True


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"tasks": ["t1"], "group_size": 0, "policy": ORACLE}, ValueError, "group_size"),
        ({"tasks": ["t1"], "group_size": True, "policy": ORACLE}, ValueError, "group_size"),
        ({"tasks": [], "group_size": 1, "policy": ORACLE}, ValueError, "at least one task"),
        ({"tasks": "t1", "group_size": 1, "policy": ORACLE}, TypeError, "list of task ids"),
        ({"tasks": [3], "group_size": 1, "policy": ORACLE}, TypeError, "task ids or Task objects"),
        ({"tasks": ["t1"], "group_size": 1, "policy": {}}, ValueError, "policy"),
    ],
)
async def test_create_refuses_bad_arguments_before_sending(twin, kwargs, error, message):
    with pytest.raises(error, match=message):
        await twin.call(twin.client.rollouts.create, **kwargs)
    assert twin.requests == []


async def test_create_is_not_resent_after_a_server_error(twin):
    twin.respond(twin.error(500, "internal_error", "Boom."))
    with pytest.raises(forkyard.InternalServerError):
        await twin.call(twin.client.rollouts.create, tasks=["t1"], group_size=1, policy=ORACLE)
    assert len(twin.requests) == 1, "a create that may have taken effect is never repeated"


async def test_gateway_validation_errors_surface_with_their_message(twin):
    twin.respond(twin.error(422, "validation_error", "Unknown task ids: t404."))
    with pytest.raises(forkyard.UnprocessableEntityError, match="t404") as info:
        await twin.call(twin.client.rollouts.create, tasks=["t404"], group_size=1, policy=ORACLE)
    assert info.value.code == "validation_error"


async def test_get_and_cancel(twin):
    twin.respond(
        httpx.Response(200, json=rollout_json(status="running", counts={"running": 2, "completed": 6})),
        httpx.Response(200, json=rollout_json(status="cancelled", finished_at="2025-03-01T10:05:00Z")),
    )
    rollout = await twin.call(twin.client.rollouts.get, "r/1")
    assert twin.requests[0].url.raw_path == b"/v1/rollouts/r%2F1"
    assert rollout.status is forkyard.RolloutStatus.RUNNING and rollout.counts["completed"] == 6
    cancelled = await twin.call(twin.client.rollouts.cancel, "r1")
    assert (twin.requests[1].method, twin.requests[1].url.path) == ("POST", "/v1/rollouts/r1/cancel")
    assert cancelled.status is forkyard.RolloutStatus.CANCELLED and cancelled.done
    with pytest.raises(ValueError, match="rollout_id"):
        await twin.call(twin.client.rollouts.get, "")


async def test_an_unknown_status_stays_a_string(twin):
    twin.respond(httpx.Response(200, json=rollout_json(status="paused", shard="eu-1")))
    rollout = await twin.call(twin.client.rollouts.get, "r1")
    assert rollout.status == "paused" and not rollout.done
    assert rollout.model_extra == {"shard": "eu-1"}


async def test_list_pages_through_rollouts(twin):
    pages = {None: ([rollout_json("r1"), rollout_json("r2")], "c2"), "c2": ([rollout_json("r3")], None)}

    def handler(request: httpx.Request) -> httpx.Response:
        items, nxt = pages[request.url.params.get("cursor")]
        return httpx.Response(200, json={"items": items, "next": nxt})

    twin.handle(handler)
    rollouts = await twin.collect(twin.client.rollouts.list(status=forkyard.RolloutStatus.RUNNING, limit=2))
    assert [r.id for r in rollouts] == ["r1", "r2", "r3"]
    assert dict(twin.requests[0].url.params) == {"status": "running", "limit": "2"}


async def test_dead_letters_page_with_reasons(twin):
    item = {**episode_info_json(4, status="failed"), "error": "Policy server unreachable.", "reason": "failed"}
    twin.respond(httpx.Response(200, json={"items": [item], "next": None}))
    [dead] = await twin.collect(twin.client.rollouts.dead_letters("r1"))
    assert twin.requests[0].url.path == "/v1/rollouts/r1/dead_letters"
    assert isinstance(dead, forkyard.DeadLetter)
    assert dead.status is forkyard.EpisodeStatus.FAILED and dead.reason == "failed"
    assert dead.error == "Policy server unreachable."


# -- pull / ack ---------------------------------------------------------------------------------


async def test_pull_returns_a_typed_batch(twin):
    answer = {"episodes": [training_json(1, seq=1), training_json(2, seq=2)], "cursor": 2, "done": False}
    twin.respond(httpx.Response(200, json=answer))
    batch = await twin.call(
        twin.client.rollouts.pull, "r1", consumer="trainer", max_episodes=8, wait_s=5, visibility_timeout_s=30,
    )
    assert (twin.requests[0].method, twin.requests[0].url.path) == ("POST", "/v1/rollouts/r1/pull")
    assert twin.body() == {"consumer": "trainer", "max_episodes": 8, "wait_s": 5, "visibility_timeout_s": 30}
    assert isinstance(batch, forkyard.EpisodeBatch if twin.kind == "sync" else forkyard.AsyncEpisodeBatch)
    assert len(batch) == 2 and batch.episode_ids == ["e1", "e2"]
    assert (batch.cursor, batch.done, batch.rollout_id, batch.consumer) == (2, False, "r1", "trainer")
    first = batch[0]
    assert isinstance(first, forkyard.Episode)
    assert (first.id, first.seq, first.input_ids, first.loss_mask) == ("e1", 1, [5, 6, 7, 8], [0, 0, 1, 1])
    assert first.logprobs == [-0.1, -0.2] and first.weight_versions == [3, 4]
    assert [e.episode_id for e in batch[1:]] == ["e2"]
    assert list(batch) == batch.episodes


async def test_pull_sends_defaults_and_reports_done(twin):
    twin.respond(httpx.Response(200, json={"episodes": [], "cursor": 9, "done": True}))
    batch = await twin.call(twin.client.rollouts.pull, "r1", consumer="c")
    assert twin.body() == {"consumer": "c", "max_episodes": 16, "wait_s": 0.0}
    assert batch.done and len(batch) == 0 and not batch
    assert await twin.call(batch.ack) == 0
    assert len(twin.requests) == 1, "acking an empty batch sends nothing"


async def test_pull_can_ask_for_redelivery_after_a_crash(twin):
    delivered = {**training_json(3, seq=3), "rollout_id": "r1", "task_id": "t1", "sample_index": 0, "attempt": 1,
                 "delivery_count": 2, "logprobs": [-0.1, None]}
    twin.respond(httpx.Response(200, json={"episodes": [delivered], "cursor": 3, "done": False}))
    batch = await twin.call(twin.client.rollouts.pull, "r1", consumer="c", cursor=2, redeliver=True)
    assert twin.body() == {"consumer": "c", "max_episodes": 16, "wait_s": 0.0, "cursor": 2, "redeliver": True}
    [episode] = batch
    assert (episode.delivery_count, episode.task_id, episode.sample_index) == (2, "t1", 0)
    assert episode.logprobs == [-0.1, None], "a token the server gave no logprob for stays None"


async def test_failed_episodes_are_asked_for_and_arrive_masked_with_their_group_verdict(twin):
    masked = {**training_json(2, seq=2), "loss_mask": [0, 0, 0, 0], "logprobs": [], "reward": None,
              "status": "failed", "outcome": "verifier_error", "error": "verifier_error: the verifier timed out",
              "group_partial": True, "group_reason": "1 of 2 samples failed for good: verifier_error: ..."}
    usable = {**training_json(1, seq=1), "outcome": "reward", "group_partial": True,
              "group_reason": masked["group_reason"]}
    twin.respond(httpx.Response(200, json={"episodes": [usable, masked], "cursor": 2, "done": False}))
    batch = await twin.call(twin.client.rollouts.pull, "r1", consumer="c", include_failed=True)
    assert twin.body() == {"consumer": "c", "max_episodes": 16, "wait_s": 0.0, "include": ["failed"]}
    good, bad = batch
    assert good.outcome is forkyard.EpisodeOutcome.REWARD and not good.masked and good.group_partial
    assert bad.outcome is forkyard.EpisodeOutcome.VERIFIER_ERROR and bad.masked and bad.reward is None
    assert bad.error == "verifier_error: the verifier timed out" and bad.group_reason.startswith("1 of 2 samples")
    with pytest.raises(ValueError, match="no reward"):
        batch.advantages()  # a masked failure is never trained on by accident

    twin.respond(httpx.Response(200, text="event: end\ndata: {}\n\n", headers={"content-type": "text/event-stream"}))
    assert await twin.collect(twin.client.rollouts.stream("r1", consumer="c", include_failed=True)) == []
    assert dict(twin.requests[-1].url.params) == {"consumer": "c", "include": "failed"}
    twin.respond(httpx.Response(201, json=rollout_json(group_spare=1, partial_groups=2,
                                                       failures={"infra": 3, "policy_error": 1})))
    rollout = await twin.call(twin.client.rollouts.create, tasks=["t1"], group_size=4, policy=ORACLE, group_spare=1)
    assert twin.body()["group_spare"] == 1
    assert (rollout.group_spare, rollout.partial_groups, rollout.failures) == (1, 2, {"infra": 3, "policy_error": 1})
    twin.respond(httpx.Response(200, json={"items": [{**episode_info_json(1, "failed"), "outcome": "infra"}]}))
    [info] = await twin.collect(twin.client.episodes.list(rollout_id="r1"))
    assert info.outcome is forkyard.EpisodeOutcome.INFRA


async def test_batch_ack_acks_exactly_its_episodes_for_its_consumer(twin):
    twin.respond(
        httpx.Response(200, json={"episodes": [training_json(1), training_json(2)], "cursor": 2, "done": False}),
        httpx.Response(200, json={"acked": 2}),
    )
    batch = await twin.call(twin.client.rollouts.pull, "r1", consumer="learner-a")
    assert not batch.acked
    assert await twin.call(batch.ack) == 2
    assert batch.acked
    assert twin.requests[1].url.path == "/v1/rollouts/r1/ack"
    assert twin.body() == {"consumer": "learner-a", "episode_ids": ["e1", "e2"]}


async def test_ack_is_resent_after_a_server_error(twin):
    twin.respond(twin.error(503, "unavailable", "Busy."), httpx.Response(200, json={"acked": 1}))
    assert await twin.call(twin.client.rollouts.ack, "r1", consumer="c", episode_ids=["e1"]) == 1
    assert len(twin.requests) == 2 and len(twin.sleeps) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"consumer": ""}, "consumer"),
        ({"consumer": "c", "max_episodes": 0}, "max_episodes"),
        ({"consumer": "c", "wait_s": -1}, "wait_s"),
    ],
)
async def test_pull_refuses_bad_arguments(twin, kwargs, message):
    with pytest.raises(ValueError, match=message):
        await twin.call(twin.client.rollouts.pull, "r1", **kwargs)
    with pytest.raises(ValueError, match="episode_ids"):
        await twin.call(twin.client.rollouts.ack, "r1", consumer="c", episode_ids=["e1", ""])
    assert twin.requests == []


async def test_a_malformed_pull_answer_is_a_validation_error(twin):
    twin.respond(httpx.Response(200, json={"episodes": [{"reward": 1.0}], "cursor": 1, "done": False}))
    with pytest.raises(forkyard.APIResponseValidationError, match="episode_id"):
        await twin.call(twin.client.rollouts.pull, "r1", consumer="c")


def test_batch_groups_and_advantages():
    episodes = [forkyard.Episode.model_validate(training_json(i, group=g, reward=r))
                for i, (g, r) in enumerate([("a", 1.0), ("b", 0.5), ("a", 0.0), ("c", 1.0)])]
    batch = forkyard.EpisodeBatch(episodes, rollout_id="r1", consumer="c", acker=lambda ids: len(ids))
    assert {k: [e.id for e in v] for k, v in batch.groups().items()} == {"a": ["e0", "e2"], "b": ["e1"], "c": ["e3"]}
    assert batch.rewards == [1.0, 0.5, 0.0, 1.0]
    # group a: mean 0.5, sample std sqrt(0.5); groups of one get 0
    expected = 0.5 / (0.5 ** 0.5 + 1e-6)
    assert batch.advantages() == pytest.approx([expected, 0.0, -expected, 0.0])
    assert forkyard.group_advantages([2.0, 2.0, 2.0], ["g", "g", "g"]) == [0.0, 0.0, 0.0]
    no_reward = forkyard.Episode.model_validate(training_json(9, reward=None))
    with pytest.raises(ValueError, match="e9"):
        forkyard.EpisodeBatch([no_reward], rollout_id="r1", consumer="c", acker=len).advantages()


# -- policies --------------------------------------------------------------------------------


async def test_policy_version_pause_resume_get(twin):
    twin.handle(lambda r: httpx.Response(200, json={"name": "qwen", "version": 7, "paused": r.url.path.endswith("pause")}))
    policy = await twin.call(twin.client.policies.set_version, "qwen", 7)
    assert (twin.requests[-1].method, twin.requests[-1].url.path) == ("POST", "/v1/policies/qwen/version")
    assert twin.body() == {"version": 7}
    assert (policy.name, policy.version, policy.paused) == ("qwen", 7, False)
    assert (await twin.call(twin.client.policies.pause, "qwen")).paused
    assert twin.requests[-1].url.path == "/v1/policies/qwen/pause"
    assert not (await twin.call(twin.client.policies.resume, "qwen")).paused
    assert twin.requests[-1].url.path == "/v1/policies/qwen/resume"
    await twin.call(twin.client.policies.get, "qwen")
    assert (twin.requests[-1].method, twin.requests[-1].url.path) == ("GET", "/v1/policies/qwen")
    with pytest.raises(ValueError, match="version"):
        await twin.call(twin.client.policies.set_version, "qwen", -1)


async def test_set_version_is_resent_after_a_dropped_connection(twin):
    twin.respond(httpx.ReadError("reset"), httpx.Response(200, json={"name": "p", "version": 2, "paused": False}))
    assert (await twin.call(twin.client.policies.set_version, "p", 2)).version == 2
    assert len(twin.requests) == 2


# -- episodes -------------------------------------------------------------------------------------


async def test_episodes_list_get_training(twin):
    detail = {
        **episode_info_json(1), "messages": [{"role": "user", "content": "Do it."}],
        "steps": [{"index": 0, "parent_index": None, "text": "<tool_call>...</tool_call>",
                   "action": {"tool": "bash", "arguments": {"command": "ls"}}, "observation": "a b",
                   "reward": None, "finish_reason": "stop", "weight_version": 4,
                   "timings": {"policy_s": 0.1, "env_s": 0.2}}],
        "timings": {"total_s": 3.5}, "weight_versions": [4],
    }
    twin.respond(
        httpx.Response(200, json={"items": [episode_info_json(1), episode_info_json(2, "truncated")], "next": None}),
        httpx.Response(200, json=detail),
        httpx.Response(200, json=training_json(1)),
    )
    listed = await twin.collect(twin.client.episodes.list(rollout_id="r1", status=forkyard.EpisodeStatus.COMPLETED))
    assert dict(twin.requests[0].url.params) == {"rollout_id": "r1", "status": "completed", "limit": "50"}
    assert [(e.id, e.status) for e in listed] == [("e1", forkyard.EpisodeStatus.COMPLETED),
                                                   ("e2", forkyard.EpisodeStatus.TRUNCATED)]
    assert isinstance(listed[0], forkyard.EpisodeInfo) and listed[0].num_turns == 2
    full = await twin.call(twin.client.episodes.get, "e1")
    assert twin.requests[1].url.path == "/v1/episodes/e1"
    assert isinstance(full, forkyard.EpisodeDetail)
    assert full.steps[0].action == {"tool": "bash", "arguments": {"command": "ls"}}
    assert full.steps[0].weight_version == 4 and full.weight_versions == [4]
    training = await twin.call(twin.client.episodes.training, "e1")
    assert twin.requests[2].url.path == "/v1/episodes/e1/training"
    assert isinstance(training, forkyard.Episode) and training.seq is None
    assert sum(training.loss_mask) == len(training.logprobs)


def test_numeric_ids_are_read_as_strings():
    episode = forkyard.Episode.model_validate({**training_json(1), "episode_id": 17, "group_id": 3})
    assert (episode.episode_id, episode.group_id) == ("17", "3")


def test_create_body_holds_only_the_options_given():
    # group_mode given as a plain string is wrapped; nothing else is rewritten.
    from forkyard.resources.rollouts import _create_request

    options = _create_request(
        tasks=["t1"], group_size=2, policy=ORACLE, agent=None, limits=None, max_staleness=None,
        staleness_action="rerun", max_attempts=3, group_mode="complete", group_spare=None, priority=None,
        concurrency=None, branching=None, lazy_fork=None, extra_body=None,
    )
    assert json.loads(json.dumps(options.json)) == {
        "tasks": {"ids": ["t1"]}, "group_size": 2, "policy": ORACLE,
        "staleness_action": "rerun", "max_attempts": 3, "group_mode": {"mode": "complete"},
    }
    tree = _create_request(
        tasks=["t1"], group_size=1, policy=ORACLE, agent=None, limits=None, max_staleness=None,
        staleness_action=None, max_attempts=None, group_mode=None, group_spare=None, priority=None,
        concurrency=None, branching={"at_turns": [2], "fanout": 4}, lazy_fork=False, extra_body=None,
    )
    assert tree.json["branching"] == {"at_turns": [2], "fanout": 4} and tree.json["lazy_fork"] is False
