"""Nodes: the embedded gateway's own heartbeat, states (up, down, draining) and the drain switch."""

from __future__ import annotations

import asyncio
import subprocess
from datetime import timedelta

from gateway.app import create_app
from gateway.cli import _settings, _with_db, main
from gateway.db import utcnow
from gateway.nodes import recovery, service
from gateway.nodes.models import Node
from tests.gateway.conftest import NODE, FakeRuntime, asgi_client, assert_error, make_settings, task_files


async def test_the_gateway_is_a_node_with_a_heartbeat(gateway):
    body = (await gateway.client.get("/v1/nodes")).json()
    (node,) = body["items"]
    assert (node["name"], node["state"], node["backend"], node["draining"]) == (NODE, "up", "fake", False)
    assert node["load"] == {"sessions": 0, "episodes": 0, "stages": {"setup": 0, "agent": 0, "verify": 0}}
    assert node["capacity"] >= 1
    assert {"heartbeat_at", "started_at"} <= set(node)


async def test_heartbeats_carry_the_load_and_a_silent_node_is_down(tmp_path):
    app = create_app(make_settings(tmp_path, nodes={"heartbeat_s": 0.2}), runtime=FakeRuntime())
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        task = (await client.post("/v1/tasks", json={"tasks": [{"name": "t", "files": task_files("t")}]})).json()
        await client.post("/v1/sessions", json={"task_id": task["items"][0]["id"]})
        first = (await client.get("/v1/nodes")).json()["items"][0]
        for _ in range(50):  # the next heartbeat counts the session (bounded: 5 s)
            node = (await client.get("/v1/nodes")).json()["items"][0]
            if node["load"]["sessions"] == 1:
                break
            await asyncio.sleep(0.1)
        assert node["load"]["sessions"] == 1 and node["heartbeat_at"] > first["heartbeat_at"]
        # A node that stopped beating (another host, crashed) reads down after 2.5 intervals.
        async with app.state.sessionmaker() as db:
            db.add(Node(name="gone-host", backend="docker", capacity=4, load={}, heartbeat_s=5.0,
                        heartbeat_at=utcnow() - timedelta(seconds=13), started_at=utcnow() - timedelta(hours=1),
                        draining=False))
            db.add(Node(name="late-host", backend="local", capacity=4, load={}, heartbeat_s=5.0,
                        heartbeat_at=utcnow() - timedelta(seconds=11), started_at=utcnow(), draining=False))
            # A short interval is no hair trigger: no node is down before 3 s without a heartbeat.
            db.add(Node(name="paused-host", backend="local", capacity=4, load={}, heartbeat_s=0.2,
                        heartbeat_at=utcnow() - timedelta(seconds=2), started_at=utcnow(), draining=False))
            db.add(Node(name="quiet-host", backend="local", capacity=4, load={}, heartbeat_s=0.2,
                        heartbeat_at=utcnow() - timedelta(seconds=4), started_at=utcnow(), draining=False))
            await db.commit()
        states = {n["name"]: n["state"] for n in (await client.get("/v1/nodes")).json()["items"]}
        assert states == {NODE: "up", "gone-host": "down", "late-host": "up", "paused-host": "up",
                          "quiet-host": "down"}


async def test_a_draining_node_opens_no_session_until_undrained(gateway):
    task = await gateway.import_task("hello")
    drained = (await gateway.client.post(f"/v1/nodes/{NODE}/drain")).json()
    assert (drained["state"], drained["draining"]) == ("draining", True)
    error = assert_error(await gateway.client.post("/v1/sessions", json={"task_id": task["id"]}), 409, "node_draining")
    assert NODE in error["message"]
    assert (await gateway.client.get("/v1/nodes")).json()["items"][0]["state"] == "draining"
    undrained = (await gateway.client.post(f"/v1/nodes/{NODE}/undrain")).json()
    assert (undrained["state"], undrained["draining"]) == ("up", False)
    await gateway.open_session(task["id"])
    assert_error(await gateway.client.post("/v1/nodes/no-such-node/drain"), 404, "not_found")


async def test_a_draining_node_forks_nothing_and_keeps_no_started_branch(gateway):
    """A drain through this gateway reaches its forks at once: refused before any branch starts."""
    task = await gateway.import_task("hello")
    session = await gateway.open_session(task["id"])
    snap = (await gateway.client.post(f"/v1/sessions/{session['id']}/snapshot")).json()
    sandboxes, sessions = set(gateway.runtime.sandboxes), set(gateway.runtime.sessions)
    await gateway.client.post(f"/v1/nodes/{NODE}/drain")
    assert_error(await gateway.client.post(f"/v1/snapshots/{snap['id']}/fork", json={"n": 2}), 409, "node_draining")
    assert (set(gateway.runtime.sandboxes), set(gateway.runtime.sessions)) == (sandboxes, sessions)
    listed = (await gateway.client.get("/v1/sessions", params={"state": "open"})).json()["items"]
    assert [s["id"] for s in listed] == [session["id"]]
    await gateway.client.post(f"/v1/nodes/{NODE}/undrain")
    forked = await gateway.client.post(f"/v1/snapshots/{snap['id']}/fork", json={"n": 2})
    assert forked.status_code == 201, forked.text
    assert len(set(gateway.runtime.sessions) - sessions) == 2


async def test_a_drain_written_by_another_process_reaches_the_forks_at_the_next_heartbeat(gateway):
    """The forks of the snapshots this gateway holds check its kept drain flag; each heartbeat reads it back."""
    from sqlalchemy import update

    task = await gateway.import_task("hello")
    session = await gateway.open_session(task["id"])
    snap = (await gateway.client.post(f"/v1/sessions/{session['id']}/snapshot")).json()
    app = gateway.app

    async def drained_elsewhere(draining: bool) -> None:  # as `forkyard nodes drain` does, from its own process
        async with app.state.sessionmaker() as db:
            await db.execute(update(Node).where(Node.name == NODE).values(draining=draining))
            await db.commit()

    await drained_elsewhere(True)
    assert app.state.drain.draining is False  # not read per fork...
    await app.state.heartbeat.beat()  # ...but at each beat
    assert app.state.drain.draining is True
    sessions = set(gateway.runtime.sessions)
    assert_error(await gateway.client.post(f"/v1/snapshots/{snap['id']}/fork", json={"n": 1}), 409, "node_draining")
    assert set(gateway.runtime.sessions) == sessions
    await drained_elsewhere(False)
    await app.state.heartbeat.beat()
    forked = await gateway.client.post(f"/v1/snapshots/{snap['id']}/fork", json={"n": 1})
    assert forked.status_code == 201, forked.text
    # A drain of another node through this gateway leaves this one's flag alone.
    async with app.state.sessionmaker() as db:
        await service.heartbeat(db_session=db, name="host-b", backend="local", capacity=1, load={}, heartbeat_s=60)
    assert (await gateway.client.post("/v1/nodes/host-b/drain")).json()["draining"] is True
    assert app.state.drain.draining is False


async def test_a_heartbeat_reads_back_the_drain_flag(tmp_path):
    settings = _settings(data_dir=tmp_path / "data")

    async def beat(db):
        return await service.heartbeat(db_session=db, name="host-a", backend="local", capacity=1, load={},
                                       heartbeat_s=60)

    assert await _with_db(settings, beat) is False  # joins, not draining
    await _with_db(settings, lambda db: service.set_draining(db_session=db, name="host-a", draining=True))
    assert await _with_db(settings, beat) is True


def test_cli_lists_and_drains_nodes(tmp_path, capsys):
    data = tmp_path / "data"

    def cli(*args: str) -> subprocess.CompletedProcess:
        """Run the CLI in this process (the way the console script does), capturing what it prints."""
        code = main([*args, "--data-dir", str(data)])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    assert cli("nodes", "list").stdout == ""  # a fresh database knows no node
    missing = cli("nodes", "drain", "nowhere")
    assert missing.returncode == 2 and "nowhere" in missing.stderr
    settings = _settings(data_dir=data)
    asyncio.run(_with_db(settings, lambda db: service.heartbeat(
        db_session=db, name="host-a", backend="local", capacity=8, load={"episodes": 3}, heartbeat_s=60)))
    assert cli("nodes", "drain", "host-a").returncode == 0
    listed = cli("nodes", "list").stdout.split()
    assert listed[:6] == ["host-a", "draining", "local", "capacity", "8", "episodes"]
    assert cli("nodes", "undrain", "host-a").returncode == 0
    assert cli("nodes", "list").stdout.split()[1] == "up"



async def test_the_work_of_a_node_found_down_is_handed_on(tmp_path):
    from gateway.episodes import service as episodes_service
    from gateway.sessions.models import EnvSession, SessionState
    from tests.gateway.rollout_helpers import create_rollout, episodes_of, import_tasks, recording_dispatcher

    app = create_app(make_settings(tmp_path, nodes={"heartbeat_s": 0.2}), runtime=FakeRuntime())
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        with recording_dispatcher(app):
            sm = app.state.sessionmaker
            (task_id,) = await import_tasks(client, ["a"])
            rollout = await create_rollout(client, [task_id], group_size=1, max_attempts=2)
            (episode,) = await episodes_of(sm, rollout["id"])
            async with sm() as db:
                # Another host took the episode and opened a session, then stopped beating (for 13 s > 2.5 x 5 s).
                db.add(Node(name="dead-host", backend="local", capacity=4, load={}, heartbeat_s=5.0,
                            heartbeat_at=utcnow() - timedelta(seconds=13), started_at=utcnow(), draining=False))
                db.add(EnvSession(id="sess_on_dead_host", task_id=task_id, state=SessionState.OPEN, node="dead-host",
                                  steps=0, created_at=utcnow()))
                await db.commit()
                assert await episodes_service.mark_episode_running(db_session=db, episode_id=episode.id,
                                                                   node="dead-host")
            for _ in range(50):  # a few of this gateway's heartbeats (bounded: 5 s)
                rows = await episodes_of(sm, rollout["id"])
                session = (await client.get("/v1/sessions/sess_on_dead_host")).json()
                if len(rows) == 2 and session["state"] != "open":  # episodes and sessions settle one after the other
                    break
                await asyncio.sleep(0.1)
            assert [(r.attempt, r.status.value) for r in rows] == [(1, "failed"), (2, "queued")]
            assert "node dead-host is down" in rows[0].error
            assert session["state"] == "failed" and "node dead-host is down" in session["error"]
            # This gateway's own node is never settled, and a second pass finds nothing left to do.
            async with sm() as db:
                assert await recovery.settle_down_nodes(db_session=db, exclude=NODE) == []
