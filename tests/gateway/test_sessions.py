"""Sessions through the API with the fake runtime: open, step, submit, close, limits, recovery."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import update

from gateway.app import create_app
from gateway.db import create_engine, create_sessionmaker
from gateway.sandboxes.models import Sandbox
from gateway.sessions.models import EnvSession, SessionState
from sandboxes.base import SandboxState
from tests.gateway.conftest import API_KEY, FakeRuntime, asgi_client, assert_error, make_settings, task_files


async def test_session_flow_open_step_submit_close(gateway):
    task = await gateway.import_task("hello")
    opened = await gateway.open_session(task["id"])
    assert opened["id"].startswith("sess_")
    assert opened["task_id"] == task["id"] and opened["state"] == "open"
    assert opened["observation"] == task["instruction"]
    assert {t["function"]["name"] for t in opened["tools"]} == {"bash", "submit"}
    assert opened["sandbox_id"] in gateway.runtime.sandboxes
    sid = opened["id"]

    step = await gateway.client.post(f"/v1/sessions/{sid}/step",
                                     json={"action": {"tool": "bash", "arguments": {"command": "echo hi"}}})
    assert step.status_code == 200, step.text
    assert step.json() == {"observation": "hi\n[exit code 0]", "reward": None, "terminated": False,
                           "truncated": False, "info": {"exit_code": 0}}
    await gateway.client.post(f"/v1/sessions/{sid}/step",
                              json={"action": {"tool": "bash", "arguments": {"command": "./solve"}}})
    done = await gateway.client.post(f"/v1/sessions/{sid}/step", json={"action": {"tool": "submit"}})
    assert done.status_code == 200, done.text
    assert done.json()["terminated"] is True and done.json()["reward"] == 1.0

    info = (await gateway.client.get(f"/v1/sessions/{sid}")).json()
    assert info["state"] == "terminated" and info["steps"] == 3 and info["reward"] == 1.0
    assert info["closed_at"] is not None and info["sandbox_id"] == opened["sandbox_id"]
    # Termination frees the sandbox at once.
    assert opened["sandbox_id"] not in gateway.runtime.sandboxes

    assert (await gateway.client.delete(f"/v1/sessions/{sid}")).status_code == 204
    assert (await gateway.client.delete(f"/v1/sessions/{sid}")).status_code == 204
    assert (await gateway.client.get(f"/v1/sessions/{sid}")).json()["state"] == "terminated"


async def test_close_open_session_destroys_sandbox_and_refuses_steps(gateway):
    task = await gateway.import_task("hello")
    opened = await gateway.open_session(task["id"])
    sid = opened["id"]
    response = await gateway.client.delete(f"/v1/sessions/{sid}")
    assert response.status_code == 204 and response.content == b""
    assert opened["sandbox_id"] not in gateway.runtime.sandboxes
    info = (await gateway.client.get(f"/v1/sessions/{sid}")).json()
    assert info["state"] == "closed" and info["closed_at"]
    error = assert_error(await gateway.client.post(f"/v1/sessions/{sid}/step", json={"action": {"tool": "bash",
                         "arguments": {"command": "ls"}}}), 409, "session_closed")
    assert sid in error["message"]
    async with gateway.app.state.sessionmaker() as db:
        record = await db.get(Sandbox, opened["sandbox_id"])
        assert record.state == SandboxState.GONE and record.gone_at is not None and record.session_id == sid


async def test_sandboxes_listing_joins_sessions_and_tasks(gateway):
    task = await gateway.import_task("listing")
    opened = await gateway.open_session(task["id"])
    orphan = gateway.runtime.add_orphan("sess_from_elsewhere")
    response = await gateway.client.get("/v1/sandboxes")
    assert response.status_code == 200, response.text
    rows = {row["id"]: row for row in response.json()["items"]}
    assert response.json()["next"] is None
    row = rows[opened["sandbox_id"]]
    assert row["session_id"] == opened["id"] and row["task_id"] == task["id"] and row["task_name"] == "listing"
    assert row["node"] == "test-node" and row["backend"] == "fake" and row["state"] == "ready"
    assert row["age_s"] >= 0 and row["created_at"]
    assert rows[orphan]["session_id"] == "sess_from_elsewhere" and rows[orphan]["task_id"] is None
    assert (row["owner_kind"], row["owner_id"]) == ("session", opened["id"])


async def test_sandbox_listing_names_every_kind_of_owner(gateway):
    owners = {
        "ep_1": ("episode", "ep_1", "ro_1"), "grp_1": ("group", "grp_1", "ro_1"), "forkyard-pool": ("pool", None, None),
        "forkyard-swe-synth": ("synth", None, None), "someone": ("other", None, None),
    }
    made = {gateway.runtime.add_orphan(owner, labels={"forkyard.rollout": "ro_1"} if kind[2] else None): owner
            for owner, kind in owners.items()}
    rows = {row["id"]: row for row in (await gateway.client.get("/v1/sandboxes")).json()["items"]}
    for sandbox_id, owner in made.items():
        row = rows[sandbox_id]
        assert (row["owner_kind"], row["owner_id"], row["rollout_id"]) == owners[owner], owner
        assert row["session_id"] is None, "only a session's sandbox names a session"


async def test_list_sessions_by_state_with_paging(gateway):
    task = await gateway.import_task("hello")
    ids = [(await gateway.open_session(task["id"]))["id"] for _ in range(3)]
    await gateway.client.delete(f"/v1/sessions/{ids[0]}")
    page = (await gateway.client.get("/v1/sessions", params={"state": "open", "limit": 1})).json()
    seen = [item["id"] for item in page["items"]]
    while page["next"]:
        page = (await gateway.client.get("/v1/sessions", params={"state": "open", "limit": 1,
                                                                  "cursor": page["next"]})).json()
        seen += [item["id"] for item in page["items"]]
    assert seen == ids[1:]
    closed = (await gateway.client.get("/v1/sessions", params={"state": "closed"})).json()["items"]
    assert [s["id"] for s in closed] == ids[:1]


async def test_failed_open_answers_image_build_error_and_records_failure(gateway):
    task = await gateway.import_task("broken", metadata="fake_fail_build = true")
    error = assert_error(await gateway.client.post("/v1/sessions", json={"task_id": task["id"]}),
                         422, "image_build_error")
    assert "Dockerfile line 2" in error["message"]
    sessions = (await gateway.client.get("/v1/sessions", params={"task_id": task["id"]})).json()["items"]
    assert len(sessions) == 1 and sessions[0]["state"] == "failed" and "FROBNICATE" in sessions[0]["error"]
    # The gateway still opens sessions of good tasks.
    good = await gateway.import_task("good")
    assert (await gateway.open_session(good["id"]))["state"] == "open"


async def test_a_failing_reset_script_is_the_tasks_error_not_the_gateways(gateway):
    task = await gateway.import_task("bad-reset", metadata="fake_fail_reset = true")
    error = assert_error(await gateway.client.post("/v1/sessions", json={"task_id": task["id"]}),
                         422, "task_setup_failed")
    assert "reset.sh failed with exit code 3" in error["message"]
    (session,) = (await gateway.client.get("/v1/sessions", params={"task_id": task["id"]})).json()["items"]
    assert session["state"] == "failed" and "no such package" in session["error"]


async def test_open_session_limit_answers_429(tmp_path):
    runtime = FakeRuntime()
    app = create_app(make_settings(tmp_path, sessions={"max_open": 2}), runtime=runtime)
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        response = await client.post("/v1/tasks", json={"tasks": [{"name": "t", "files": task_files("t")}]})
        task_id = response.json()["items"][0]["id"]
        first = (await client.post("/v1/sessions", json={"task_id": task_id})).json()
        assert (await client.post("/v1/sessions", json={"task_id": task_id})).status_code == 201
        error = assert_error(await client.post("/v1/sessions", json={"task_id": task_id}), 429, "rate_limited")
        assert "2" in error["message"]
        await client.delete(f"/v1/sessions/{first['id']}")
        assert (await client.post("/v1/sessions", json={"task_id": task_id})).status_code == 201


async def test_shutdown_closes_sessions_and_restart_recovers(tmp_path):
    settings = make_settings(tmp_path)
    runtime = FakeRuntime()
    app = create_app(settings, runtime=runtime)
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        task_id = (await client.post("/v1/tasks", json={"tasks": [{"name": "t", "files": task_files("t")}]})
                   ).json()["items"][0]["id"]
        survivor = (await client.post("/v1/sessions", json={"task_id": task_id})).json()
        lost = (await client.post("/v1/sessions", json={"task_id": task_id})).json()
    # Shutdown closed both sessions and destroyed their sandboxes; an injected runtime is not aclose()d.
    assert runtime.sandboxes == {} and not runtime.closed

    # Make the DB look like after a crash: both sessions still open.
    engine = create_engine(settings.database_url)
    async with create_sessionmaker(engine)() as db:
        await db.execute(update(EnvSession).values(state=SessionState.OPEN, closed_at=None, error=None))
        await db.execute(update(Sandbox).values(state=SandboxState.READY, gone_at=None))
        await db.commit()
    await engine.dispose()
    # The crashed node kept one session's sandbox, lost the other's, and left an unowned orphan.
    fresh = FakeRuntime()
    kept_sandbox = fresh.add_orphan(survivor["id"], sandbox_id=survivor["sandbox_id"])
    orphan = fresh.add_orphan("sess_nobody")

    app2 = create_app(settings, runtime=fresh)
    async with app2.router.lifespan_context(app2), asgi_client(app2) as client:
        # A new runtime cannot resume a session: every sandbox of the node is reaped...
        assert sorted(fresh.reaped) == sorted([orphan, kept_sandbox])
        assert fresh.sandboxes == {}
        # ...and every session open before the crash ends failed, with the reason.
        for sid in (survivor["id"], lost["id"]):
            body = (await client.get(f"/v1/sessions/{sid}")).json()
            assert body["state"] == "failed" and "restarted" in body["error"]
        async with app2.state.sessionmaker() as db:
            for sb in (lost["sandbox_id"], survivor["sandbox_id"]):
                assert (await db.get(Sandbox, sb)).state == SandboxState.GONE
        error = assert_error(await client.post(f"/v1/sessions/{survivor['id']}/step",
                                               json={"action": {"tool": "bash", "arguments": {"command": "ls"}}}),
                             409, "session_closed")
        assert survivor["id"] in error["message"] or "closed" in error["message"] or "failed" in error["message"]


async def test_step_records_are_written_behind_in_order_and_settle_waits_for_them(caplog):
    import asyncio

    from gateway.sessions.gate import StepGate

    gate = StepGate()
    written: list[tuple[str, int]] = []

    def write(session: str, n: int, delay: float, fail: bool = False):
        async def run() -> None:
            await asyncio.sleep(delay)
            if fail:
                raise RuntimeError("database is gone")
            written.append((session, n))
        return run

    gate.record("a", write("a", 0, 0.05))
    gate.record("a", write("a", 1, 0.0, fail=True))  # logged, and the next write still runs
    gate.record("a", write("a", 2, 0.0))
    gate.record("b", write("b", 0, 0.01))
    await gate.settle("b")
    assert ("b", 0) in written and ("a", 2) not in written  # b does not wait for a
    await gate.settle()
    assert [w for w in written if w[0] == "a"] == [("a", 0), ("a", 2)]
    assert "writing a record failed" in caplog.text
    await gate.settle("never-stepped")  # nothing pending: returns at once


async def test_a_requests_records_wait_until_it_releases_them_or_settles():
    import asyncio

    from gateway.sessions.gate import HeldRecords, StepGate, holding

    gate = StepGate()
    written: list[int] = []

    def write(n: int):
        async def run() -> None:
            written.append(n)
        return run

    held = HeldRecords()
    with holding(held):
        gate.record("a", write(0))
    gate.record("a", write(1))  # outside the request: starts at once, yet after the held one (same session)
    await asyncio.sleep(0.05)
    assert written == []
    held.release()
    await gate.settle("a")
    assert written == [0, 1]
    with holding(HeldRecords()):  # a request that reads its own records lets them go first
        gate.record("a", write(2))
        await asyncio.wait_for(gate.settle("a"), 1)
    assert written == [0, 1, 2]


async def test_a_steps_record_is_written_after_its_answer_is_sent(gateway):
    """Behind the answer means after it: the write starts once the response body has been sent."""
    from gateway.dependencies import step_gate_of

    task = await gateway.import_task("hello")
    session = await gateway.open_session(task["id"])
    gate = step_gate_of(gateway.app)
    events: list[str] = []
    record = gate.record

    def spying(session_id, write):
        async def logged() -> None:
            events.append("write")
            await write()
        return record(session_id, logged)

    gate.record = spying
    body = b'{"action": {"tool": "bash", "arguments": {"command": "echo hi"}}}'
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": f"/v1/sessions/{session['id']}/step", "raw_path": b"", "query_string": b"", "root_path": "",
             "headers": [(b"authorization", f"Bearer {API_KEY}".encode()), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("gateway.test", 80)}
    sent = {"done": False}

    async def receive():
        if sent["done"]:
            await asyncio.sleep(3600)
        sent["done"] = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            events.append(f"status {message['status']}")
        elif message["type"] == "http.response.body":
            for _ in range(5):  # the loop turns while the body goes out: no write may start meanwhile
                await asyncio.sleep(0)
            events.append("body")

    await gateway.app(scope, receive, send)
    await gate.settle(session["id"])
    assert events == ["status 200", "body", "write"]
    steps = (await gateway.client.get(f"/v1/sessions/{session['id']}/steps")).json()["items"]
    assert [s["action"]["arguments"]["command"] for s in steps] == ["echo hi"]


async def test_every_live_sandbox_gets_a_row_and_gone_ones_are_marked(gateway):
    from sqlalchemy import select

    from gateway.nodes.heartbeat import Heartbeat
    from gateway.sandboxes.models import Sandbox

    sessionmaker = gateway.app.state.sessionmaker
    beat = Heartbeat(sessionmaker, node=gateway.runtime.node, backend="fake", capacity=1, load=dict, interval_s=60,
                     sandboxes=gateway.runtime.list_sandboxes, made_after=gateway.runtime.sandboxes_made_after)

    async def rows() -> dict[str, Sandbox]:
        async with sessionmaker() as db:
            return {row.id: row for row in (await db.scalars(select(Sandbox))).all()}

    task = await gateway.import_task("rows")
    opened = await gateway.open_session(task["id"])
    episode = gateway.runtime.add_orphan("ep_1", labels={"forkyard.rollout": "ro_1"})
    pooled = gateway.runtime.add_orphan("forkyard-pool")
    assert await beat.record_sandboxes() == 2, "the session's row exists already; the other two are new"
    found = await rows()
    assert (found[opened["sandbox_id"]].owner_kind, found[opened["sandbox_id"]].session_id) == ("session", opened["id"])
    assert (found[episode].owner_kind, found[episode].owner_id, found[episode].rollout_id) == ("episode", "ep_1", "ro_1")
    assert found[pooled].owner_kind == "pool" and found[pooled].gone_at is None

    # The pooled sandbox is claimed by an episode (the runtime's listing shows its new owner).
    info = gateway.runtime.sandboxes[pooled]
    gateway.runtime.sandboxes[pooled] = type(info)(**{**info.__dict__, "labels": {"forkyard.owner": "ep_2"}})
    del gateway.runtime.sandboxes[episode]
    assert await beat.record_sandboxes() == 2
    found = await rows()
    assert (found[pooled].owner_kind, found[pooled].owner_id) == ("episode", "ep_2")
    assert found[episode].gone_at is not None and found[episode].state == "gone"
    assert await beat.record_sandboxes() == 0, "nothing changed since"

    # A sandbox made and destroyed between two listings (a short episode) still gets its row, gone.
    brief = gateway.runtime.add_orphan("ep_3", labels={"forkyard.rollout": "ro_1"})
    del gateway.runtime.sandboxes[brief]
    assert await beat.record_sandboxes() == 1
    found = await rows()
    assert (found[brief].owner_kind, found[brief].owner_id, found[brief].state) == ("episode", "ep_3", "gone")
    assert found[brief].gone_at is not None
    assert await beat.record_sandboxes() == 0, "read again from the ledger, recorded once"


async def test_records_behind_answers_run_in_the_writers_thread_and_a_failed_one_rolls_back(gateway):
    """Steps, snapshots and forks are written by the gate's RecordWriter, one transaction each, off the event loop."""
    import threading

    from sqlalchemy import select

    from gateway.dependencies import step_gate_of
    from gateway.sessions.models import SessionStep

    gate = step_gate_of(gateway.app)
    writer = gate.writer
    assert writer is not None
    ran: list[tuple[str, str]] = []  # (what, in which thread)
    run = writer.run

    async def spying(work):
        def traced(db):
            ran.append((getattr(work, "func", work).__name__, threading.current_thread().name))
            return work(db)
        return await run(traced)

    writer.run = spying
    try:
        task = await gateway.import_task("hello")
        session = await gateway.open_session(task["id"])
        step = await gateway.client.post(f"/v1/sessions/{session['id']}/step",
                                         json={"action": {"tool": "bash", "arguments": {"command": "echo hi"}}})
        assert step.status_code == 200, step.text
        snap = await gateway.client.post(f"/v1/sessions/{session['id']}/snapshot")
        assert snap.status_code == 201, snap.text
        forked = await gateway.client.post(f"/v1/snapshots/{snap.json()['id']}/fork", json={"n": 1})
        assert forked.status_code == 201, forked.text
        await gate.settle()
    finally:
        del writer.run
    # The step's row, the snapshot's and the fork's rows (the fork reads nothing: its node's drain flag is kept here).
    assert [what for what, _ in ran] == ["_record_step", "_execute", "_claim_records"], ran
    assert all(thread.startswith("forkyard-records") for _, thread in ran), ran
    assert threading.current_thread().name not in {thread for _, thread in ran}

    def fails(db):
        db.execute(update(EnvSession).where(EnvSession.id == session["id"]).values(steps=99))
        raise RuntimeError("the record is refused")

    with pytest.raises(RuntimeError, match="refused"):
        await writer.run(fails)
    read = (await gateway.client.get(f"/v1/sessions/{session['id']}")).json()
    assert read["steps"] == 1  # rolled back
    async with gateway.app.state.sessionmaker() as db:
        seqs = (await db.scalars(select(SessionStep.seq).where(SessionStep.session_id == session["id"]))).all()
    assert list(seqs) == [0]
