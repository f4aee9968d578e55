"""Snapshot and fork API logic against the fake runtime: history, reference counting, errors."""

from __future__ import annotations

import dataclasses

from tests.gateway.conftest import Gateway, assert_error


async def step(gateway: Gateway, session_id: str, command: str) -> dict:
    response = await gateway.client.post(f"/v1/sessions/{session_id}/step",
                                         json={"action": {"tool": "bash", "arguments": {"command": command}}})
    assert response.status_code == 200, response.text
    return response.json()


async def snapshot(gateway: Gateway, session_id: str) -> dict:
    response = await gateway.client.post(f"/v1/sessions/{session_id}/snapshot")
    assert response.status_code == 201, response.text
    return response.json()


async def fork(gateway: Gateway, snapshot_id: str, n: int) -> list[dict]:
    response = await gateway.client.post(f"/v1/snapshots/{snapshot_id}/fork", json={"n": n})
    assert response.status_code == 201, response.text
    return response.json()["items"]


async def steps_of(gateway: Gateway, session_id: str, limit: int = 100) -> list[dict]:
    """Return every step of a session, paging ``GET /v1/sessions/{id}/steps`` by ``limit``."""
    items, cursor = [], None
    for _ in range(10_000):
        params = {"limit": limit, **({"cursor": cursor} if cursor else {})}
        page = (await gateway.client.get(f"/v1/sessions/{session_id}/steps", params=params)).json()
        items += page["items"]
        cursor = page["next"]
        if cursor is None:
            assert page["steps"] == len(items) and [s["seq"] for s in items] == list(range(len(items)))
            return items
    raise AssertionError("the steps never ended")


async def test_fork_continues_with_history_and_state(gateway):
    task = await gateway.import_task()
    source = await gateway.open_session(task["id"])
    await step(gateway, source["id"], "echo one")
    await step(gateway, source["id"], "solve it")
    snap = await snapshot(gateway, source["id"])
    assert snap["session_id"] == source["id"] and snap["task_id"] == task["id"]
    assert snap["pinned"] is False and snap["steps"] == 2
    assert snap["metadata"]["background_processes"] == "not captured"

    forks = await fork(gateway, snap["id"], 3)
    assert len({f["id"] for f in forks} | {source["id"]}) == 4
    for f in forks:
        assert f["task_id"] == task["id"] and f["state"] == "open" and f["snapshot_id"] == snap["id"]
        assert f["steps"] == 2
        history = await steps_of(gateway, f["id"])
        assert [h["action"]["arguments"]["command"] for h in history] == ["echo one", "solve it"]
        assert {h["session_id"] for h in history} == {source["id"]}  # inherited: the source's rows
        assert f["observation"] == history[-1]["observation"]
        assert {t["function"]["name"] for t in f["tools"]} == {"bash", "submit"}
        info = (await gateway.client.get(f"/v1/sessions/{f['id']}")).json()
        assert info["steps"] == 2 and info["snapshot_id"] == snap["id"]
    # The fork carries the state: the solved flag from before the snapshot wins the reward.
    done = (await gateway.client.post(f"/v1/sessions/{forks[0]['id']}/step",
                                      json={"action": {"tool": "submit"}})).json()
    assert done["reward"] == 1.0
    # The source goes on independently.
    assert (await step(gateway, source["id"], "echo still here"))["observation"].startswith("still here")
    for f in forks[1:]:
        assert (await gateway.client.delete(f"/v1/sessions/{f['id']}")).status_code == 204


async def test_fork_of_a_fresh_session_answers_the_instruction_and_a_fork_can_be_snapshotted(gateway):
    task = await gateway.import_task("fresh")
    source = await gateway.open_session(task["id"])
    snap = await snapshot(gateway, source["id"])
    (child,) = await fork(gateway, snap["id"], 1)
    assert child["observation"] == source["observation"] and child["steps"] == 0
    assert await steps_of(gateway, child["id"]) == []
    await step(gateway, child["id"], "echo in child")
    grand = await snapshot(gateway, child["id"])
    (grandchild,) = await fork(gateway, grand["id"], 1)
    assert [h["observation"] for h in await steps_of(gateway, grandchild["id"])] == ["in child\n[exit code 0]"]
    assert grandchild["observation"] == "in child\n[exit code 0]"


async def test_a_fork_snapshotted_before_its_first_step_answers_its_ancestors_last_observation(gateway):
    """The last observation is read from the ancestor that took the step, however far up."""
    task = await gateway.import_task("inherited")
    root = await gateway.open_session(task["id"])
    await step(gateway, root["id"], "echo r0")
    (child,) = await fork(gateway, (await snapshot(gateway, root["id"]))["id"], 1)
    (grandchild,) = await fork(gateway, (await snapshot(gateway, child["id"]))["id"], 1)
    (great,) = await fork(gateway, (await snapshot(gateway, grandchild["id"]))["id"], 1)
    for session in (child, grandchild, great):
        assert session["observation"] == "r0\n[exit code 0]" and session["steps"] == 1


async def test_steps_of_forks_of_forks_page_across_their_ancestors(gateway):
    """Each fork inherits its source's steps up to the snapshot, by reference; pages cross the seams."""
    task = await gateway.import_task("lineage")
    root = await gateway.open_session(task["id"])
    for i in range(5):
        await step(gateway, root["id"], f"echo r{i}")
    (child,) = await fork(gateway, (await snapshot(gateway, root["id"]))["id"], 1)
    await step(gateway, root["id"], "echo root-after")  # not the child's
    for i in range(4):
        await step(gateway, child["id"], f"echo c{i}")
    (grandchild,) = await fork(gateway, (await snapshot(gateway, child["id"]))["id"], 1)
    await step(gateway, grandchild["id"], "echo g0")
    expected = [f"echo r{i}" for i in range(5)] + [f"echo c{i}" for i in range(4)] + ["echo g0"]
    owners = [root["id"]] * 5 + [child["id"]] * 4 + [grandchild["id"]]
    for limit in (1, 3, 4, 100):
        history = await steps_of(gateway, grandchild["id"], limit=limit)
        assert [h["action"]["arguments"]["command"] for h in history] == expected, limit
        assert [h["session_id"] for h in history] == owners
    assert [h["action"]["arguments"]["command"] for h in await steps_of(gateway, root["id"])] == [
        *expected[:5], "echo root-after"]
    assert_error(await gateway.client.get("/v1/sessions/sess_nope/steps"), 404, "not_found")
    assert_error(await gateway.client.get(f"/v1/sessions/{root['id']}/steps", params={"cursor": "x"}),
                 422, "validation_error")


async def test_errors(gateway):
    task = await gateway.import_task("errs")
    source = await gateway.open_session(task["id"])
    snap = await snapshot(gateway, source["id"])
    assert_error(await gateway.client.post("/v1/sessions/sess_nope/snapshot"), 404, "not_found")
    assert_error(await gateway.client.post("/v1/snapshots/snap_nope/fork", json={"n": 1}), 404, "not_found")
    assert_error(await gateway.client.get("/v1/snapshots/snap_nope"), 404, "not_found")
    assert_error(await gateway.client.delete("/v1/snapshots/snap_nope"), 404, "not_found")
    for n in (0, 65, "x"):
        assert_error(await gateway.client.post(f"/v1/snapshots/{snap['id']}/fork", json={"n": n}), 422,
                     "validation_error")
    assert (await gateway.client.delete(f"/v1/sessions/{source['id']}")).status_code == 204
    assert_error(await gateway.client.post(f"/v1/sessions/{source['id']}/snapshot"), 409, "session_closed")
    # Nothing held the snapshot but its source: closing the source deleted and freed it.
    assert_error(await gateway.client.get(f"/v1/snapshots/{snap['id']}"), 404, "not_found")
    assert gateway.runtime.snapshots == {}


async def test_a_snapshot_lives_while_its_source_a_fork_or_its_pin_holds_it(gateway):
    task = await gateway.import_task("holders")
    source = await gateway.open_session(task["id"])
    kept, forked, loose = [await snapshot(gateway, source["id"]) for _ in range(3)]
    assert (await gateway.client.post(f"/v1/snapshots/{kept['id']}/pin")).json()["pinned"] is True
    (child,) = await fork(gateway, forked["id"], 1)
    assert child["state"] == "open" and len(gateway.runtime.snapshots) == 3
    assert (await gateway.client.delete(f"/v1/sessions/{source['id']}")).status_code == 204
    # The pinned one and the one with an open fork stay; the one only its source held is gone.
    assert_error(await gateway.client.get(f"/v1/snapshots/{loose['id']}"), 404, "not_found")
    listed = (await gateway.client.get("/v1/snapshots", params={"session_id": source["id"]})).json()["items"]
    assert {s["id"] for s in listed} == {kept["id"], forked["id"]}
    assert len(gateway.runtime.snapshots) == 2
    assert (await fork(gateway, forked["id"], 1))[0]["state"] == "open"  # still usable while held
    for session in (await gateway.client.get("/v1/sessions", params={"state": "open"})).json()["items"]:
        assert (await gateway.client.delete(f"/v1/sessions/{session['id']}")).status_code == 204
    assert_error(await gateway.client.get(f"/v1/snapshots/{forked['id']}"), 404, "not_found")
    assert len(gateway.runtime.snapshots) == 1  # the pinned one
    assert (await gateway.client.post(f"/v1/snapshots/{kept['id']}/unpin")).json()["pinned"] is False
    assert gateway.runtime.snapshots == {}
    assert_error(await gateway.client.post(f"/v1/snapshots/{kept['id']}/pin"), 404, "not_found")


async def test_pin_blocks_delete_and_delete_frees_an_unheld_snapshot(gateway):
    task = await gateway.import_task("pin")
    source = await gateway.open_session(task["id"])
    snap = await snapshot(gateway, source["id"])
    assert (await gateway.client.post(f"/v1/snapshots/{snap['id']}/pin")).json()["pinned"] is True
    assert_error(await gateway.client.delete(f"/v1/snapshots/{snap['id']}"), 409, "snapshot_pinned")
    assert len(gateway.runtime.snapshots) == 1
    assert (await gateway.client.post(f"/v1/snapshots/{snap['id']}/unpin")).json()["pinned"] is False
    assert (await gateway.client.delete(f"/v1/snapshots/{snap['id']}")).status_code == 204
    assert gateway.runtime.snapshots == {} and len(gateway.runtime.deleted_snapshots) == 1
    assert_error(await gateway.client.get(f"/v1/snapshots/{snap['id']}"), 404, "not_found")
    assert_error(await gateway.client.post(f"/v1/snapshots/{snap['id']}/fork", json={"n": 1}), 404, "not_found")
    assert (await gateway.client.delete(f"/v1/snapshots/{snap['id']}")).status_code == 204  # idempotent


async def test_rows_sharing_a_backend_snapshot_free_it_only_when_the_last_goes(gateway, monkeypatch):
    """A backend may hand two snapshots the same content-addressed id: freeing waits for the last row of it."""
    from gateway.snapshots.collection import live_backend_snapshot_ids

    runtime = gateway.runtime
    taken = runtime.snapshot_session
    shared: list[str] = []  # the backend id the next snapshots get, once the first is taken

    async def same_id(session_id, **kwargs):
        snap = await taken(session_id, **kwargs)
        if not shared:
            shared.append(snap.id)
        elif snap.id != shared[0]:
            runtime.snapshots.pop(snap.id)
            snap = dataclasses.replace(snap, sandbox=dataclasses.replace(snap.sandbox, id=shared[0]))
        return snap

    task = await gateway.import_task("shared")
    source = await gateway.open_session(task["id"])
    await snapshot(gateway, source["id"])  # a row of a backend snapshot of its own
    monkeypatch.setattr(runtime, "snapshot_session", same_id)
    first, second = await snapshot(gateway, source["id"]), await snapshot(gateway, source["id"])
    assert len(runtime.snapshots) == 2 and shared[0] in runtime.snapshots
    async with gateway.app.state.sessionmaker() as db:
        assert await live_backend_snapshot_ids(db_session=db, node=runtime.node) == set(runtime.snapshots)
    assert (await gateway.client.delete(f"/v1/snapshots/{first['id']}")).status_code == 204
    assert runtime.deleted_snapshots == [] and shared[0] in runtime.snapshots  # the second row holds it
    (child,) = await fork(gateway, second["id"], 1)
    assert (await gateway.client.delete(f"/v1/sessions/{child['id']}")).status_code == 204
    assert (await gateway.client.delete(f"/v1/snapshots/{second['id']}")).status_code == 204
    assert runtime.deleted_snapshots == shared and len(runtime.snapshots) == 1
    async with gateway.app.state.sessionmaker() as db:
        assert await live_backend_snapshot_ids(db_session=db, node=runtime.node) == set(runtime.snapshots)


async def test_open_forks_hold_a_deleted_snapshot_until_they_end(gateway):
    task = await gateway.import_task("gc")
    source = await gateway.open_session(task["id"])
    snap = await snapshot(gateway, source["id"])
    a, b = await fork(gateway, snap["id"], 2)
    assert (await gateway.client.delete(f"/v1/snapshots/{snap['id']}")).status_code == 204
    assert_error(await gateway.client.get(f"/v1/snapshots/{snap['id']}"), 404, "not_found")
    assert len(gateway.runtime.snapshots) == 1  # held by two open forks
    assert (await gateway.client.delete(f"/v1/sessions/{a['id']}")).status_code == 204
    assert len(gateway.runtime.snapshots) == 1  # still held by b
    await gateway.client.post(f"/v1/sessions/{b['id']}/step", json={"action": {"tool": "submit"}})
    assert gateway.runtime.snapshots == {}  # b's episode ended: the last holder let go


async def test_list_pages_and_filters(gateway):
    task = await gateway.import_task("list")
    s1 = await gateway.open_session(task["id"])
    s2 = await gateway.open_session(task["id"])
    ids = [(await snapshot(gateway, sid))["id"] for sid in (s1["id"], s1["id"], s2["id"])]
    first = (await gateway.client.get("/v1/snapshots", params={"limit": 2})).json()
    second = (await gateway.client.get("/v1/snapshots", params={"limit": 2, "cursor": first["next"]})).json()
    assert [s["id"] for s in first["items"] + second["items"]] == ids and second["next"] is None
    only = (await gateway.client.get("/v1/snapshots", params={"session_id": s2["id"]})).json()
    assert [s["id"] for s in only["items"]] == ids[2:]


async def test_fork_respects_the_open_session_limit(tmp_path):
    from gateway.app import create_app
    from tests.gateway.conftest import FakeRuntime, asgi_client, make_settings

    app = create_app(make_settings(tmp_path, sessions={"max_open": 3}), runtime=FakeRuntime())
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        gw = Gateway(app, app.state.runtime, client)
        task = await gw.import_task("limit")
        source = await gw.open_session(task["id"])
        snap = await snapshot(gw, source["id"])
        started = len(gw.runtime.sessions)
        assert_error(await client.post(f"/v1/snapshots/{snap['id']}/fork", json={"n": 3}), 429, "rate_limited")
        assert len(gw.runtime.sessions) == started  # refused before any sandbox started
        assert len(await fork(gw, snap["id"], 2)) == 2


async def test_a_fork_of_a_snapshot_this_process_recorded_restores_while_its_row_is_read(gateway, monkeypatch):
    """Not the sole gateway: the row's checks (live? under the limit?) run beside the restore, undone when they fail."""
    import asyncio

    from gateway.snapshots import service as snapshots_service

    monkeypatch.setattr(gateway.runtime, "sole_gateway", False)

    task = await gateway.import_task("eager")
    source = await gateway.open_session(task["id"])
    snap = await snapshot(gateway, source["id"])
    order: list[str] = []
    real_fork, real_live = gateway.runtime.fork_session, snapshots_service._live

    async def fork_session(*args, launched, **kwargs):
        order.append("restore")
        await asyncio.sleep(0.01)  # the reads wait for the launch

        def say_launched():
            order.append("launched")
            launched()

        return await real_fork(*args, launched=say_launched, **kwargs)

    async def live(db_session, snapshot_id):
        order.append("read")
        return await real_live(db_session, snapshot_id)

    monkeypatch.setattr(gateway.runtime, "fork_session", fork_session)
    monkeypatch.setattr(snapshots_service, "_live", live)
    (child,) = await fork(gateway, snap["id"], 1)
    # Its row is read twice once the restore is launched: before the forks' rows go in and after.
    assert order == ["restore", "launched", "read", "read"] and child["steps"] == 0 and child["snapshot_id"] == snap["id"]
    # Deleted (but known here): the restore that started is undone and the answer is 404.
    assert (await gateway.client.post(f"/v1/snapshots/{snap['id']}/pin")).status_code == 200
    assert (await gateway.client.post(f"/v1/snapshots/{snap['id']}/unpin")).status_code == 200
    await gateway.client.delete(f"/v1/sessions/{child['id']}")
    assert (await gateway.client.delete(f"/v1/snapshots/{snap['id']}")).status_code == 204
    before = set(gateway.runtime.sessions)
    assert_error(await gateway.client.post(f"/v1/snapshots/{snap['id']}/fork", json={"n": 2}), 404, "not_found")
    assert set(gateway.runtime.sessions) == before
    opened = (await gateway.client.get("/v1/sessions", params={"state": "open"})).json()["items"]
    assert [s["id"] for s in opened] == [source["id"]]  # no row of the refused forks is left open


async def test_a_fork_closed_while_it_starts_stays_closed_and_keeps_no_sandbox(gateway, monkeypatch):
    """Not the sole gateway: the forks' rows are written while their sandboxes start, and can be closed."""
    import asyncio

    monkeypatch.setattr(gateway.runtime, "sole_gateway", False)

    task = await gateway.import_task("close-mid-fork")
    source = await gateway.open_session(task["id"])
    snap = await snapshot(gateway, source["id"])
    started, release = asyncio.Event(), asyncio.Event()
    real_fork = gateway.runtime.fork_session

    async def slow_fork(*args, launched, **kwargs):
        started.set()
        launched()  # and slow to finish: the forks' rows are written meanwhile
        await release.wait()
        return await real_fork(*args, **kwargs)

    monkeypatch.setattr(gateway.runtime, "fork_session", slow_fork)
    forking = asyncio.ensure_future(gateway.client.post(f"/v1/snapshots/{snap['id']}/fork", json={"n": 2}))
    await asyncio.wait_for(started.wait(), 10)
    for _ in range(500):  # the forks' rows are written while their sandboxes are restored
        rows = (await gateway.client.get("/v1/sessions", params={"state": "open"})).json()["items"]
        if len(rows) == 3:
            break
        await asyncio.sleep(0.01)
    doomed = next(r["id"] for r in rows if r["id"] != source["id"])
    assert (await gateway.client.delete(f"/v1/sessions/{doomed}")).status_code == 204  # before its sandbox exists
    release.set()
    response = await forking
    assert response.status_code == 201, response.text
    forks = [f["id"] for f in response.json()["items"]]
    assert doomed in forks and len(forks) == 2
    states = {i: (await gateway.client.get(f"/v1/sessions/{i}")).json()["state"] for i in forks}
    assert states[doomed] == "closed" and sorted(states.values()) == ["closed", "open"]
    assert doomed not in gateway.runtime.sessions  # its sandbox went with it
    assert set(gateway.runtime.sessions) == {source["id"]} | {i for i, st in states.items() if st == "open"}


async def test_a_snapshot_of_a_session_this_process_steps_reads_no_row_and_its_own_is_written_behind(
    gateway, monkeypatch
):
    """The gate's facts give the step count and observation; the row follows the answer, read back settled."""
    from gateway.snapshots import service as snapshots_service

    async def no_read(*args, **kwargs):
        raise AssertionError("the source session's row was read")

    task = await gateway.import_task("facts")
    source = await gateway.open_session(task["id"])
    for command in ("echo one", "echo two", "echo three"):
        last = await step(gateway, source["id"], command)
    monkeypatch.setattr(snapshots_service, "_read_source", no_read)
    snap = await snapshot(gateway, source["id"])
    assert snap["steps"] == 3
    # Read back at once: GET settles the row written behind the answer.
    read = (await gateway.client.get(f"/v1/snapshots/{snap['id']}")).json()
    assert read["steps"] == 3 and read["session_id"] == source["id"]
    (child,) = await fork(gateway, snap["id"], 1)
    assert child["observation"] == last["observation"] and child["steps"] == 3
    # The fork's facts carry on from the snapshot: its own snapshot counts both.
    await step(gateway, child["id"], "echo four")
    again = await snapshot(gateway, child["id"])
    assert again["steps"] == 4
    (grandchild,) = await fork(gateway, again["id"], 1)
    history = await steps_of(gateway, grandchild["id"])
    assert [h["action"]["arguments"]["command"] for h in history] == ["echo one", "echo two", "echo three", "echo four"]
    assert grandchild["observation"] == history[-1]["observation"]


async def test_a_snapshot_without_kept_facts_reads_the_row_as_the_facts_would_say(gateway):
    """A session whose facts the gate dropped (or another gateway's) is read from its records: same answer."""
    from gateway.dependencies import step_gate_of

    task = await gateway.import_task("no-facts")
    source = await gateway.open_session(task["id"])
    await step(gateway, source["id"], "echo one")
    last = await step(gateway, source["id"], "echo two")
    gate = step_gate_of(gateway.app)
    kept = gate.facts(source["id"])
    assert kept is not None and (kept.steps, kept.observation) == (2, last["observation"])
    gate.forget(source["id"])
    snap = await snapshot(gateway, source["id"])
    assert snap["steps"] == 2
    (child,) = await fork(gateway, snap["id"], 1)
    assert child["observation"] == last["observation"]
    relearned = gate.facts(source["id"])  # the read is kept for the next snapshot
    assert relearned is not None and (relearned.steps, relearned.observation) == (2, last["observation"])
    # A terminal step or a close drops them.
    await gateway.client.delete(f"/v1/sessions/{source['id']}")
    assert gate.facts(source["id"]) is None


async def test_a_snapshot_row_that_cannot_be_written_frees_its_backend_snapshot(gateway, monkeypatch, caplog):
    from sqlalchemy import text

    from gateway.snapshots import service as snapshots_service

    task = await gateway.import_task("lost-row")
    source = await gateway.open_session(task["id"])
    await step(gateway, source["id"], "echo one")
    monkeypatch.setattr(snapshots_service, "_SNAPSHOT_INSERT", text("INSERT INTO no_such_table VALUES (1)"))
    snap = await snapshot(gateway, source["id"])  # answered before its row is written
    assert_error(await gateway.client.get(f"/v1/snapshots/{snap['id']}"), 404, "not_found")
    assert "writing a record failed" in caplog.text
    assert len(gateway.runtime.deleted_snapshots) == 1 and not gateway.runtime.snapshots  # nothing leaks
    assert snapshots_service.known_snapshots.get(snap["id"]) is None
    assert_error(await gateway.client.post(f"/v1/snapshots/{snap['id']}/fork", json={"n": 1}), 404, "not_found")
    assert (await step(gateway, source["id"], "echo two"))["terminated"] is False  # the session goes on


async def test_a_fork_whose_restore_never_says_launched_reads_its_row_when_the_restore_ends(gateway, monkeypatch):
    from gateway.snapshots import service as snapshots_service

    monkeypatch.setattr(gateway.runtime, "sole_gateway", False)

    task = await gateway.import_task("unlaunched")
    source = await gateway.open_session(task["id"])
    snap = await snapshot(gateway, source["id"])
    order: list[str] = []
    real_fork, real_live = gateway.runtime.fork_session, snapshots_service._live

    async def fork_session(*args, launched, **kwargs):  # a runtime that never calls launched
        opened = await real_fork(*args, **kwargs)
        order.append("restored")
        return opened

    async def live(db_session, snapshot_id):
        order.append("read")
        return await real_live(db_session, snapshot_id)

    monkeypatch.setattr(gateway.runtime, "fork_session", fork_session)
    monkeypatch.setattr(snapshots_service, "_live", live)
    (child,) = await fork(gateway, snap["id"], 1)
    assert order == ["restored", "read", "read"] and child["snapshot_id"] == snap["id"]
    assert (await step(gateway, child["id"], "echo on"))["terminated"] is False


async def test_a_sole_gateway_forks_a_known_snapshot_reading_nothing(gateway, monkeypatch):
    """Live, under the limit and not draining are known here; the forks' rows follow the answer and read back settled."""
    from gateway.nodes import service as nodes_service
    from gateway.sessions import service as sessions_service
    from gateway.snapshots import service as snapshots_service

    task = await gateway.import_task("behind")
    source = await gateway.open_session(task["id"])
    await step(gateway, source["id"], "echo one")
    snap = await snapshot(gateway, source["id"])

    async def live(*args, **kwargs):
        raise AssertionError("the snapshot's row was read")

    async def admission(**kwargs):
        raise AssertionError("the open sessions or the drain flag were read")

    async def is_draining(**kwargs):
        raise AssertionError("the drain flag was read")

    monkeypatch.setattr(snapshots_service, "_live", live)
    monkeypatch.setattr(snapshots_service, "get_snapshot", live)
    monkeypatch.setattr(sessions_service, "admission", admission)
    monkeypatch.setattr(nodes_service, "is_draining", is_draining)
    children = await fork(gateway, snap["id"], 2)
    assert all(c["sandbox_id"] in gateway.runtime.sandboxes for c in children)
    for child in children:  # each read at once: the reader settles the row written behind the answer
        read = (await gateway.client.get(f"/v1/sessions/{child['id']}")).json()
        assert (read["state"], read["sandbox_id"], read["snapshot_id"]) == ("open", child["sandbox_id"], snap["id"])
    # Closed right after the answer: the close settles the row first, then ends it.
    (third,) = await fork(gateway, snap["id"], 1)
    assert (await gateway.client.delete(f"/v1/sessions/{third['id']}")).status_code == 204
    assert (await gateway.client.get(f"/v1/sessions/{third['id']}")).json()["state"] == "closed"
    assert third["id"] not in gateway.runtime.sessions
    assert [h["action"]["arguments"]["command"] for h in await steps_of(gateway, children[0]["id"])] == ["echo one"]


async def test_a_snapshot_deleted_here_is_not_forked_from_memory(gateway):
    task = await gateway.import_task("deleted-here")
    source = await gateway.open_session(task["id"])
    snap = await snapshot(gateway, source["id"])
    assert (await gateway.client.delete(f"/v1/snapshots/{snap['id']}")).status_code == 204
    before = set(gateway.runtime.sessions)
    assert_error(await gateway.client.post(f"/v1/snapshots/{snap['id']}/fork", json={"n": 1}), 404, "not_found")
    assert set(gateway.runtime.sessions) == before  # refused before any sandbox started


async def test_a_collection_spares_a_snapshot_whose_fork_rows_are_not_written_yet(gateway, monkeypatch):
    """The source closes while a fork restores: nothing in the database holds the snapshot, the fork does."""
    import asyncio

    task = await gateway.import_task("held")
    source = await gateway.open_session(task["id"])
    snap = await snapshot(gateway, source["id"])
    started, release = asyncio.Event(), asyncio.Event()
    real_fork = gateway.runtime.fork_session

    async def slow_fork(*args, launched, **kwargs):
        launched()
        started.set()
        await release.wait()
        return await real_fork(*args, **kwargs)

    monkeypatch.setattr(gateway.runtime, "fork_session", slow_fork)
    forking = asyncio.ensure_future(gateway.client.post(f"/v1/snapshots/{snap['id']}/fork", json={"n": 1}))
    await asyncio.wait_for(started.wait(), 10)
    assert (await gateway.client.delete(f"/v1/sessions/{source['id']}")).status_code == 204  # collects
    assert not gateway.runtime.deleted_snapshots
    release.set()
    response = await forking
    assert response.status_code == 201, response.text
    (child,) = response.json()["items"]
    assert (await gateway.client.get(f"/v1/snapshots/{snap['id']}")).status_code == 200
    assert (await step(gateway, child["id"], "echo on"))["terminated"] is False
    # Its fork's row holds it now; when the fork ends, nothing does.
    assert (await gateway.client.delete(f"/v1/sessions/{child['id']}")).status_code == 204
    assert_error(await gateway.client.get(f"/v1/snapshots/{snap['id']}"), 404, "not_found")
    assert len(gateway.runtime.deleted_snapshots) == 1 and not gateway.runtime.snapshots


async def test_a_fork_whose_row_cannot_be_written_lets_its_sandbox_go(gateway, monkeypatch, caplog):
    from sqlalchemy import text

    from gateway.dependencies import step_gate_of
    from gateway.snapshots import service as snapshots_service

    task = await gateway.import_task("lost-fork-row")
    source = await gateway.open_session(task["id"])
    snap = await snapshot(gateway, source["id"])
    monkeypatch.setattr(snapshots_service, "_FORK_INSERT", text("INSERT INTO no_such_table VALUES (1)"))
    (child,) = await fork(gateway, snap["id"], 1)  # answered before its row is written
    await step_gate_of(gateway.app).settle()
    assert "writing a record failed" in caplog.text
    assert child["id"] not in gateway.runtime.sessions and child["sandbox_id"] not in gateway.runtime.sandboxes
    assert_error(await gateway.client.post(f"/v1/sessions/{child['id']}/step",
                                           json={"action": {"tool": "bash", "arguments": {"command": "ls"}}}),
                 404, "not_found")
    # The hold went with it: the snapshot is held by its source alone, and freed when that closes.
    await gateway.client.delete(f"/v1/sessions/{source['id']}")
    assert len(gateway.runtime.deleted_snapshots) == 1


def test_fork_holds_spare_what_a_fork_held_during_or_after_a_mark():
    from gateway.snapshots.collection import ForkHolds

    holds = ForkHolds(max_touched=2)
    before = holds.mark()
    assert not holds.holds("a", before)
    holds.begin("a", 2)
    during = holds.mark()
    assert holds.holds("a", before) and holds.holds("a", during)
    holds.end("a")
    holds.end("a")
    after = holds.mark()
    # Its rows went in after ``during``: a read that started then may have missed them.
    assert holds.holds("a", during) and not holds.holds("a", after)
    holds.begin("b")
    holds.end("b")
    holds.begin("c")
    holds.end("c")
    assert not holds.holds("a", during)  # the oldest touch is forgotten past max_touched


async def test_a_fork_whose_sandbox_is_lost_before_its_row_is_written_ends_failed(gateway, monkeypatch):
    """A step that finds the fork's sandbox gone waits for the row written behind the answer, then ends it."""
    import asyncio

    from gateway.snapshots import service as snapshots_service

    task = await gateway.import_task("lost-early")
    source = await gateway.open_session(task["id"])
    snap = await snapshot(gateway, source["id"])
    real_claim = snapshots_service._claim

    async def slow_claim(*args, **kwargs):
        await asyncio.sleep(0.2)  # the row is still being written when the step fails
        await real_claim(*args, **kwargs)

    monkeypatch.setattr(snapshots_service, "_claim", slow_claim)
    (child,) = await fork(gateway, snap["id"], 1)
    gateway.runtime.sessions.pop(child["id"])  # the worker lost it
    response = await gateway.client.post(f"/v1/sessions/{child['id']}/step",
                                         json={"action": {"tool": "bash", "arguments": {"command": "ls"}}})
    assert_error(response, 409, "session_closed")
    read = (await gateway.client.get(f"/v1/sessions/{child['id']}")).json()
    assert read["state"] == "failed" and "does not know the session" in read["error"]
