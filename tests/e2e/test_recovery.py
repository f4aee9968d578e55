"""A gateway killed with open sessions leaves orphans; the next start reaps them."""

from __future__ import annotations

import time
import uuid

import pytest

import forkyard
from tests.conftest import leftover_sandboxes, leftover_storage
from tests.live import run_gateway

ECHO_TASK = {
    "name": "recovery-echo",
    "files": {
        "instruction.md": "Say hi.\n",
        "task.toml": "[agent]\ntimeout_sec = 300\n",
        "environment/Dockerfile": "FROM debian:bookworm\n",
        "tests/test.sh": "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
    },
}


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_restart_after_a_crash_reaps_orphans_and_fails_open_sessions(backend, tmp_path):
    node = f"e2e-crash-{backend}-{uuid.uuid4().hex[:6]}"
    with run_gateway(backend, tmp_path, node=node) as gw:
        with forkyard.Client(base_url=gw.url, api_key=gw.api_key) as client:
            task = client.tasks.import_specs([ECHO_TASK])[0]
            sessions = [client.sessions.create(task.id) for _ in range(2)]
            sessions[0].step("bash", command="sleep 300 &")  # a busy sandbox, too
        gw.crash()
        assert len(leftover_sandboxes(backend, node, tmp_path)) == 2  # the crash left both behind

    with run_gateway(backend, tmp_path, node=node) as gw:
        assert leftover_sandboxes(backend, node, tmp_path) == []  # reaped at start
        with forkyard.Client(base_url=gw.url, api_key=gw.api_key) as client:
            for s in sessions:
                info = client.sessions.get(s.id)
                assert info.state == "failed" and "restarted" in info.error
                with pytest.raises(forkyard.ConflictError):
                    client.sessions.step(s.id, "bash", command="true")
            assert [row for row in client.sandboxes.list() if row.state != "gone"] == []
            # The node still works.
            with client.sessions.create(task.id) as s:
                assert s.submit().reward == 1.0


@pytest.mark.parametrize("backend", ["local"])
def test_restart_mid_rollout_resumes_and_delivers_everything(backend, tmp_path):
    node = f"e2e-rollout-crash-{uuid.uuid4().hex[:6]}"
    slow = [{"tool": "bash", "arguments": {"command": "sleep 3"}}, {"tool": "submit", "arguments": {}}]
    with run_gateway(backend, tmp_path, node=node) as gw:
        with forkyard.Client(base_url=gw.url, api_key=gw.api_key) as client:
            task = client.tasks.import_specs([ECHO_TASK])[0]
            rollout = client.rollouts.create(
                tasks={"ids": [task.id]}, group_size=4, concurrency=2,
                policy={"name": "slow", "api": "scripted", "model": "x", "actions": slow},
            )
            time.sleep(1.5)  # two episodes are mid-command
        gw.crash()

    with run_gateway(backend, tmp_path, node=node) as gw:
        with forkyard.Client(base_url=gw.url, api_key=gw.api_key) as client:
            delivered = []
            for batch in client.rollouts.stream(rollout.id, consumer="trainer"):
                delivered.extend(batch)
                batch.ack()
            assert len(delivered) == 4 and all(e.status == "completed" for e in delivered)
            assert len({(e.group_id, e.sample_index) for e in delivered}) == 4
            interrupted = [e for e in client.episodes.list(rollout_id=rollout.id) if e.status == "failed"]
            assert interrupted and all("restart" in (e.error or "") for e in interrupted)
            assert client.rollouts.get(rollout.id).status == "completed"
        assert leftover_sandboxes(backend, node, tmp_path) == []


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_restart_mid_tree_fails_its_episodes_and_frees_its_snapshots(backend, tmp_path):
    node = f"e2e-tree-crash-{backend}-{uuid.uuid4().hex[:6]}"
    actions = [{"tool": "bash", "arguments": {"command": "echo trunk > /root/t"}},
               {"tool": "bash", "arguments": {"command": "sleep 30"}}, {"tool": "submit", "arguments": {}}]
    with run_gateway(backend, tmp_path, node=node) as gw:
        with forkyard.Client(base_url=gw.url, api_key=gw.api_key) as client:
            task = client.tasks.import_specs([ECHO_TASK])[0]
            rollout = client.rollouts.create(
                tasks=[task.id], group_size=1, branching={"at_turns": [1], "fanout": 3},
                policy={"name": "tree-crash", "api": "scripted", "actions": actions},
            )
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # wait until the tree has forked
                if len(list(client.episodes.list(rollout_id=rollout.id))) == 3:
                    break
                time.sleep(0.2)
            time.sleep(1.0)
        gw.crash()
        left = leftover_storage(backend, node, tmp_path)
        assert left["snapshots"], left  # the crash left the tree's snapshot behind

    with run_gateway(backend, tmp_path, node=node) as gw:
        with forkyard.Client(base_url=gw.url, api_key=gw.api_key) as client:
            episodes = list(client.episodes.list(rollout_id=rollout.id))
            assert len(episodes) == 3  # a tree is not rerun: its branches cannot resume without their parent
            assert all(e.status == "failed" and "restart" in (e.error or "") for e in episodes)
            assert client.rollouts.get(rollout.id).status == "completed"
            assert len(list(client.rollouts.dead_letters(rollout.id))) == 3
    assert leftover_sandboxes(backend, node, tmp_path) == []
    assert {k: v for k, v in leftover_storage(backend, node, tmp_path).items() if v} == {}


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_restart_frees_session_snapshots_nothing_holds_and_keeps_pinned_ones(backend, tmp_path):
    """After a crash: an unrecorded snapshot (taken, then the crash) and one only its session held go; a pin keeps."""
    import asyncio

    from sandboxes.backends import create_backend
    from sandboxes.base import SandboxSpec

    node = f"e2e-snap-crash-{backend}-{uuid.uuid4().hex[:6]}"
    with run_gateway(backend, tmp_path, node=node) as gw:
        with forkyard.Client(base_url=gw.url, api_key=gw.api_key) as client:
            task = client.tasks.import_specs([ECHO_TASK])[0]
            session = client.sessions.create(task.id)
            session.step("bash", command="echo kept > /root/kept")
            pinned = session.snapshot()
            client.snapshots.pin(pinned.id)
            session.step("bash", command="echo more > /root/more")
            loose = session.snapshot()
        gw.crash()

    async def orphan() -> str:  # what a crash between the backend snapshot and its row leaves
        sandboxes = create_backend(backend, node=node, root_dir=tmp_path / "sandboxes")
        try:
            (left,) = await sandboxes.list()
            info = await sandboxes.create(SandboxSpec(image=left.image))
            try:
                await sandboxes.exec(info.id, "echo orphan > /root/orphan")
                return (await sandboxes.snapshot(info.id, metadata={"forkyard.session": session.id})).id
            finally:
                await sandboxes.destroy(info.id)
        finally:
            await sandboxes.aclose()

    orphan_id = asyncio.run(orphan())
    assert orphan_id in leftover_storage(backend, node, tmp_path)["snapshots"]
    with run_gateway(backend, tmp_path, node=node) as gw:
        with forkyard.Client(base_url=gw.url, api_key=gw.api_key) as client:
            assert client.sessions.get(session.id).state == "failed"
            with pytest.raises(forkyard.NotFoundError):
                client.snapshots.get(loose.id)  # only its (now failed) session held it
            assert client.snapshots.get(pinned.id).pinned
            with client.snapshots.fork(pinned.id, 1) as (fork,):
                assert fork.step("bash", command="cat /root/kept").observation.startswith("kept")
            client.snapshots.unpin(pinned.id)
    assert leftover_sandboxes(backend, node, tmp_path) == []
    assert {k: v for k, v in leftover_storage(backend, node, tmp_path).items() if v} == {}


def test_two_gateways_on_one_docker_engine_never_reap_each_others_sandboxes(tmp_path):
    """Neither sets FORKYARD_NODE: each names itself once per data dir, and a start reaps only its own."""
    with run_gateway("docker", tmp_path / "a", node=None) as a, \
            forkyard.Client(base_url=a.url, api_key=a.api_key) as client_a:
        task = client_a.tasks.import_specs([ECHO_TASK])[0]
        with client_a.sessions.create(task.id) as session:
            session.step("bash", command="echo kept > /root/mine")
            snapshot = session.snapshot()
            with run_gateway("docker", tmp_path / "b", node=None) as b:
                assert b.node != a.node and a.node.startswith(__import__("socket").gethostname())
                assert leftover_sandboxes("docker", a.node, tmp_path / "a")  # a's sandbox survived b's start
                assert "kept" in session.step("bash", command="cat /root/mine").observation
                with client_a.snapshots.fork(snapshot.id, 1) as (fork,):  # and its snapshot too
                    assert "kept" in fork.step("bash", command="cat /root/mine").observation
            client_a.snapshots.delete(snapshot.id)
    # Restarted on its data dir, a gateway is the same node as before.
    with run_gateway("docker", tmp_path / "a", node=None) as again:
        assert again.node == a.node
    assert leftover_sandboxes("docker", a.node, tmp_path / "a") == []
