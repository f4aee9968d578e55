"""Branching rollouts end to end: trajectory trees on a live gateway, both backends, real sandboxes.

The scripted policy replays a fixed trunk and picks each branch's action with ``one_of``,
so the branches of a tree really diverge in their sandboxes.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

import forkyard
from sandboxes.backends import create_backend
from tests.e2e.test_rollouts import wait_done
from tests.e2e.test_terminal_tasks import TASKS_DIR

TASK = "edit-config"
TRUNK = [
    {"tool": "bash", "arguments": {"command": "mkdir -p /work/tree && cd /work/tree && echo trunk > log.txt"}},
    {"tool": "bash", "arguments": {"command": "echo step1 >> log.txt && export TREE_VAR=shared"}},
]
BRANCH = [
    {"one_of": [{"tool": "bash", "arguments": {"command": f"echo {x} >> log.txt && export TREE_VAR={x}"}}
                for x in ("alpha", "beta", "gamma", "delta")]},
    {"tool": "bash", "arguments": {"command": 'echo "$PWD|$TREE_VAR|$(tr "\\n" " " < log.txt)"'}},
    {"tool": "submit", "arguments": {}},
]
POLICY = {"name": "tree-script", "api": "scripted", "actions": TRUNK + BRANCH, "sampling": {"seed": 3}}


@pytest.fixture(scope="module")
def client(live_gateway):
    with forkyard.Client(base_url=live_gateway.url, api_key=live_gateway.api_key, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def task_id(client):
    (task,) = client.tasks.import_dir(TASKS_DIR / TASK)
    return task.id


def env_steps(gateway) -> float:
    text = httpx.get(f"{gateway.url}/metrics", headers={"Authorization": f"Bearer {gateway.api_key}"},
                     timeout=30).text
    match = re.search(r"^forkyard_env_steps_total (\S+)$", text, re.M)
    assert match, text
    return float(match.group(1))


def tree_snapshots(gateway) -> list[str]:
    """Snapshots a trajectory tree took that still exist on the gateway's node."""

    async def ids() -> list[str]:
        backend = create_backend(gateway.backend, node=gateway.node, root_dir=gateway.data_dir / "sandboxes")
        try:
            return [s.id for s in await backend.list_snapshots() if "forkyard.tree" in s.metadata]
        finally:
            await backend.aclose()

    return asyncio.run(ids())


def test_fork_at_turn_two_runs_the_shared_prefix_once(client, task_id, live_gateway):
    before = env_steps(live_gateway)
    rollout = client.rollouts.create(
        tasks=[task_id], group_size=2, policy=POLICY, agent={"max_turns": 8},
        branching={"at_turns": [2], "fanout": 3}, limits={"episode_timeout_s": 300, "step_timeout_s": 60},
    )
    assert rollout.branching == {"at_turns": [2], "fanout": 3}
    delivered = []
    for batch in client.rollouts.stream(rollout.id, consumer="trainer", batch_size=8):
        delivered.extend(batch)
        batch.ack()
    final = wait_done(client, rollout.id)
    assert final.status == "completed" and final.progress.total == final.progress.finished == 2

    # Two trees (group_size 2), three leaves each; group_id groups the leaves of one tree.
    assert len(delivered) == 6
    groups: dict[str, list] = {}
    for ep in delivered:
        groups.setdefault(ep.group_id, []).append(ep)
    assert sorted(len(g) for g in groups.values()) == [3, 3]

    executed = 0
    for leaves in groups.values():
        tree = client.episodes.tree(leaves[0].episode_id)
        root = tree.root_episode_id
        assert {leaf["episode_id"] for leaf in tree.leaves} == {ep.episode_id for ep in leaves}
        # root + trunk's 5 steps + 2 branches x 3 steps; one branch point (after turn 1) with 3 children.
        assert len(tree.nodes) == 1 + 5 + 2 * 3 and len(tree.edges) == len(tree.nodes) - 1
        assert tree.branch_points == [{"node": f"{root}:1", "children": 3}]
        infos = {e.id: e for e in client.episodes.list(rollout_id=rollout.id) if e.root_episode_id == root}
        assert len(infos) == 3
        executed += sum(e.num_turns for e in infos.values())
        for leaf in leaves:
            info = infos[leaf.episode_id]
            detail = client.episodes.get(leaf.episode_id)
            assert [s.index for s in detail.steps] == [0, 1, 2, 3, 4]
            owners = [s.episode_id for s in detail.steps]
            if leaf.episode_id == root:
                assert info.parent_episode_id is None and owners == [root] * 5
            else:
                assert info.parent_episode_id == root and info.branch_turn == 2 and info.num_turns == 3
                assert owners == [root, root] + [leaf.episode_id] * 3
            # Each branch sees the shared prefix and only its own edit; cwd and exports carried over.
            mine = detail.steps[2].action["arguments"]["command"].split()[1]
            assert detail.steps[3].observation.startswith(f"/work/tree|{mine}|trunk step1 {mine} \n"), \
                detail.steps[3].observation
            assert [s["shared_by"] for s in leaf.segments] == [3, 1]
            assert leaf.segments[0]["episode_id"] == root and leaf.segments[0]["last_turn"] == 1
    # The shared prefix ran once per tree: 5 + 3 + 3 steps, not 3 x 5.
    assert executed == 2 * 11
    assert env_steps(live_gateway) - before == 2 * 11
    assert tree_snapshots(live_gateway) == []  # the tree's snapshots are freed when its last branch ends
    client.rollouts.delete(rollout.id)
    with pytest.raises(forkyard.NotFoundError):
        client.episodes.tree(delivered[0].episode_id)


def test_nested_branching_respects_the_episode_budget(client, task_id, live_gateway):
    rollout = client.rollouts.create(
        tasks=[task_id], group_size=1, policy=POLICY, agent={"max_turns": 8},
        branching={"at_turns": [1, 3], "fanout": 2, "max_episodes": 3},
    )
    wait_done(client, rollout.id)
    episodes = list(client.episodes.list(rollout_id=rollout.id))
    assert len(episodes) == 3 and {e.status for e in episodes} == {"completed"}
    tree = client.episodes.tree(episodes[0].id)
    assert len(tree.leaves) == 3
    assert sorted(b["children"] for b in tree.branch_points) == [2, 2]  # two forks, then the budget ran out
    text = tree.render_text()
    assert text.count("=> reward") == 3
    assert "<svg" in tree.render_svg()
    assert tree_snapshots(live_gateway) == []


def test_branching_requests_are_validated(client, task_id):
    bad = [
        ({"at_turns": [2, 1]}, "strictly increasing"),
        ({"at_turns": [9]}, "max_turns"),
        ({"at_turns": [1], "adaptive": {"budget": 2, "min_entropy": 1.0}}, "either"),
        ({"adaptive": {"budget": 2, "min_entropy": 1.0}}, "logprobs"),
        ({"at_turns": [1, 2, 3], "fanout": 16}, "max_episodes"),
    ]
    for branching, message in bad:
        with pytest.raises(forkyard.UnprocessableEntityError, match=message):
            client.rollouts.create(tasks=[task_id], group_size=1, policy=POLICY, agent={"max_turns": 8},
                                   branching=branching)
