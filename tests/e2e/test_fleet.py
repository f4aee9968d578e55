"""The distributed mode with real processes: two `forkyard gateway`s and three `forkyard worker`s.

They share a fresh PostgreSQL database and a private Redis (so a test may restart it);
episodes run on real local sandboxes. Every rollout must be delivered exactly once, whatever
fails: a worker SIGKILLed, Redis restarted, a gateway SIGKILLed, a node drained, a job
delivered twice. Nothing may be left behind on any node.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import pytest

import forkyard
from gateway.fleet.queues import RUN_EPISODE, celery_app, node_queue
from tests.conftest import leftover_sandboxes
from tests.e2e.test_terminal_tasks import TASK_NAMES, TASKS_DIR
from tests.fleet import Fleet, fleet
from tests.live import ROOT, wait_for

pytestmark = pytest.mark.local

NODES = ("w1", "w2", "w3")
ORACLE = {"name": "oracle", "api": "scripted", "model": "oracle"}
#: Episodes that take a few seconds, so a fault lands while they run (reward 0: delivery is what counts).
SLOW = {"name": "slow", "api": "scripted", "model": "slow",
        "actions": [{"tool": "bash", "arguments": {"command": "sleep 3"}}, {"tool": "submit", "arguments": {}}]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("fleet")
    env = {"FORKYARD_NODES__HEARTBEAT_S": "1", "FORKYARD_FLEET__REDISPATCH_S": "5"}
    with fleet(workdir, env=env) as f:
        f.start_gateway("a")
        f.start_gateway("b")
        for node in NODES:
            f.start_worker(node, capacity=4)
        yield f
        for node in NODES:
            f.workers[node].stop()
        for node in NODES:  # every sandbox of every node is gone, the crashed one's included
            assert leftover_sandboxes("local", node, f.data_dir(node)) == [], node


def client_of(cluster: Fleet, gateway: str) -> forkyard.Client:
    return forkyard.Client(base_url=cluster.url(gateway), api_key=cluster.api_key, timeout=120)


@pytest.fixture(scope="module")
def task_ids(cluster) -> dict[str, str]:
    with client_of(cluster, "a") as client:
        return {t.name: t.id for t in client.tasks.import_dir(TASKS_DIR)}


def nodes(cluster: Fleet, gateway: str = "b") -> dict[str, dict]:
    r = httpx.get(f"{cluster.url(gateway)}/v1/nodes", headers={"Authorization": f"Bearer {cluster.api_key}"})
    r.raise_for_status()
    assert "channel_token" not in r.text  # the nodes' channel secrets stay in the database
    return {n["name"]: n for n in r.json()["items"]}


def deliver_all(client: forkyard.Client, rollout_id: str, expected: int, consumer: str = "trainer") -> list:
    """Stream the whole rollout; check every (group, sample) arrives exactly once."""
    seen = []
    for batch in client.rollouts.stream(rollout_id, consumer=consumer, batch_size=8):
        seen.extend(batch)
        batch.ack()
    ids = [e.episode_id for e in seen]
    samples = [(e.group_id, e.sample_index) for e in seen]
    assert len(ids) == len(set(ids)), "an episode was delivered twice"
    assert len(samples) == len(set(samples)) == expected, f"{len(set(samples))} of {expected} samples delivered"
    return seen


def running_on(client: forkyard.Client, rollout_id: str, node: str) -> list:
    return [e for e in client.episodes.list(rollout_id=rollout_id, status="running") if e.node == node]


def test_rollout_is_delivered_exactly_once_through_either_gateway(cluster, task_ids):
    names = TASK_NAMES[:7]
    with client_of(cluster, "a") as a, client_of(cluster, "b") as b:
        rollout = a.rollouts.create(tasks={"ids": [task_ids[n] for n in names]}, group_size=8, policy=ORACLE,
                                    agent={"max_turns": 4})
        seen = deliver_all(b, rollout.id, expected=7 * 8)
        assert {e.reward for e in seen} == {1.0}
        episodes = list(b.episodes.list(rollout_id=rollout.id))
        used = {e.node for e in episodes}
        assert used <= set(NODES) and len(used) >= 2, f"episodes ran on {used}"
        assert b.rollouts.get(rollout.id).status == "completed"
    for gateway in ("a", "b"):
        listed = nodes(cluster, gateway)
        assert {listed[n]["state"] for n in NODES} == {"up"}
        assert {listed[n]["capacity"] for n in NODES} == {4}
    # The nodes' counts arrive with their next heartbeat.
    wait_for(lambda: sum(nodes(cluster)[n]["load"]["jobs"]["ran"] for n in NODES) >= 7 * 8, 10, "the jobs' counts")


def test_repeated_tasks_claim_warm_sandboxes_from_the_nodes_pools(cluster, task_ids):
    # The rollout before asked for these tasks' sandboxes, so every node keeps some started for them.
    def pools() -> dict[str, dict]:
        return {n: node["load"]["pool"] for n, node in nodes(cluster).items() if n in NODES}

    wait_for(lambda: sum(p["idle"] for p in pools().values()) >= len(NODES), 60, "the pools to fill")
    before = pools()
    assert all(p["max_idle"] == 4 for p in before.values()), "a node pools up to its capacity by default"
    names = TASK_NAMES[:3]
    with client_of(cluster, "a") as client:
        rollout = client.rollouts.create(tasks={"ids": [task_ids[n] for n in names]}, group_size=4, policy=ORACLE,
                                         agent={"max_turns": 4})
        assert {e.reward for e in deliver_all(client, rollout.id, expected=3 * 4)} == {1.0}
    wait_for(lambda: sum(p["hits"] for p in pools().values()) > sum(p["hits"] for p in before.values()), 10,
             "claims from the pools")
    after = pools()
    assert sum(p["fill_failures"] for p in after.values()) == 0


def test_a_duplicate_delivery_exits_without_running(cluster, task_ids):
    celery = celery_app(cluster.redis.url, visibility_timeout_s=3600)
    with client_of(cluster, "b") as client:
        before = sum(nodes(cluster)[n]["load"]["jobs"]["duplicate"] for n in NODES)
        rollout = client.rollouts.create(tasks={"ids": [task_ids[TASK_NAMES[0]]]}, group_size=1, policy=ORACLE,
                                         agent={"max_turns": 4})
        [episode] = list(client.episodes.list(rollout_id=rollout.id))
        for node in NODES:  # the scheduler sends it once; three more copies race it
            celery.send_task(RUN_EPISODE, args=[rollout.id, episode.id], queue=node_queue(node))
        [delivered] = deliver_all(client, rollout.id, expected=1)
        assert delivered.episode_id == episode.id and delivered.reward == 1.0
        [only] = list(client.episodes.list(rollout_id=rollout.id))
        assert only.attempt == 1 and only.status == "completed"
        wait_for(lambda: sum(nodes(cluster)[n]["load"]["jobs"]["duplicate"] for n in NODES) >= before + 3, 30,
                 "the three copies to be refused")
    celery.close()


def test_a_session_opened_through_one_gateway_is_stepped_through_another(cluster, task_ids):
    name = TASK_NAMES[0]
    with client_of(cluster, "a") as a, client_of(cluster, "b") as b:
        session = a.sessions.create(task_ids[name])
        info = b.sessions.get(session.id)
        assert info.state == "open"
        first = b.sessions.step(session.id, "bash", command="echo $((6 * 7)) && pwd")
        assert "42" in first.observation and not first.terminated
        b.sessions.step(session.id, "bash", command="cd /tmp && export FLEET=yes")
        second = a.sessions.step(session.id, "bash", command="pwd; echo $FLEET")  # the shell persists across gateways
        assert "/tmp" in second.observation and "yes" in second.observation
        sandboxes = httpx.get(f"{cluster.url('b')}/v1/sandboxes", headers={"Authorization": f"Bearer {cluster.api_key}"})
        assert sandboxes.status_code == 200
        assert [s for s in sandboxes.json()["items"] if s.get("session_id") == session.id]
        # A snapshot taken through B forks through A, on the node holding it; the forks go their own ways.
        snapshot = b.sessions.snapshot(session.id)
        forks = a.snapshots.fork(snapshot.id, n=2)
        assert len(forks) == 2
        for i, fork in enumerate(forks):
            out = b.sessions.step(fork.id, "bash", command=f"echo branch{i} > mine && pwd && echo $FLEET")
            assert "/tmp" in out.observation and "yes" in out.observation
        assert "branch1" in a.sessions.step(forks[1].id, "bash", command="cat mine").observation
        assert "No such file" in a.sessions.step(session.id, "bash", command="cat mine").observation
        for one in [session, *forks]:
            b.sessions.close(one.id)
            assert a.sessions.get(one.id).state == "closed"
        a.snapshots.delete(snapshot.id)


def test_a_web_session_on_a_node_sends_its_screenshots_over_the_node_channel(cluster):
    """Chromium on a worker node; each step's PNG crosses the node channel and is served by either gateway."""
    with client_of(cluster, "a") as a, client_of(cluster, "b") as b:
        (task,) = a.tasks.import_dir(ROOT / "examples" / "tasks" / "web" / "fill-form", environment="web")
        session = a.sessions.create(task.id)  # the node builds the web image on first use
        step = b.sessions.step(session.id, "fill", bid="name", text="Ada Lovelace")
        (link,) = step.info["artifacts"]
        png = a.artifacts.get(link["id"])
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) == link["bytes"]
        a.sessions.step(session.id, "fill", bid="email", text="ada@example.org")
        result = b.sessions.step(session.id, "click", bid="send")
        assert result.terminated and result.reward == 1.0, result.info


def test_cancel_stops_the_episodes_running_on_the_nodes_at_once(cluster, task_ids):
    hanging = {"name": "hanging", "api": "scripted", "model": "x",
               "actions": [{"tool": "bash", "arguments": {"command": "sleep 120"}}, {"tool": "submit", "arguments": {}}]}
    with client_of(cluster, "a") as a, client_of(cluster, "b") as b:
        rollout = a.rollouts.create(tasks={"ids": [task_ids[n] for n in TASK_NAMES[:2]]}, group_size=3,
                                    policy=hanging, agent={"max_turns": 4})
        wait_for(lambda: len(list(b.episodes.list(rollout_id=rollout.id, status="running"))) == 6, 60,
                 "all six episodes running")
        started = time.monotonic()
        b.rollouts.cancel(rollout.id)  # through the other gateway: the nodes hear it over Redis
        wait_for(lambda: not list(a.episodes.list(rollout_id=rollout.id, status="running")), 30,
                 "no episode running")
        assert time.monotonic() - started < 30, "stopped long before the commands' 120 s"
        assert a.rollouts.get(rollout.id).status == "cancelled"
        assert {e.status for e in a.episodes.list(rollout_id=rollout.id)} == {"failed"}
    wait_for(lambda: sum(nodes(cluster)[n]["load"]["episodes"] for n in NODES) == 0, 10, "the nodes idle")


def test_a_worker_killed_mid_rollout_loses_nothing(cluster, task_ids):
    victim = "w3"
    with client_of(cluster, "a") as client:
        rollout = client.rollouts.create(tasks={"ids": [task_ids[n] for n in TASK_NAMES[:3]]}, group_size=4,
                                         policy=SLOW, agent={"max_turns": 4})
        wait_for(lambda: running_on(client, rollout.id, victim), 60, f"an episode running on {victim}")
        cluster.workers[victim].kill()
        seen = {e.episode_id for e in deliver_all(client, rollout.id, expected=3 * 4)}
        assert all(e.node != victim for e in client.episodes.list(rollout_id=rollout.id) if e.id in seen)
        interrupted = [e for e in client.episodes.list(rollout_id=rollout.id, status="failed")
                       if e.node == victim]
        assert interrupted and all(f"node {victim} is down" in (e.error or "") for e in interrupted)
        assert all(client.episodes.get(e.id).info.get("infra") is True for e in interrupted), "the node's fault"
        assert nodes(cluster)[victim]["state"] == "down"
    # Back with the same name and data dir: it reaps what the crash left, and takes work again.
    cluster.start_worker(victim, capacity=4)
    assert leftover_sandboxes("local", victim, cluster.data_dir(victim)) == []
    assert nodes(cluster)[victim]["state"] == "up"


def test_redis_restarting_mid_rollout_loses_nothing(cluster, task_ids):
    with client_of(cluster, "b") as client:
        rollout = client.rollouts.create(tasks={"ids": [task_ids[n] for n in TASK_NAMES[:4]]}, group_size=4,
                                         policy=SLOW, agent={"max_turns": 4}, concurrency=6)
        wait_for(lambda: list(client.episodes.list(rollout_id=rollout.id, status="running")), 60,
                 "an episode running")
        cluster.redis.restart()  # every job still queued in Redis is lost
        deliver_all(client, rollout.id, expected=4 * 4)
        assert client.rollouts.get(rollout.id).status == "completed"


def test_a_gateway_killed_mid_rollout_loses_nothing(cluster, task_ids):
    with client_of(cluster, "a") as a, client_of(cluster, "b") as b:
        rollout = a.rollouts.create(tasks={"ids": [task_ids[n] for n in TASK_NAMES[:3]]}, group_size=4,
                                    policy=SLOW, agent={"max_turns": 4}, concurrency=4)
        wait_for(lambda: list(b.episodes.list(rollout_id=rollout.id, status="running")), 60, "an episode running")
        cluster.gateways["a"].kill()
        deliver_all(b, rollout.id, expected=3 * 4)
    cluster.start_gateway("a")


def test_a_drained_node_finishes_what_runs_and_takes_nothing_new(cluster, task_ids):
    node = "w1"
    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    with client_of(cluster, "a") as client:
        rollout = client.rollouts.create(tasks={"ids": [task_ids[n] for n in TASK_NAMES[:3]]}, group_size=4,
                                         policy=SLOW, agent={"max_turns": 4})
        wait_for(lambda: running_on(client, rollout.id, node), 60, f"an episode running on {node}")
        r = httpx.post(f"{cluster.url('b')}/v1/nodes/{node}/drain", headers=headers)
        assert r.status_code == 200 and r.json()["state"] == "draining"
        drained_at = datetime.now(UTC)
        deliver_all(client, rollout.id, expected=3 * 4)
        episodes = list(client.episodes.list(rollout_id=rollout.id))
        on_node = [e for e in episodes if e.node == node]
        assert on_node and all(e.status == "completed" for e in on_node), "what ran there finished"
        assert all(e.started_at < drained_at for e in on_node), "nothing new started on the drained node"
        assert httpx.post(f"{cluster.url('a')}/v1/nodes/{node}/undrain", headers=headers).json()["state"] == "up"
