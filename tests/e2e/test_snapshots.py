"""Session snapshots and forks through the SDK against a live gateway, on both backends (real sandboxes)."""

from __future__ import annotations

import subprocess

import pytest

import forkyard
from forkyard._base_client import RequestOptions
from tests.e2e.test_terminal_tasks import TASKS_DIR, oracle_command
from tests.live import FORKYARD

TASK = "backup-archive"
SETUP = "mkdir -p /work/fork && cd /work/fork && echo base > f.txt && export FY_VAR=branch-point"


@pytest.fixture(scope="module")
def task_id(live_gateway):
    out = subprocess.run([str(FORKYARD), "tasks", "import", str(TASKS_DIR / TASK)],
                         env=live_gateway.env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("task_")]
    return line.split()[0]


@pytest.fixture(scope="module")
def client(live_gateway):
    with forkyard.Client(base_url=live_gateway.url, api_key=live_gateway.api_key, timeout=300) as c:
        yield c


def bash(session, command: str) -> str:
    return session.step("bash", command=command).observation


def test_forks_continue_from_the_snapshot_and_diverge(client, task_id):
    with client.sessions.create(task_id) as source:
        bash(source, SETUP)
        snap = source.snapshot()
        assert snap.session_id == source.id and snap.steps == 1
        assert snap.metadata["background_processes"] == "not captured"
        with client.snapshots.fork(snap.id, 3) as forks:
            assert len(forks) == 3 and len({f.id for f in forks} | {source.id}) == 4
            for i, fork in enumerate(forks):
                history = list(fork.history())
                assert [h.action["arguments"]["command"] for h in history] == [SETUP] and fork.info.steps == 1
                assert history[0].session_id == source.id and fork.observation == history[-1].observation
                seen = bash(fork, 'echo "$PWD|$FY_VAR|$(cat f.txt)"')
                assert seen.startswith("/work/fork|branch-point|base\n"), seen
                bash(fork, f"echo mine-{i} > own.txt && echo changed-{i} > f.txt && export FY_VAR=v{i}")
            for i, fork in enumerate(forks):
                seen = bash(fork, 'echo "$FY_VAR|$(cat f.txt)|$(ls /work/fork | tr "\\n" " ")"')
                assert seen.startswith(f"v{i}|changed-{i}|f.txt own.txt \n"), seen
                assert f"mine-{i}" in bash(fork, "cat own.txt")
            seen = bash(source, 'echo "$PWD|$FY_VAR|$(cat f.txt)|$(ls /work/fork | tr "\\n" " ")"')
            assert seen.startswith("/work/fork|branch-point|base|f.txt \n"), seen
            result = forks[0].step("bash", command=oracle_command(TASK), timeout=120)
            assert not result.terminated
            assert forks[0].submit().reward == 1.0
        assert [client.sessions.get(f.id).state for f in forks] == ["terminated", "closed", "closed"]
        client.snapshots.delete(snap.id)
        assert source.submit().reward == 0.0


def test_pin_unpin_delete_and_gc_after_forks_close(client, task_id):
    with client.sessions.create(task_id) as source:
        bash(source, "echo kept > /tmp/kept")
        snap = source.snapshot()
        loose = source.snapshot()
        assert client.snapshots.pin(snap.id).pinned is True
    # Closing the source freed the snapshot nothing else held; the pinned one stays usable.
    with pytest.raises(forkyard.NotFoundError):
        client.snapshots.get(loose.id)
    with pytest.raises(forkyard.ConflictError):
        client.snapshots.delete(snap.id)
    assert snap.id in [s.id for s in client.snapshots.list()]
    forks = client.snapshots.fork(snap.id, 2)
    with forks:
        assert client.snapshots.unpin(snap.id).pinned is False  # the open forks hold it now
        client.snapshots.delete(snap.id)  # storage stays until they close
        with pytest.raises(forkyard.NotFoundError):
            client.snapshots.get(snap.id)
        for fork in forks:
            assert bash(fork, "cat /tmp/kept").startswith("kept")
    assert snap.id not in [s.id for s in client.snapshots.list()]
    with pytest.raises(forkyard.NotFoundError):
        client.snapshots.fork(snap.id, 1)


def test_snapshot_of_a_closed_session_is_a_conflict(client, task_id):
    with client.sessions.create(task_id) as s:
        session_id = s.id
    with pytest.raises(forkyard.ConflictError):
        client.sessions.snapshot(session_id)
    with pytest.raises(forkyard.UnprocessableEntityError):
        client._request(RequestOptions("POST", "/v1/snapshots/snap_x/fork", json={"n": 65}))


def test_a_thousand_steps_are_all_kept_and_readable(client, task_id):
    """Steps are rows: 1,000 of them through the API, each one intact and paged back in order (a fork's too)."""
    with client.sessions.create(task_id) as session:
        for i in range(1000):
            result = session.step("bash", command=f"echo step-{i}")
            assert result.observation.startswith(f"step-{i}\n"), result
        assert client.sessions.get(session.id).steps == 1000
        history = list(session.history(limit=200))
        assert [h.seq for h in history] == list(range(1000))
        assert all(h.action == {"tool": "bash", "arguments": {"command": f"echo step-{i}"}} for i, h in enumerate(history))
        assert all(h.observation.startswith(f"step-{i}\n") and h.reward is None for i, h in enumerate(history))
        snap = session.snapshot()
        with client.snapshots.fork(snap.id, 1) as (fork,):
            assert fork.observation == history[-1].observation and fork.info.steps == 1000
            fork.step("bash", command="echo own")
            inherited = list(fork.history(limit=500))
            assert [h.observation for h in inherited[:1000]] == [h.observation for h in history]
            assert inherited[-1].seq == 1000 and inherited[-1].session_id == fork.id
        client.snapshots.delete(snap.id)
