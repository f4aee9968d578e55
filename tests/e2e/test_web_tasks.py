"""Web tasks in real headless Chromium, through the SDK against a live gateway, on both backends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from pathlib import Path

import pytest

import forkyard
from tests.live import FORKYARD, ROOT
from workers.archives import read_dir
from workers.envs.registry import get_family

TASKS_DIR = ROOT / "examples" / "tasks" / "web"
TASK_NAMES = sorted(p.name for p in TASKS_DIR.iterdir() if (p / "task.toml").is_file())


def import_tasks(live_gateway, path: Path) -> dict[str, str]:
    out = subprocess.run([str(FORKYARD), "tasks", "import", str(path), "--environment", "web"],
                         env=live_gateway.env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    return {parts[1]: parts[0] for parts in (ln.split() for ln in out.stdout.splitlines())
            if len(parts) >= 2 and parts[0].startswith("task_")}


@pytest.fixture(scope="module")
def imported(live_gateway):
    ids = import_tasks(live_gateway, TASKS_DIR)
    assert sorted(ids) == TASK_NAMES
    return ids


@pytest.fixture(scope="module")
def client(live_gateway):
    with forkyard.Client(base_url=live_gateway.url, api_key=live_gateway.api_key, timeout=600) as c:
        yield c


def oracle(name: str) -> list:
    family = get_family("web")
    return family.oracle(family.load_task(name, read_dir(TASKS_DIR / name, max_bytes=1 << 24, max_files=1000)))


def run(session, actions) -> object:
    result = None
    for action in actions:
        result = session.step(action.tool, **action.arguments)
        if result.terminated or result.truncated:
            return result
    return result


@pytest.mark.parametrize("name", TASK_NAMES)
def test_oracle_scores_one(client, imported, name):
    with client.sessions.create(imported[name]) as s:
        assert "Accessibility tree:" in s.observation and "URL: http://127.0.0.1:8000/" in s.observation
        assert {t["function"]["name"] for t in s.tools} >= {"click", "fill", "goto", "submit"}
        result = run(s, oracle(name))
    assert result.terminated and result.reward == 1.0, (result.observation, result.info)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_doing_nothing_scores_zero(client, imported, name):
    with client.sessions.create(imported[name]) as s:
        assert not s.step("noop").terminated
        result = s.submit()
    assert result.terminated and result.reward == 0.0, (result.observation, result.info)


def test_bad_ids_and_refused_urls_are_observations_not_crashes(client, imported):
    with client.sessions.create(imported["date-picker"]) as s:
        step = s.step("click", bid="no-such-element")
        assert not step.terminated and "no element with bid 'no-such-element'" in step.info["last_action_error"]
        for url in ["javascript:window.score = 1; window.finished = true", "data:text/html,<b>x</b>",
                    "file:///etc/passwd", "http://10.0.2.2/", "https://example.com/"]:
            step = s.step("goto", url=url)
            assert not step.terminated and "outside the task's site" in step.observation, url
        with pytest.raises(forkyard.UnprocessableEntityError):
            s.step("click")
        assert s.submit().reward == 0.0


def test_screenshots_are_artifacts_linked_from_the_step(client, imported):
    with client.sessions.create(imported["fill-form"]) as s:
        step = s.step("fill", bid="name", text="Ada Lovelace")
        (link,) = step.info["artifacts"]
        png = client.artifacts.get(link["id"])
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) == link["bytes"] > 1000
        assert int.from_bytes(png[16:20], "big") == 1024  # the viewport's width (IHDR)
        assert "iVBOR" not in step.observation and link["id"] not in step.observation
        ending = s.submit()  # no browser action: the final page is still shot
        assert ending.reward == 0.0 and ending.info["artifacts"][0]["media_type"] == "image/png"


def test_an_action_that_times_out_is_an_observation_with_the_error(client, imported):
    """The dialog's button is hidden until the dialog opens: clicking it waits its 5 s, then says so."""
    with client.sessions.create(imported["modal-dialog"]) as s:
        step = s.step("click", bid="confirm-delete")
        assert not step.terminated and step.info["last_action_error"].startswith("TimeoutError"), step.info
        assert "Last action error: TimeoutError" in step.observation
        assert s.step("click", bid="del-report").info["last_action_error"] is None  # the episode goes on
        assert s.submit().reward == 0.0


def _host_address() -> str:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))  # no packet is sent: this picks the address of the default route
        return probe.getsockname()[0]
    finally:
        probe.close()


def test_the_sandbox_reaches_neither_the_host_nor_the_outside(client, live_gateway, tmp_path):
    """A page fetch, a link, goto and Python in the sandbox all try a listener on the host: none gets through."""
    listener = socket.create_server(("0.0.0.0", 0))
    port = listener.getsockname()[1]
    accepted: list[object] = []
    listener.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                continue
            accepted.append(peer)
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    targets = [f"http://{_host_address()}:{port}/", f"http://172.17.0.1:{port}/", "http://1.1.1.1/"]
    task = tmp_path / "escape-probe"
    (task / "site").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "task.toml").write_text('[task]\ngoal = "Probe."\nstart_url = "/index.html"\nmax_steps = 10\n')
    links = "".join(f'<a bid="link{i}" href="{url}">out {i}</a>' for i, url in enumerate(targets))
    (task / "site" / "index.html").write_text(
        f"<!doctype html><title>probe</title><body>{links}<p id=out></p><script>"
        f"window.results = {{}};"
        f"for (const url of {targets!r}) fetch(url, {{mode: 'no-cors'}}).then(() => window.results[url] = 'ok', "
        f"() => window.results[url] = 'failed');"
        f"const img = new Image(); img.src = {targets[0]!r} + 'img.png';"
        f"</script></body>")
    (task / "tests" / "check.py").write_text(
        "import socket\n"
        f"for url in {targets!r}:\n"
        "    host, port = url.split('/')[2].rsplit(':', 1) if url.count(':') == 2 else (url.split('/')[2], 80)\n"
        "    try:\n"
        "        socket.create_connection((host, int(port)), timeout=2).close()\n"
        "        print('reached', url)\n"
        "        print(1)\n"
        "        raise SystemExit(0)\n"
        "    except OSError:\n"
        "        pass\n"
        "print(0)\n")
    task_id = import_tasks(live_gateway, task)["escape-probe"]
    try:
        with client.sessions.create(task_id) as s:
            for i in range(len(targets)):
                step = s.step("click", bid=f"link{i}")
                assert step.info["url"] == "http://127.0.0.1:8000/index.html" or "chrome-error" in step.info["url"]
                if "chrome-error" in step.info["url"]:
                    s.step("go_back")
            for url in targets:
                assert "outside the task's site" in s.step("goto", url=url).observation
            result = s.submit()
        assert result.reward == 0.0, result.info  # check.py, in the sandbox, reached none of them
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
    assert accepted == []


def _chromium_pids(sandbox_id: str) -> list[int]:
    """Return the host pids of the Chromium processes in ``sandbox_id`` (its cgroup names it)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{entry}/cgroup") as f:
                cgroup = f.read()
        except OSError:
            continue
        if comm.startswith("chrom") and sandbox_id in cgroup:
            found.append(int(entry))
    return found


def _cgroup_key(live_gateway, sandbox_id: str) -> str:
    if live_gateway.backend != "docker":
        return sandbox_id
    import docker

    engine = docker.from_env()
    try:
        return engine.containers.get(sandbox_id).id
    finally:
        engine.close()


def test_chromium_killed_from_the_host_is_a_visible_infra_failure(client, imported, live_gateway):
    with client.sessions.create(imported["click-button"]) as other, client.sessions.create(
            imported["click-button"]) as s:
        (row,) = [r for r in client.sandboxes.list() if r.session_id == s.id]
        pids = _chromium_pids(_cgroup_key(live_gateway, row.id))
        assert pids, "no Chromium process found in the sandbox"
        killed = 0
        for pid in pids:
            try:  # Chromium's helpers may exit with their parent before their turn comes
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        assert killed, pids
        with pytest.raises(forkyard.APIStatusError) as e:
            s.step("click", bid="submit")
        assert e.value.status_code == 503 and "browser" in e.value.message
        assert [r for r in client.sandboxes.list() if r.session_id == s.id] == []  # the sandbox was recycled
        with pytest.raises(forkyard.ConflictError):
            s.step("noop")
        assert other.step("click", bid="submit").reward == 1.0  # the other episode is untouched


def test_fork_mid_task_into_three_branches(client, imported):
    with client.sessions.create(imported["shop"]) as source:
        source.step("click", bid="add-mug-blue")  # a cookie and a server-side cart row
        at_fork = source.step("click", bid="nav-cart")
        snap = source.snapshot()
        with client.snapshots.fork(snap.id, 3) as forks:
            first = [fork.step("noop") for fork in forks]
            for step in first:
                assert step.info["restore"]["matches"], step.info["restore"]
                assert step.observation == at_fork.observation
            # Each branch goes its own way from the same cart page.
            win = forks[0]
            for bid in ("nav-shop", "add-mug-blue", "add-tea-green", "nav-cart", "checkout"):
                win.step("click", bid=bid)
            forks[1].step("click", bid="checkout")  # one mug only
            outcomes = [win.submit().reward, forks[1].submit().reward, forks[2].submit().reward]
        assert outcomes == [1.0, 0.0, 0.0]
        assert "1 × Blue mug" in source.step("noop").observation  # the source's cart is its own
        assert source.submit().reward == 0.0


def test_a_fork_after_a_re_render_gives_the_same_ids(client, imported):
    """The table re-renders its rows on input: a branch must give the new rows the ids the source gave them."""
    with client.sessions.create(imported["sort-table"]) as source:
        at_fork = source.step("fill", bid="search", text="lamp")
        snap = source.snapshot()
        with client.snapshots.fork(snap.id, 1) as (fork,):
            first = fork.step("noop")
            assert first.info["restore"]["matches"], first.info["restore"]
            assert first.observation == at_fork.observation
            fork.step("click", bid="sort-price")
            assert fork.step("click", bid="select-p5").reward == 1.0
