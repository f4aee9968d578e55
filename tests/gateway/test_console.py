"""The console's access rules, actions and pages, in-process (a fake runtime under a real app and database).

The browser drives the same pages against a live gateway with real sandboxes in
tests/e2e/test_console_browser.py; these tests pin the rules one by one.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from gateway.app import create_app
from gateway.auth.service import create_api_key, revoke_api_key
from gateway.console.models import AuditEntry
from gateway.console.queries import PAGE_SIZE, failure_reason
from gateway.console.tree import layout
from gateway.nodes import service as nodes_service
from gateway.nodes.heartbeat import Heartbeat
from gateway.nodes.models import NodeCommand
from tests.gateway.conftest import API_KEY, NODE, FakeRuntime, asgi_client, make_settings
from tests.gateway.rollout_helpers import (
    create_rollout,
    episodes_of,
    import_tasks,
    play_episode,
    recording_dispatcher,
)

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


class Console:
    """A gateway app, an API client (trainer key), and a browser-like client for ``/admin``."""

    def __init__(self, app, runtime: FakeRuntime, api: httpx.AsyncClient, web: httpx.AsyncClient,
                 admin_key: str) -> None:
        self.app, self.runtime, self.api, self.web, self.admin_key = app, runtime, api, web, admin_key
        self.csrf = ""

    async def login(self) -> None:
        response = await self.web.post("/admin/login", data={"api_key": self.admin_key})
        assert response.status_code == 303 and response.headers["location"] == "/admin", response.text
        page = await self.web.get("/admin")
        assert page.status_code == 200
        self.csrf = CSRF.search(page.text).group(1)

    async def act(self, url: str, **form: object) -> httpx.Response:
        return await self.web.post(url, data={"csrf_token": self.csrf, **form})

    async def audit(self) -> list[tuple[str, str]]:
        async with self.app.state.sessionmaker() as db:
            return [(a.action, a.target) for a in (await db.scalars(select(AuditEntry).order_by(AuditEntry.id))).all()]


@pytest.fixture
async def console(tmp_path: Path) -> AsyncIterator[Console]:
    runtime = FakeRuntime()
    app = create_app(make_settings(tmp_path), runtime=runtime)
    async with app.router.lifespan_context(app):
        async with app.state.sessionmaker() as db:
            admin = await create_api_key(db_session=db, name="ops", scope="admin")
        async with asgi_client(app) as api, asgi_client(app, api_key=None) as web:
            yield Console(app, runtime, api, web, admin.key)


async def test_signing_in_takes_an_admin_key_and_sets_a_strict_httponly_cookie(console):
    assert (await console.web.get("/admin")).headers["location"] == "/admin/login"  # not signed in: to the login
    trainer = await console.web.post("/admin/login", data={"api_key": API_KEY})
    assert trainer.status_code == 401 and "not an admin key" in trainer.text
    assert "set-cookie" not in trainer.headers
    unknown = await console.web.post("/admin/login", data={"api_key": "fy_" + "x" * 43})
    assert unknown.status_code == 401 and "set-cookie" not in unknown.headers
    response = await console.web.post("/admin/login", data={"api_key": console.admin_key})
    cookie = response.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/admin" in cookie
    assert (await console.web.get("/admin")).status_code == 200
    assert ("login", "console") in await console.audit()


async def test_the_cookie_of_a_revoked_key_stops_working(console):
    await console.login()
    async with console.app.state.sessionmaker() as db:
        (row,) = [k for k in await _keys(db) if k.scope == "admin"]
        await revoke_api_key(db_session=db, key_id=row.id)
    assert (await console.web.get("/admin/nodes")).status_code == 303


async def _keys(db):
    from gateway.auth.service import list_api_keys

    return await list_api_keys(db_session=db)


async def test_an_action_without_the_csrf_token_is_refused_and_changes_nothing(console):
    await console.login()
    refused = await console.web.post(f"/admin/nodes/{NODE}/drain", data={})
    assert refused.status_code == 403 and "CSRF" in refused.text
    wrong = await console.web.post(f"/admin/nodes/{NODE}/drain", data={"csrf_token": "not-the-token"})
    assert wrong.status_code == 403
    nodes = (await console.api.get("/v1/nodes")).json()["items"]
    assert [n["draining"] for n in nodes] == [False]
    assert [a for a, _ in await console.audit()] == ["login"]


async def test_drain_and_undrain_a_node_each_audited(console):
    await console.login()
    done = await console.act(f"/admin/nodes/{NODE}/drain")
    assert done.status_code == 303 and "draining" in done.headers["location"]
    assert (await console.api.get("/v1/nodes")).json()["items"][0]["state"] == "draining"
    header = await console.web.post(f"/admin/nodes/{NODE}/undrain", headers={"X-CSRF-Token": console.csrf})
    assert header.status_code == 303  # htmx sends the token as a header
    assert (await console.api.get("/v1/nodes")).json()["items"][0]["state"] == "up"
    assert await console.audit() == [("login", "console"), ("node.drain", NODE), ("node.undrain", NODE)]


async def test_logout_ends_the_session_server_side(console):
    await console.login()
    cookie = console.web.cookies.get("forkyard_admin")
    out = await console.act("/admin/logout")
    assert out.status_code == 303 and out.headers["location"].startswith("/admin/login")
    console.web.cookies.set("forkyard_admin", cookie, path="/admin")  # a stolen copy of the cookie
    assert (await console.web.get("/admin")).status_code == 303
    assert [a for a, _ in await console.audit()] == ["login", "logout"]


async def test_killing_a_session_sandbox_closes_its_session(console):
    await console.login()
    (task_id,) = await import_tasks(console.api, ["k"])
    session = (await console.api.post("/v1/sessions", json={"task_id": task_id})).json()
    (row,) = (await console.api.get("/v1/sandboxes")).json()["items"]
    preview = await console.web.get("/admin/sandboxes/kill", params={"owner": session["id"]})
    assert '<strong id="kill-count">1</strong>' in preview.text
    stale = await console.act("/admin/sandboxes/kill", owner=session["id"], state="live", expected=2)
    assert "selection changed" in httpx.URL(stale.headers["location"]).params["err"]
    done = await console.act("/admin/sandboxes/kill", owner=session["id"], state="live", expected=1)
    assert "1 session sandbox(es) closed" in httpx.URL(done.headers["location"]).params["msg"]
    assert (await console.api.get(f"/v1/sessions/{session['id']}")).json()["state"] == "closed"
    assert row["id"] not in console.runtime.sandboxes
    assert ("sandbox.kill", "1 sandboxes") in await console.audit()


async def test_a_node_runs_the_commands_queued_for_it_at_its_heartbeat(console):
    await console.login()
    orphan = console.runtime.add_orphan("ep_someone")
    heartbeat = Heartbeat(console.app.state.sessionmaker, node=NODE, backend="fake", capacity=1,
                          load=console.runtime.load_report, interval_s=5, sandboxes=console.runtime.list_sandboxes,
                          commands=console.runtime.run_command)
    await heartbeat.record_sandboxes()
    page = await console.web.get(f"/admin/sandboxes/{orphan}")
    assert page.status_code == 200 and "Kill this sandbox" in page.text
    queued = await console.act(f"/admin/sandboxes/{orphan}/kill")
    assert "queued" in httpx.URL(queued.headers["location"]).params["msg"]
    assert orphan in console.runtime.sandboxes  # not yet: the node runs it at its next beat
    resize = await console.act("/admin/pools/resize", node=NODE, key="0123456789abcdef", size=3)
    assert resize.status_code == 303
    assert await heartbeat.run_commands() == 2
    assert orphan not in console.runtime.sandboxes
    async with console.app.state.sessionmaker() as db:
        commands = {c.kind: (c.state, c.result) for c in (await db.scalars(select(NodeCommand))).all()}
    assert commands["kill_sandbox"] == ("done", f"destroyed sandbox {orphan}")
    assert commands["resize_pool"][0] == "failed"  # this runtime has no pool: said, not dropped
    assert await heartbeat.run_commands() == 0
    nodes_page = await console.web.get("/admin/nodes")
    assert "kill_sandbox" in nodes_page.text and "cannot resize_pool here" in nodes_page.text
    assert [a for a, _ in await console.audit()] == ["login", "sandbox.kill", "pool.resize"]


async def test_cancel_a_rollout_and_every_page_renders_its_data(console):
    await console.login()
    task_ids = await import_tasks(console.api, ["r1", "r2"])
    with recording_dispatcher(console.app) as dispatcher:
        rollout = await create_rollout(console.api, task_ids, group_size=2)
        episodes = await episodes_of(console.app.state.sessionmaker, rollout["id"])
        for i, episode in enumerate(episodes[:3]):
            await play_episode(console.app.state.sessionmaker, episode.id, reward=float(i % 2), versions=(3, 4), seed=i)
        page = await console.web.get(f"/admin/rollouts/{rollout['id']}")
        assert page.status_code == 200
        assert 'id="mean-reward">0.333' in page.text and "Cancel this rollout" in page.text
        episode_page = await console.web.get(f"/admin/episodes/{episodes[0].id}")
        assert "do it" in episode_page.text and "echo 0" in episode_page.text  # conversation and the turns
        assert 'class="tok loss"' in episode_page.text and "logprob" in episode_page.text
        tree = await console.web.get(f"/admin/episodes/{episodes[1].id}/tree")
        assert f'data-episode="{episodes[1].id}"' in tree.text and 'data-reward="1"' in tree.text
        step = await console.web.get(f"/admin/episodes/{episodes[1].id}/steps/1", headers={"HX-Request": "true"})
        assert "turn 1" in step.text and "<html" not in step.text  # a fragment for htmx
        cancel = await console.act(f"/admin/rollouts/{rollout['id']}/cancel")
        assert cancel.status_code == 303 and dispatcher.cancelled == [rollout["id"]]
    assert (await console.api.get(f"/v1/rollouts/{rollout['id']}")).json()["status"] == "cancelled"
    for url in ("/admin", "/admin/nodes", "/admin/sandboxes", "/admin/pools", "/admin/cache", "/admin/rollouts",
                "/admin/tasks", "/admin/environments", "/admin/audit", "/admin/fragments/overview"):
        response = await console.web.get(url)
        assert response.status_code == 200, (url, response.text[-500:])
    assert "rollout.cancel" in (await console.web.get("/admin/audit")).text
    assert rollout["id"] in (await console.web.get("/admin/rollouts")).text
    assert "r1" in (await console.web.get("/admin/tasks")).text
    assert "bash" in (await console.web.get("/admin/environments")).text  # the terminal family's tools


async def test_import_tasks_by_upload(console):
    from tests.gateway.conftest import tar_of, task_files

    await console.login()
    archive = tar_of({"uploaded-one": task_files("uploaded-one")})
    response = await console.web.post("/admin/tasks/import", data={"csrf_token": console.csrf, "environment": "terminal"},
                                      files={"file": ("tasks.tar.gz", archive, "application/gzip")})
    assert "Imported 1 task" in httpx.URL(response.headers["location"]).params["msg"]
    assert "uploaded-one" in (await console.web.get("/admin/tasks")).text
    bad = await console.web.post("/admin/tasks/import", data={"csrf_token": console.csrf, "environment": "terminal"},
                                 files={"file": ("x.tar.gz", b"not a tar", "application/gzip")})
    assert bad.status_code == 303 and httpx.URL(bad.headers["location"]).params["err"]
    assert [a for a, _ in await console.audit()] == ["login", "tasks.import"]


async def test_long_lists_page_and_a_node_shows_its_load_by_stage(console):
    await console.login()
    async with console.app.state.sessionmaker() as db:
        for i in range(PAGE_SIZE + 5):  # a fleet longer than one page, each with a pool and a setup cache
            load = {"stages": {"setup": i % 3, "agent": i, "verify": 1},
                    "pool": {"idle": 0, "max_idle": 4, "hits": 0, "misses": 0, "by_key": []},
                    "setup_cache": {"entries": 0, "bytes": 0, "max_bytes": 1 << 20, "hits": 0, "misses": 0,
                                    "evictions": 0, "items": []}}
            await nodes_service.heartbeat(db_session=db, name=f"n{i:03d}", backend="local", capacity=8, load=load,
                                          heartbeat_s=5)
    first = await console.web.get("/admin/nodes")
    assert first.text.count('<tr data-node="') == PAGE_SIZE and 'href="/admin/nodes?page=2"' in first.text
    second = await console.web.get("/admin/nodes?page=2")
    rows = re.findall(r'<tr data-node="(n\d+)">', second.text)
    assert rows == [f"n{i:03d}" for i in range(PAGE_SIZE, PAGE_SIZE + 5)]  # by name
    assert f'<td class="stages">{(PAGE_SIZE + 4) % 3} · {PAGE_SIZE + 4} · 1</td>' in second.text
    fragment = await console.web.get("/admin/fragments/nodes?page=2")
    assert rows == re.findall(r'<tr data-node="(n\d+)">', fragment.text)
    pools = await console.web.get("/admin/pools?page=2")
    assert pools.text.count('<section class="pool"') == 5 and "page 2 of 2" in pools.text
    cache = await console.web.get("/admin/cache?nodes_page=2")
    assert len(re.findall(r'<section data-node="n\d+">', cache.text)) == 5
    environments = await console.web.get("/admin/environments?page=2")
    assert environments.status_code == 200 and "No environment." in environments.text  # one page of them
    for url, what in (("/admin/rollouts/ro_missing", "rollout ro_missing"), ("/admin/episodes/ep_missing", "episode"),
                      ("/admin/episodes/ep_missing/tree", "episode ep_missing"), ("/admin/sandboxes/sb_x", "sandbox")):
        missing = await console.web.get(url)
        assert missing.status_code == 404 and f"There is no {what}" in missing.text, url


def test_keys_create_admin_scope_from_the_cli(tmp_path, capsys):
    from gateway.cli import main

    data_dir = tmp_path / "data"
    assert main(["keys", "create", "--scope", "admin", "--name", "ops", "--data-dir", str(data_dir)]) == 0
    key = capsys.readouterr().out.strip().splitlines()[-1]
    assert key.startswith("fy_")
    assert main(["keys", "list", "--data-dir", str(data_dir)]) == 0
    assert " admin " in capsys.readouterr().out


def test_failure_reasons_group_errors_without_their_ids():
    assert failure_reason("infra: sandbox sbx_12ab crashed") == "infra"
    assert failure_reason("policy server unreachable (http://127.0.0.1:8000)") == "policy server unreachable"
    assert failure_reason(None) == "unknown"


def test_tree_layout_widths_and_colours_follow_the_leaves_below():
    tree = {"root_episode_id": "e1", "nodes": [{"id": "root"}, {"id": "e1:0"}, {"id": "e1:1"}, {"id": "e2:1"}],
            "edges": [{"parent": "root", "child": "e1:0"}, {"parent": "e1:0", "child": "e1:1"},
                      {"parent": "e1:0", "child": "e2:1"}],
            "leaves": [{"node": "e1:1", "reward": 1.0, "episode_id": "e1"},
                       {"node": "e2:1", "reward": 0.0, "episode_id": "e2"}]}
    placed = {n["id"]: n for n in layout(tree)["nodes"]}
    assert placed["e1:0"]["leaves"] == 2 and placed["e1:0"]["mean_reward"] == 0.5
    assert placed["e1:0"]["y"] == (placed["e1:1"]["y"] + placed["e2:1"]["y"]) / 2
    assert placed["e1:1"]["colour"] != placed["e2:1"]["colour"]
