"""The console in a real browser: Playwright drives Debian's headless Chromium against a live fleet.

One distributed-mode gateway, two worker nodes (one local, one docker), real data: a
scripted rollout, a branching rollout and an open session on each backend. Every page
renders with that data and no console error; each action (drain, kill, resize, cancel,
evict) works end to end, its node command included, and lands in the audit log.

Screenshots of the main pages go to the test's temp dir, and to ``docs/console/`` with
``FORKYARD_UPDATE_SCREENSHOTS=1`` (how the README's were made).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import forkyard
from tests.conftest import leftover_sandboxes, leftover_storage
from tests.e2e.test_branching import POLICY as TREE_POLICY
from tests.e2e.test_rollouts import wait_done
from tests.e2e.test_terminal_tasks import TASKS_DIR
from tests.fleet import Fleet, fleet
from tests.live import FORKYARD, ROOT, wait_for

playwright_api = pytest.importorskip("playwright.sync_api")

pytestmark = [pytest.mark.local, pytest.mark.docker]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ORACLE = {"name": "oracle", "api": "scripted", "model": "oracle"}
SLOW = {"name": "slow", "api": "scripted", "model": "slow",
        "actions": [{"tool": "bash", "arguments": {"command": "sleep 20"}}, {"tool": "submit", "arguments": {}}]}
NODES = {"wd": "docker", "wl": "local"}
DOCS = ROOT / "docs" / "console"


class World:
    """The fleet, its keys and the data the tests look at."""

    def __init__(self, fleet_: Fleet, admin_key: str) -> None:
        self.fleet, self.admin_key = fleet_, admin_key
        self.url = fleet_.url("a")
        self.client = forkyard.Client(base_url=self.url, api_key=fleet_.api_key, timeout=300)
        self.rollout_id = self.tree_episode = ""
        self.task_ids: dict[str, str] = {}
        self.sessions: list = []

    def api(self, path: str) -> dict:
        r = httpx.get(self.url + path, headers={"Authorization": f"Bearer {self.fleet.api_key}"}, timeout=30)
        r.raise_for_status()
        return r.json()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[World]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip("Debian's chromium is not installed (.ci/test installs it)")
    workdir = tmp_path_factory.mktemp("console-fleet")
    with fleet(workdir, env={"FORKYARD_NODES__HEARTBEAT_S": "1"}) as f:
        f.start_gateway("a")
        for node, backend in NODES.items():
            f.start_worker(node, backend=backend, capacity=2)
        out = subprocess.run([str(FORKYARD), "keys", "create", "--scope", "admin", "--name", "ops"], env=f.env(),
                             capture_output=True, text=True, timeout=60, cwd=ROOT, check=True)
        w = World(f, out.stdout.strip().splitlines()[-1])
        try:
            tasks = w.task_ids = {t.name: t.id for t in w.client.tasks.import_dir(TASKS_DIR)}
            names = ["edit-config", "sensor-stats"]  # sensor-stats has a reset script: a setup cache entry
            scripted = w.client.rollouts.create(tasks={"ids": [tasks[n] for n in names]}, group_size=2,
                                                policy=ORACLE, agent={"max_turns": 4})
            tree = w.client.rollouts.create(
                tasks=[tasks["edit-config"]], group_size=1, policy=TREE_POLICY, agent={"max_turns": 8},
                branching={"at_turns": [2], "fanout": 3}, limits={"episode_timeout_s": 300, "step_timeout_s": 60})
            assert wait_done(w.client, scripted.id).status == "completed"
            assert wait_done(w.client, tree.id).status == "completed"
            w.rollout_id = scripted.id
            w.tree_episode = list(w.client.episodes.list(rollout_id=tree.id))[0].id
            for _ in NODES:  # placement spreads them: one session per node, so one per backend
                session = w.client.sessions.create(tasks[names[0]])
                session.step("bash", command="echo console-was-here && ls /")
                w.sessions.append(session)
            yield w
        finally:
            for session in w.sessions:
                session.close()
            w.client.close()
            for node in NODES:
                f.workers[node].stop()
            for node, backend in NODES.items():
                assert leftover_sandboxes(backend, node, f.data_dir(node)) == [], node
                # Also when the eviction test did not run (-k): the setup cache is emptied here.
                assert {k: v for k, v in leftover_storage(backend, node, f.data_dir(node)).items() if v} == {}, node


@pytest.fixture(scope="module")
def browser(world):
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield b
        b.close()


class Console:
    """One browser context signed in as the operator, failing the test on any console or page error."""

    def __init__(self, browser, world: World, shots: Path) -> None:
        self.world, self.shots = world, shots
        self.context = browser.new_context(viewport={"width": 1360, "height": 900}, base_url=world.url)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def login(self, key: str) -> None:
        self.page.goto("/admin/login")
        self.page.fill("#api_key", key)
        with self.page.expect_navigation():
            self.page.press("#api_key", "Enter")  # the keyboard is enough

    def open(self, path: str, shot: str | None = None):
        response = self.page.goto(path)
        assert response is not None and response.status == 200, (path, response and response.status)
        if shot:
            self.page.screenshot(path=str(self.shots / f"{shot}.png"), full_page=False)
        return self.page

    def click(self, selector: str) -> None:
        with self.page.expect_navigation():
            self.page.click(selector)

    def audit(self) -> list[str]:
        self.open("/admin/audit")
        return self.page.locator("#audit td.action").all_inner_texts()


@pytest.fixture
def console(browser, world, tmp_path) -> Iterator[Console]:
    c = Console(browser, world, tmp_path)
    c.login(world.admin_key)
    yield c
    c.context.close()
    assert c.errors == [], c.errors
    if os.environ.get("FORKYARD_UPDATE_SCREENSHOTS") == "1":
        DOCS.mkdir(parents=True, exist_ok=True)
        for shot in tmp_path.glob("*.png"):
            shutil.copyfile(shot, DOCS / shot.name)


def test_every_page_renders_the_fleet_data_without_console_errors(console, world):
    page = console.open("/admin", "overview")
    assert page.locator("h1").inner_text() == "Overview"
    assert page.locator(".card strong.up").inner_text() == "2"
    page = console.open("/admin/nodes", "nodes")
    assert set(page.locator("tr[data-node]").evaluate_all("rows => rows.map(r => r.dataset.node)")) == set(NODES)
    for stages in page.locator("tr[data-node] td.stages").all_inner_texts():  # setup · agent · verify, in use now
        assert [part.isdigit() for part in stages.split(" · ")] == [True, True, True], stages
    page = console.open("/admin/sandboxes", "sandboxes")
    listed = page.locator("tbody").inner_text()
    for session in world.sessions:
        assert session.id in listed
    session_ids = {session.id for session in world.sessions}
    backends = {r["backend"] for r in world.api("/v1/sandboxes")["items"] if r["session_id"] in session_ids}
    assert backends == {"docker", "local"}
    (row,) = [r for r in world.api("/v1/sandboxes")["items"] if r["session_id"] == world.sessions[0].id]
    page = console.open(f"/admin/sandboxes/{row['id']}", "sandbox")
    assert "console-was-here" in page.locator("pre.output").first.inner_text()
    page = console.open("/admin/rollouts", "rollouts")
    assert world.rollout_id in page.locator("tbody").inner_text()
    page = console.open(f"/admin/rollouts/{world.rollout_id}", "rollout")
    assert page.locator("#mean-reward").inner_text() == "1.000"
    assert page.locator("svg.chart").count() == 2
    # A completed one: an attempt that failed on a noisy machine (and was run again) has no conversation.
    episode = next(e for e in world.client.episodes.list(rollout_id=world.rollout_id) if e.status == "completed")
    page = console.open(f"/admin/episodes/{episode.id}", "episode")
    assert page.locator("ol.conversation li").count() >= 2 and page.locator(".tok.loss").count() > 0
    page = console.open("/admin/pools", "pools")
    assert page.locator("section.pool").count() == 2
    page = console.open("/admin/cache", "cache")
    assert page.locator("tr[data-entry]").count() >= 1
    page = console.open("/admin/tasks", "tasks")
    assert "edit-config" in page.locator("tbody").inner_text()
    page = console.open("/admin/environments")
    assert page.locator('section[data-environment="web"] code', has_text="click").count() >= 1
    page = console.open("/admin/audit")
    assert "login" in page.locator("#audit").inner_text()


def test_the_tree_viewer_shows_the_leaves_and_rewards_of_the_api(console, world):
    tree = world.api(f"/v1/episodes/{world.tree_episode}/tree")
    page = console.open(f"/admin/episodes/{world.tree_episode}/tree", "tree")
    shown = page.locator("#leaves tbody tr").evaluate_all(
        "rows => rows.map(r => [r.dataset.episode, r.querySelector('.reward').innerText])")
    assert sorted(shown) == sorted([leaf["episode_id"], f"{leaf['reward']:g}"] for leaf in tree["leaves"])
    drawn = page.locator("svg.tree text.leaf").evaluate_all("ts => ts.map(t => [t.dataset.episode, t.dataset.reward])")
    assert sorted(drawn) == sorted(shown)
    assert page.locator("svg.tree a.node").count() == len(tree["nodes"]) - 1  # every step, the root aside
    node = tree["branch_points"][0]["node"]
    page.click(f'svg.tree a.node[data-node="{node}"]')  # htmx loads the step beside the tree
    page.wait_for_selector(f'#tree-step .step-detail[data-turn="{node.rsplit(":", 1)[1]}"]')
    assert "Observation" in page.locator("#tree-step").inner_text()
    leaf = tree["leaves"][-1]["node"]  # by keyboard: focus a node, press Enter
    page.focus(f'svg.tree a.node[data-node="{leaf}"]')
    page.keyboard.press("Enter")
    episode_id, turn = leaf.rsplit(":", 1)
    page.wait_for_selector(f'#tree-step .step-detail[data-episode="{episode_id}"][data-turn="{turn}"]')
    assert page.url.endswith("/tree")  # in place: the tree page stays
    page.screenshot(path=str(console.shots / "tree.png"))


def test_actions_work_end_to_end_and_are_audited(console, world):
    page = console.open("/admin/nodes")
    console.click('tr[data-node="wd"] button')
    assert page.locator('tr[data-node="wd"] td.state-draining').count() == 1
    assert world.api("/v1/nodes")["items"][0]["draining"] is True
    console.click('tr[data-node="wd"] button')  # undrain
    assert not any(n["draining"] for n in world.api("/v1/nodes")["items"])

    # Kill one sandbox (a session's: closed at once).
    session = world.sessions.pop()
    (row,) = [r for r in world.api("/v1/sandboxes")["items"] if r["session_id"] == session.id]
    console.open(f"/admin/sandboxes/{row['id']}")
    console.click("text=Kill this sandbox")
    assert "closed" in page.locator(".notice").inner_text()
    assert world.api(f"/v1/sessions/{session.id}")["state"] == "closed"

    # Resize a pool key: the node carries it out at its next heartbeat.
    console.open("/admin/pools")
    key_row = page.locator("section.pool tr[data-key]").first
    key_id, node = key_row.get_attribute("data-key"), key_row.locator("xpath=ancestor::section").get_attribute("data-node")
    key_row.locator('input[name="size"]').fill("5")
    with page.expect_navigation():
        key_row.locator("button").click()

    def resized():
        load = {n["name"]: n["load"] for n in world.api("/v1/nodes")["items"]}[node]
        return any(k["id"] == key_id and k["target"] == 5 for k in load["pool"]["by_key"])
    wait_for(resized, 30, "the pool key's new target in the node's heartbeat")

    # Evict a setup cache entry.
    console.open("/admin/cache")
    entry = page.locator("tr[data-entry]").first
    entry_id = entry.get_attribute("data-entry")
    entry_node = entry.locator("xpath=ancestor::section").get_attribute("data-node")
    with page.expect_navigation():
        entry.locator("button").click()

    def evicted():
        load = {n["name"]: n["load"] for n in world.api("/v1/nodes")["items"]}[entry_node]
        return all(e["id"] != entry_id for e in load["setup_cache"]["items"])
    wait_for(evicted, 30, "the cache entry gone from the node's heartbeat")

    # Cancel a rollout that is still running.
    slow = world.client.rollouts.create(tasks=[world.task_ids["edit-config"]], group_size=2, policy=SLOW)
    console.open(f"/admin/rollouts/{slow.id}")
    console.click("text=Cancel this rollout")
    assert wait_done(world.client, slow.id, timeout_s=60).status == "cancelled"

    console.open("/admin/nodes")
    assert page.locator("td.state-done").count() >= 2  # the resize and the eviction, run by their nodes
    actions = console.audit()
    for action in ("node.drain", "node.undrain", "sandbox.kill", "pool.resize", "cache.evict", "rollout.cancel"):
        assert action in actions, actions


def test_trainer_keys_csrf_and_logout(browser, world, tmp_path):
    outsider = Console(browser, world, tmp_path)
    outsider.login(world.fleet.api_key)  # a trainer key
    assert "not an admin key" in outsider.page.locator(".error").inner_text()
    assert outsider.page.goto("/admin/nodes").url.endswith("/admin/login")
    outsider.context.close()

    c = Console(browser, world, tmp_path)
    c.login(world.admin_key)
    forged = c.context.request.post(world.url + "/admin/nodes/wl/drain", form={})  # the cookie, not the token
    assert forged.status == 403
    assert not any(n["draining"] for n in world.api("/v1/nodes")["items"])
    c.open("/admin")
    c.click("text=Sign out")
    assert c.page.url.endswith("/admin/login?msg=Signed+out.")
    assert c.page.goto(world.url + "/admin/rollouts").url.endswith("/admin/login")
    c.context.close()
    assert c.errors == []
