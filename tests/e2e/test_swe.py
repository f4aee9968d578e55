"""SWE instances end to end: `forkyard repos add`, `forkyard tasks import x.jsonl`, sessions and rollouts via the SDK."""

from __future__ import annotations

import json
import subprocess

import pytest

import forkyard
from tests.live import FORKYARD, ROOT

EXAMPLES = ROOT / "examples" / "swe"
INSTANCES = [json.loads(line) for line in (EXAMPLES / "instances.jsonl").read_text().splitlines()]
ORACLE = {"name": "oracle", "api": "scripted", "model": "oracle"}


@pytest.fixture(scope="module")
def task_ids(live_gateway) -> dict[str, str]:
    """Add the example repositories to the gateway's store and import the instances with the CLI."""
    for name in ("calc", "textkit"):
        out = subprocess.run([str(FORKYARD), "repos", "add", str(EXAMPLES / "repos" / name), "--name",
                              f"forkyard/{name}", "--data-dir", str(live_gateway.data_dir)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
    out = subprocess.run([str(FORKYARD), "tasks", "import", str(EXAMPLES / "instances.jsonl")],
                         env=live_gateway.env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    ids = dict(reversed(line.split()[:2]) for line in out.stdout.splitlines())
    assert sorted(ids) == sorted(i["instance_id"] for i in INSTANCES)
    return ids


@pytest.fixture(scope="module")
def client(live_gateway):
    with forkyard.Client(base_url=live_gateway.url, api_key=live_gateway.api_key, timeout=300) as c:
        yield c


def test_a_session_edits_the_repository_and_submit_grades_it(client, task_ids):
    instance = next(i for i in INSTANCES if i["instance_id"] == "forkyard__calc-clamp-upper")
    with client.sessions.create(task_ids[instance["instance_id"]]) as s:
        assert [t["function"]["name"] for t in s.tools] == ["bash", "str_replace_editor", "submit"]
        assert "values above the range" in s.observation
        view = s.step("str_replace_editor", command="view", path="/testbed/calc/numbers.py", view_range=[4, 12])
        assert "return low" in view.observation
        edited = s.step("str_replace_editor", command="str_replace", path="/testbed/calc/numbers.py",
                        old_str="    if value > high:\n        return low", new_str="    if value > high:\n        return high")
        assert "return high" in edited.observation
        with pytest.raises(forkyard.UnprocessableEntityError, match="outside the repository"):
            s.step("str_replace_editor", command="view", path="/etc/hostname")
        result = s.step("submit")
        assert result.reward == 1.0 and result.terminated, result.info
        assert result.info["grading"]["FAIL_TO_PASS"]["success"] == instance["FAIL_TO_PASS"]


def test_an_oracle_rollout_resolves_swe_instances(client, task_ids):
    names = [i["instance_id"] for i in INSTANCES][::5]
    rollout = client.rollouts.create(
        tasks={"ids": [task_ids[n] for n in names]}, group_size=1, policy=ORACLE,
        agent={"max_turns": 4}, limits={"episode_timeout_s": 300, "step_timeout_s": 120},
    )
    seen = []
    for batch in client.rollouts.stream(rollout.id, consumer="trainer", batch_size=4):
        seen.extend(batch)
        batch.ack()
    assert len(seen) == len(names) and {e.reward for e in seen} == {1.0}
    detail = client.episodes.get(seen[0].id)
    assert [s.action["tool"] for s in detail.steps] == ["bash", "submit"]
    assert detail.info["grading"]["resolved"] and detail.info["grading"]["fail_to_pass"] == 1.0
