"""Lazy fork end to end: a group of a task with deterministic tools shares one sandbox until it diverges.

The samples of a group issue the same first actions, then split between two; the
shared actions must run once, and every sample must see exactly the observations it
sees when it runs alone (the uncached reference).
"""

from __future__ import annotations

import shutil

import pytest

import forkyard
from tests.e2e.test_branching import env_steps
from tests.e2e.test_rollouts import wait_done
from tests.e2e.test_terminal_tasks import TASKS_DIR

SHARED = [
    {"tool": "bash", "arguments": {"command": "mkdir -p /work/lazy && cd /work/lazy && echo base > f.txt && ls"}},
    {"tool": "bash", "arguments": {"command": "echo shared >> f.txt && export LAZY=shared && cat f.txt"}},
]
SPLIT = {"one_of": [
    {"tool": "bash", "arguments": {"command": "echo left >> f.txt && export LAZY=left && cat f.txt"}},
    {"tool": "bash", "arguments": {"command": "echo right >> f.txt && export LAZY=right && cat f.txt"}},
]}
AFTER = [
    {"tool": "bash", "arguments": {"command": 'echo "$PWD|$LAZY|$(tr "\\n" " " < f.txt)"'}},
    {"tool": "submit", "arguments": {}},
]


@pytest.fixture(scope="module")
def client(live_gateway):
    with forkyard.Client(base_url=live_gateway.url, api_key=live_gateway.api_key, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def task_id(client, tmp_path_factory):
    """edit-config, declared deterministic."""
    root = tmp_path_factory.mktemp("lazy-task") / "edit-config-deterministic"
    shutil.copytree(TASKS_DIR / "edit-config", root)
    toml = (root / "task.toml").read_text()
    assert "[environment]" in toml
    (root / "task.toml").write_text(toml.replace("[environment]", "[environment]\ndeterministic_tools = true"))
    (task,) = client.tasks.import_dir(root)
    return task.id


def observations(client, episode_id: str) -> list[str]:
    return [s.observation for s in client.episodes.get(episode_id).steps]


def test_identical_actions_run_once_and_observations_match_the_uncached_run(client, task_id, live_gateway):
    before = env_steps(live_gateway)
    policy = {"name": "lazy", "api": "scripted", "actions": [*SHARED, SPLIT, *AFTER], "sampling": {"seed": 11}}
    rollout = client.rollouts.create(tasks=[task_id], group_size=4, policy=policy, agent={"max_turns": 8})
    assert wait_done(client, rollout.id).status == "completed"
    executed = env_steps(live_gateway) - before
    episodes = list(client.episodes.list(rollout_id=rollout.id))
    assert len(episodes) == 4 and {e.status for e in episodes} == {"completed"}
    details = {e.id: client.episodes.get(e.id) for e in episodes}
    choices = {eid: d.steps[2].action["arguments"]["command"] for eid, d in details.items()}
    distinct = len(set(choices.values()))
    # The two shared turns ran once; the split and everything after it once per distinct choice.
    assert executed == 2 + 3 * distinct < 4 * 5

    # Reference: each distinct action sequence run alone, without sharing.
    for command in set(choices.values()):
        actions = [*SHARED, {"tool": "bash", "arguments": {"command": command}}, *AFTER]
        ref = client.rollouts.create(tasks=[task_id], group_size=1, lazy_fork=False, agent={"max_turns": 8},
                                     policy={"name": "lazy-ref", "api": "scripted", "actions": actions})
        wait_done(client, ref.id)
        (ref_episode,) = client.episodes.list(rollout_id=ref.id)
        expected = observations(client, ref_episode.id)
        for eid, chosen in choices.items():
            if chosen == command:
                assert observations(client, eid) == expected
                assert details[eid].reward == ref_episode.reward
    side = {c.split()[1] for c in choices.values()}
    for eid, d in details.items():
        mine = choices[eid].split()[1]
        assert d.steps[3].observation.startswith(f"/work/lazy|{mine}|base shared {mine} \n"), d.steps[3].observation
    assert side <= {"left", "right"}


def test_a_group_whose_image_cannot_build_fails_its_episodes(client, tmp_path):
    """The shared group builds the image once, before any member runs: a failed build fails every member."""
    root = tmp_path / "broken-deterministic"
    shutil.copytree(TASKS_DIR / "edit-config", root)
    toml = (root / "task.toml").read_text()
    (root / "task.toml").write_text(toml.replace("[environment]", "[environment]\ndeterministic_tools = true"))
    dockerfile = root / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "RUN echo 'this build fails' && exit 3\n")
    (task,) = client.tasks.import_dir(root)
    policy = {"name": "lazy-broken", "api": "scripted", "actions": [*SHARED, *AFTER]}
    rollout = client.rollouts.create(tasks=[task.id], group_size=3, policy=policy, agent={"max_turns": 4},
                                     max_attempts=1)  # an infra failure is retried while attempts remain
    final = wait_done(client, rollout.id, timeout_s=120)  # it used to never end: the members stayed running
    assert final.progress.finished == final.progress.total == 3
    assert final.partial_groups == 1 and final.failures == {"infra": 3}  # completed, visibly short
    episodes = list(client.episodes.list(rollout_id=rollout.id))
    assert len(episodes) == 3 and {e.status for e in episodes} == {"failed"}
    for episode in episodes:
        detail = client.episodes.get(episode.id)
        assert "RUN failed with exit code 3" in detail.error
        assert detail.info["infra"] is True and detail.outcome == "infra"  # the image's failure, not the policy's
