"""The SDK against a real gateway, sync and async.

Uses the `live_gateway` fixture from tests/conftest.py: a real `forkyard up` process
per backend (the sync tests block the calling thread, so the gateway runs elsewhere).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest

import forkyard

TEST_SH = """#!/bin/bash
if [ "$(cat /tmp/forkyard-sdk.txt 2>/dev/null)" = "hello" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""

ECHO_TASK = {
    "name": "sdk-live-echo",
    "files": {
        "instruction.md": "Write the word hello into /tmp/forkyard-sdk.txt.\n",
        "task.toml": (
            '[metadata]\nauthor = "forkyard sdk tests"\n\n'
            "[agent]\ntimeout_sec = 300\n\n[verifier]\ntimeout_sec = 60\n\n"
            "[environment]\ncpus = 1\nmemory_mb = 512\n"
        ),
        "environment/Dockerfile": "FROM debian:bookworm\n",
        "tests/test.sh": TEST_SH,
        "solution/solve.sh": "#!/bin/bash\necho hello > /tmp/forkyard-sdk.txt\n",
    },
}


@dataclass(frozen=True)
class Live:
    url: str
    api_key: str
    task_ids_by_name: dict[str, str]

    def __iter__(self):
        return iter((self.url, self.api_key, self.task_ids_by_name))


@pytest.fixture
def live(live_gateway) -> Live:
    """(url, api_key, task_ids_by_name) of a running gateway with at least one task."""
    gateway = live_gateway
    with forkyard.Client(base_url=gateway.url, api_key=gateway.api_key) as c:
        task_ids_by_name = {t.name: t.id for t in c.tasks.import_specs([ECHO_TASK])}
    return Live(gateway.url, gateway.api_key, task_ids_by_name)


@pytest.fixture
def client(live):
    with forkyard.Client(base_url=live.url, api_key=live.api_key) as c:
        yield c


@pytest.fixture
async def aclient(live):
    async with forkyard.AsyncClient(base_url=live.url, api_key=live.api_key) as c:
        yield c


# -- sync -----------------------------------------------------------------------


def test_default_terminal_environment_exists(client):
    envs = list(client.environments.list())
    assert any(e.name == "terminal" and e.family == "terminal" for e in envs)


def test_given_tasks_can_be_fetched_and_listed(client, live):
    _, _, task_ids_by_name = live
    for name, task_id in task_ids_by_name.items():
        task = client.tasks.get(task_id)
        assert (task.id, task.name) == (task_id, name)
        assert task.instruction
        assert task_id in [t.id for t in client.tasks.list(name=name)]


def test_listing_pages_through_every_task(client, live):
    _, _, task_ids_by_name = live
    by_page_of_one = [t.id for t in client.tasks.list(limit=1)]
    assert len(by_page_of_one) == len(set(by_page_of_one))
    assert set(task_ids_by_name.values()) <= set(by_page_of_one)
    assert by_page_of_one == [t.id for t in client.tasks.list(limit=50)]


def test_reimporting_a_task_returns_the_same_one(client):
    first = client.tasks.import_specs([ECHO_TASK])
    again = client.tasks.import_specs([ECHO_TASK])
    assert [t.name for t in first] == ["sdk-live-echo"]
    assert [t.id for t in again] == [t.id for t in first]
    assert first[0].content_hash == again[0].content_hash


def test_import_dir(client, tmp_path):
    task_dir = tmp_path / "sdk-live-echo"
    for rel, text in ECHO_TASK["files"].items():
        (task_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (task_dir / rel).write_text(text)
    (task_dir / "tests" / "test.sh").chmod(0o755)
    (task_dir / "solution" / "solve.sh").chmod(0o755)
    [task] = client.tasks.import_dir(task_dir)
    assert task.name == "sdk-live-echo"
    assert task.instruction.startswith("Write the word hello")


def test_episode_with_reward_one(client):
    [task] = client.tasks.import_specs([ECHO_TASK])
    with client.sessions.create(task.id) as s:
        assert "hello" in s.observation
        assert {t["function"]["name"] for t in s.tools} >= {"bash", "submit"}
        assert s.sandbox_id
        live_ids = {b.session_id: b for b in client.sandboxes.list()}
        assert s.id in live_ids and live_ids[s.id].id == s.sandbox_id
        result = s.step("bash", command="echo hello > /tmp/forkyard-sdk.txt && cat /tmp/forkyard-sdk.txt")
        assert "hello" in result.observation and not result.done
        final = s.submit()
        assert final.terminated and final.reward == 1.0
    info = client.sessions.get(s.id)
    assert info.closed_at is not None and info.reward == 1.0
    assert s.sandbox_id not in {b.id for b in client.sandboxes.list()}


def test_episode_with_reward_zero_and_closed_session_errors(client):
    [task] = client.tasks.import_specs([ECHO_TASK])
    with client.sessions.create(task.id) as s:
        final = s.submit()
        assert final.terminated and final.reward == 0.0
        with pytest.raises(forkyard.ConflictError) as info:
            s.step("bash", command="true")
        assert info.value.request_id
    assert s.closed


def test_error_mapping(client, live):
    url, _, _ = live
    with pytest.raises(forkyard.NotFoundError) as info:
        client.tasks.get(f"missing-{uuid.uuid4().hex}")
    assert info.value.code == "not_found" and info.value.request_id
    assert info.value.request_id in str(info.value)

    with (
        forkyard.Client(base_url=url, api_key="wrong-key", max_retries=0) as wrong,
        pytest.raises(forkyard.AuthenticationError) as info,
    ):
        list(wrong.sandboxes.list())
    assert info.value.code == "unauthorized"

    bad = {"name": "sdk-live-bad", "files": {**ECHO_TASK["files"], "task.toml": "[agent]\ntimeout_sec = 'abc'\n"}}
    with pytest.raises(forkyard.UnprocessableEntityError) as info:
        client.tasks.import_specs([bad])
    assert info.value.code == "task_format_error"
    assert "task.toml" in info.value.message


# -- async ----------------------------------------------------------------------


async def test_async_episode(aclient):
    [task] = await aclient.tasks.import_specs([ECHO_TASK])
    async with aclient.sessions.create(task.id) as s:
        assert "hello" in s.observation
        sandboxes = [b async for b in aclient.sandboxes.list()]
        assert s.sandbox_id in {b.id for b in sandboxes}
        await s.step("bash", command="echo hello > /tmp/forkyard-sdk.txt")
        final = await s.submit()
        assert final.terminated and final.reward == 1.0
    info = await aclient.sessions.get(s.id)
    assert info.closed_at is not None and info.reward == 1.0
    assert s.sandbox_id not in {b.id async for b in aclient.sandboxes.list()}


async def test_async_listing_and_errors(aclient, live):
    _, _, task_ids_by_name = live
    ids = [t.id async for t in aclient.tasks.list(limit=1)]
    assert set(task_ids_by_name.values()) <= set(ids)
    with pytest.raises(forkyard.NotFoundError) as info:
        await aclient.sessions.get(f"missing-{uuid.uuid4().hex}")
    assert info.value.code == "not_found" and info.value.request_id
