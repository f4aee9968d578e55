"""Managed rollouts end to end: a live `forkyard up`, the SDK, real sandboxes, the scripted policy."""

from __future__ import annotations

import contextlib
import sqlite3
import time

import httpx
import pytest

import forkyard
from tests.e2e.test_terminal_tasks import TASK_NAMES, TASKS_DIR

ORACLE = {"name": "oracle", "api": "scripted", "model": "oracle"}


@pytest.fixture(scope="module")
def client(live_gateway):
    with forkyard.Client(base_url=live_gateway.url, api_key=live_gateway.api_key, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def task_ids(client):
    return {t.name: t.id for t in client.tasks.import_dir(TASKS_DIR)}


def wait_done(client, rollout_id, timeout_s=300):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = client.rollouts.get(rollout_id)
        if r.status in ("completed", "cancelled", "failed"):
            return r
        time.sleep(0.5)
    raise AssertionError(f"rollout {rollout_id} did not finish in {timeout_s}s")


def test_oracle_rollout_streams_every_group_with_reward_one(client, task_ids, live_gateway):
    names = TASK_NAMES[:3]
    rollout = client.rollouts.create(
        tasks={"ids": [task_ids[n] for n in names]}, group_size=2, policy=ORACLE,
        agent={"max_turns": 4}, limits={"episode_timeout_s": 300, "step_timeout_s": 120},
    )
    seen = []
    for batch in client.rollouts.stream(rollout.id, consumer="trainer", batch_size=4):
        seen.extend(batch)
        batch.ack()
    assert len(seen) == len(names) * 2
    assert {e.reward for e in seen} == {1.0}
    groups = {}
    for e in seen:
        groups.setdefault(e.group_id, []).append(e)
    assert sorted(len(g) for g in groups.values()) == [2] * len(names)
    final = client.rollouts.get(rollout.id)
    assert final.status == "completed"
    # Every episode is stored with its steps and timings.
    episodes = list(client.episodes.list(rollout_id=rollout.id))
    assert len(episodes) == len(seen) and all(e.status == "completed" for e in episodes)
    detail = client.episodes.get(episodes[0].id)
    assert [s.action["tool"] for s in detail.steps] == ["bash", "submit"]
    assert {"setup_s", "agent_s", "verify_s", "total_s"} <= set(detail.timings)
    # Each episode's sandbox lived a second or two, less than a heartbeat (5 s), and still has its row.
    rows: list = []
    with contextlib.closing(sqlite3.connect(live_gateway.data_dir / "forkyard.db")) as db:
        for _ in range(40):  # bounded: 20 s, the next heartbeat or two
            rows = db.execute("SELECT owner_id, state, gone_at IS NOT NULL FROM sandbox "
                              "WHERE owner_kind = 'episode' AND rollout_id = ?", (rollout.id,)).fetchall()
            if len(rows) >= len(episodes) and all(gone for *_, gone in rows):
                break
            time.sleep(0.5)
    assert {owner for owner, *_ in rows} == {e.id for e in episodes}
    assert {(state, gone) for _, state, gone in rows} == {("gone", 1)}


def test_pull_ack_and_redelivery(client, task_ids):
    rollout = client.rollouts.create(
        tasks={"ids": [task_ids[TASK_NAMES[0]]]}, group_size=2, policy=ORACLE, agent={"max_turns": 4},
    )
    wait_done(client, rollout.id)
    first = client.rollouts.pull(rollout.id, consumer="c", max_episodes=8, visibility_timeout_s=0.5)
    assert len(first) == 2
    time.sleep(1.0)  # the lease expires unacked: the same episodes come back
    again = client.rollouts.pull(rollout.id, consumer="c", max_episodes=8, visibility_timeout_s=30)
    assert sorted(e.episode_id for e in again) == sorted(e.episode_id for e in first)
    again.ack()
    assert len(client.rollouts.pull(rollout.id, consumer="c", max_episodes=8)) == 0
    # Another consumer group gets its own copy of the stream.
    assert len(client.rollouts.pull(rollout.id, consumer="other", max_episodes=8)) == 2


def test_wrong_actions_score_zero_and_unreachable_server_fails_visibly(client, task_ids):
    wrong = client.rollouts.create(
        tasks={"ids": [task_ids[TASK_NAMES[0]]]}, group_size=1,
        policy={"name": "wrong", "api": "scripted", "model": "x", "actions": [{"tool": "submit", "arguments": {}}]},
    )
    dead = client.rollouts.create(
        tasks={"ids": [task_ids[TASK_NAMES[0]]]}, group_size=2,
        policy={"name": "dead", "api": "chat", "model": "m", "base_urls": ["http://127.0.0.1:9"]},
        limits={"step_timeout_s": 10},
    )
    assert wait_done(client, wrong.id).status == "completed"
    [ep] = client.rollouts.pull(wrong.id, consumer="t")
    assert ep.reward == 0.0
    assert wait_done(client, dead.id).status == "completed"
    letters = list(client.rollouts.dead_letters(dead.id))
    assert len(letters) == 2 and all("127.0.0.1:9" in (e.error or "") for e in letters)


def test_a_verifier_timeout_never_reaches_the_trainer_as_zero(client, tmp_path):
    """A verifier that times out is the task's failure: retried, never trained on, its group flagged.

    Before typed outcomes, each of these episodes streamed to the trainer with reward 0.0.
    """
    task = tmp_path / "slow-verifier"
    for rel, text in {
        "instruction.md": "Do nothing.\n",
        "task.toml": "[verifier]\ntimeout_sec = 2\n",
        "environment/Dockerfile": "FROM ubuntu:24.04\n",
        "tests/test.sh": "#!/bin/bash\nsleep 60\n",
        "solution/solve.sh": "#!/bin/bash\ntrue\n",
    }.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(text)
    [slow] = client.tasks.import_dir(task)
    rollout = client.rollouts.create(tasks={"ids": [slow.id]}, group_size=2, policy=ORACLE, max_attempts=2,
                                     agent={"max_turns": 4})
    trained = [e for batch in client.rollouts.stream(rollout.id, consumer="trainer", batch_size=4) for e in batch]
    assert trained == []
    final = client.rollouts.get(rollout.id)
    assert final.status == "completed" and final.partial_groups == 1
    assert final.failures == {"verifier_error": 4}  # two samples, two attempts each
    masked = client.rollouts.pull(rollout.id, consumer="inspect", max_episodes=8, include_failed=True)
    assert len(masked) == 4
    assert all(e.masked and e.reward is None and e.outcome == "verifier_error" and not any(e.loss_mask)
               for e in masked), masked
    assert all(e.group_partial and "verifier_error" in (e.group_reason or "") for e in masked)


def test_bad_rollout_requests_are_clear_4xx(client, task_ids, live_gateway):
    # The SDK refuses group_size 0 itself; the gateway must too, for any client.
    with pytest.raises(ValueError, match="group_size"):
        client.rollouts.create(tasks={"ids": [task_ids[TASK_NAMES[0]]]}, group_size=0, policy=ORACLE)
    headers = {"Authorization": f"Bearer {live_gateway.api_key}"}
    body = {"tasks": {"ids": [task_ids[TASK_NAMES[0]]]}, "group_size": 0, "policy": ORACLE}
    r = httpx.post(f"{live_gateway.url}/v1/rollouts", json=body, headers=headers)
    assert r.status_code == 422 and "group_size" in r.json()["error"]["message"]
    with pytest.raises(forkyard.UnprocessableEntityError, match="task_nope"):
        client.rollouts.create(tasks={"ids": ["task_nope"]}, group_size=1, policy=ORACLE)


def test_cancel_stops_a_rollout(client, task_ids):
    slow = [{"tool": "bash", "arguments": {"command": "sleep 30"}}, {"tool": "submit", "arguments": {}}]
    rollout = client.rollouts.create(
        tasks={"ids": [task_ids[TASK_NAMES[0]]]}, group_size=2,
        policy={"name": "slow", "api": "scripted", "model": "x", "actions": slow},
    )
    time.sleep(2)
    client.rollouts.cancel(rollout.id)
    final = wait_done(client, rollout.id, timeout_s=60)
    assert final.status == "cancelled"
    assert all(e.status == "failed" for e in client.episodes.list(rollout_id=rollout.id))


def test_pause_holds_policy_calls_until_resume(client, task_ids):
    client.policies.pause("paused-policy")
    rollout = client.rollouts.create(
        tasks={"ids": [task_ids[TASK_NAMES[0]]]}, group_size=2,
        policy={**ORACLE, "name": "paused-policy"}, agent={"max_turns": 4},
    )
    time.sleep(2.0)
    assert all(e.num_turns == 0 for e in client.episodes.list(rollout_id=rollout.id))
    assert client.rollouts.get(rollout.id).status in ("queued", "running")
    client.policies.resume("paused-policy")
    assert wait_done(client, rollout.id).status == "completed"
    assert {e.reward for e in client.episodes.list(rollout_id=rollout.id)} == {1.0}


def test_a_drained_node_starts_no_episode_until_undrained(client, task_ids, live_gateway):
    (node,) = [n for n in client.nodes.list() if n.state == "up"]
    assert node.backend == live_gateway.backend
    assert client.nodes.drain(node.name).state == "draining"
    try:
        rollout = client.rollouts.create(tasks={"ids": [task_ids[TASK_NAMES[0]]]}, group_size=2, policy=ORACLE,
                                         agent={"max_turns": 4})
        time.sleep(2.0)
        assert {e.status for e in client.episodes.list(rollout_id=rollout.id)} == {"queued"}
    finally:
        assert client.nodes.undrain(node.name).state == "up"
    assert wait_done(client, rollout.id).status == "completed"
    assert {e.reward for e in client.episodes.list(rollout_id=rollout.id)} == {1.0}


def test_staleness_is_enforced_at_dispatch(client, task_ids):
    slow = [{"tool": "bash", "arguments": {"command": "sleep 4"}}, {"tool": "submit", "arguments": {}}]
    rollout = client.rollouts.create(
        tasks={"ids": [task_ids[TASK_NAMES[0]]]}, group_size=1,
        policy={"name": "stale-policy", "api": "scripted", "model": "x", "actions": slow},
        max_staleness=0, staleness_action="dead_letter",
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        [ep] = list(client.episodes.list(rollout_id=rollout.id))
        if ep.status == "running":
            break
        time.sleep(0.1)
    time.sleep(1.5)  # the first turn is stamped with version 0 and its command is running
    client.policies.set_version("stale-policy", 1)
    assert wait_done(client, rollout.id).status == "completed"
    [letter] = list(client.rollouts.dead_letters(rollout.id))
    assert letter.status == "stale" and "dispatch" in (letter.error or "")
    assert client.rollouts.pull(rollout.id, consumer="t").episode_ids == []
