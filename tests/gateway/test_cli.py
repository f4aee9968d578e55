"""The ``forkyard`` CLI: ``keys create`` against a data dir, ``tasks import`` against a real uvicorn server."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from gateway.app import create_app
from gateway.auth import service
from gateway.cli import load_or_create_key_file, main
from gateway.db import create_engine, create_sessionmaker
from gateway.settings import Settings
from tests.gateway.conftest import API_KEY, FakeRuntime, make_settings, task_files, write_task_dir


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("FORKYARD_"):
            monkeypatch.delenv(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server_url(tmp_path) -> Iterator[str]:
    """A real uvicorn server on 127.0.0.1 (fake runtime) in a thread, stopped after the test."""
    app = create_app(make_settings(tmp_path), runtime=FakeRuntime())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive()


def authenticate(settings: Settings, key: str):
    async def check():
        engine = create_engine(settings.database_url)
        try:
            async with create_sessionmaker(engine)() as db:
                return await service.authenticate(db_session=db, key=key)
        finally:
            await engine.dispose()

    return asyncio.run(check())


def test_keys_create_prints_key_once_and_stores_its_hash(tmp_path, capsys):
    data_dir = tmp_path / "data"
    assert main(["keys", "create", "--name", "ci", "--data-dir", str(data_dir)]) == 0
    captured = capsys.readouterr()
    key = captured.out.strip()
    assert key.startswith("fy_") and "\n" not in key
    assert "shown only once" in captured.err and key not in captured.err
    row = authenticate(Settings(data_dir=data_dir), key)
    assert row is not None and row.name == "ci"
    for db_file in data_dir.glob("forkyard.db*"):  # the database and its WAL
        assert key.encode() not in db_file.read_bytes()

    assert main(["keys", "list", "--data-dir", str(data_dir)]) == 0
    listing = capsys.readouterr().out
    assert row.id in listing and key not in listing and "active" in listing
    assert main(["keys", "revoke", row.id, "--data-dir", str(data_dir)]) == 0
    assert authenticate(Settings(data_dir=data_dir), key) is None
    assert main(["keys", "revoke", "key_nope", "--data-dir", str(data_dir)]) == 2


def test_keys_create_uses_forkyard_database_url(tmp_path, capsys, monkeypatch):
    url = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    monkeypatch.setenv("FORKYARD_DATABASE_URL", url)
    assert main(["keys", "create"]) == 0
    key = capsys.readouterr().out.strip()
    assert authenticate(Settings(database_url=url), key) is not None


def test_api_key_file_is_private_and_reused(tmp_path):
    path = tmp_path / "d" / "api_key"
    key = load_or_create_key_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_key_file(path) == key


def test_tasks_import_single_and_collection_dirs(tmp_path, server_url, capsys, monkeypatch):
    monkeypatch.setenv("FORKYARD_URL", server_url)
    monkeypatch.setenv("FORKYARD_API_KEY", API_KEY)
    collection = tmp_path / "collection"
    for name in ("one", "two"):
        write_task_dir(collection, name)
    (collection / "not-a-task").mkdir()
    single = write_task_dir(tmp_path / "single", "solo")

    assert main(["tasks", "import", str(collection), str(single)]) == 0
    lines = capsys.readouterr().out.splitlines()
    pairs = [line.split() for line in lines]
    assert [name for _, name in pairs] == ["one", "two", "solo"]
    assert all(task_id.startswith("task_") for task_id, _ in pairs)
    listed = httpx.get(f"{server_url}/v1/tasks", headers={"Authorization": f"Bearer {API_KEY}"}).json()["items"]
    assert sorted((t["id"], t["name"]) for t in listed) == sorted(tuple(p) for p in pairs)

    # Re-importing gives the same ids.
    assert main(["tasks", "import", str(single)]) == 0
    assert capsys.readouterr().out.split() == pairs[2]


def test_tasks_import_bad_input_exits_2(tmp_path, server_url, capsys, monkeypatch):
    monkeypatch.setenv("FORKYARD_URL", server_url)
    monkeypatch.setenv("FORKYARD_API_KEY", API_KEY)
    assert main(["tasks", "import", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["tasks", "import", str(tmp_path / "empty")]) == 2
    assert "holds no task" in capsys.readouterr().err
    files = task_files("broken")
    files["task.toml"] = "[agent]\ntimeout_sec = 'abc'\n"
    broken = write_task_dir(tmp_path / "b", "broken", files)
    assert main(["tasks", "import", str(broken)]) == 2
    err = capsys.readouterr().err
    assert "task.toml" in err and "timeout_sec" in err and err.startswith("forkyard: error:")
    # Bad key: the gateway's 401 message is shown.
    good = write_task_dir(tmp_path / "g", "good")
    assert main(["tasks", "import", str(good), "--api-key", "fy_wrong"]) == 1
    assert "API key" in capsys.readouterr().err
    monkeypatch.delenv("FORKYARD_URL")
    assert main(["tasks", "import", str(good)]) == 2
    assert "FORKYARD_URL" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["tasks", "import"])
    assert exit_info.value.code == 2


def test_tasks_import_unreachable_gateway_exits_1(tmp_path, capsys):
    good = write_task_dir(tmp_path, "good")
    port = free_port()
    assert main(["tasks", "import", str(good), "--url", f"http://127.0.0.1:{port}", "--api-key", API_KEY]) == 1
    assert "cannot reach the gateway" in capsys.readouterr().err


def test_unknown_image_name_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["images", "build", "ubuntu"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


# Read before the autouse fixture clears FORKYARD_* (CI may point the image cache elsewhere).
IMAGE_CACHE = os.environ.get("FORKYARD_IMAGE_CACHE_DIR") or os.environ.get("FORKYARD_IMAGE_CACHE")
FORKYARD = Path(sys.executable).parent / "forkyard"


@pytest.mark.local
def test_images_build_base_for_the_local_backend(tmp_path, capsys):
    from sandboxes.images import base_image_ref

    argv = ["images", "build", "base", "--backend", "local", "--data-dir", str(tmp_path / "data")]
    if IMAGE_CACHE:
        argv += ["--cache-dir", IMAGE_CACHE]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.split() == ["local", base_image_ref()]
    assert "ensuring the base image for the local backend" in captured.err
    # A second build finds the image and does nothing more.
    assert main(argv) == 0
    assert capsys.readouterr().out.split() == ["local", base_image_ref()]


def test_up_exits_1_with_a_clear_message_when_the_backend_is_unusable(tmp_path):
    data_dir = tmp_path / "data"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "FORKYARD_DOCKER_URL": f"unix://{tmp_path}/no.sock",
           "FORKYARD_NODE": "cli-test"}
    out = subprocess.run([str(FORKYARD), "up", "--port", "0", "--backend", "docker", "--data-dir", str(data_dir)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "FORKYARD_URL" not in out.stdout
    (reason,) = [line for line in out.stderr.splitlines() if line.startswith("forkyard: error:")]
    assert reason.startswith("forkyard: error: the gateway did not start: ") and "docker" in reason.lower()
    key = (data_dir / "api_key").read_text().strip()
    assert key.startswith("fy_") and key not in out.stderr


def test_repos_add_then_tasks_import_of_swe_instances(tmp_path, server_url, capsys, monkeypatch):
    """The README's SWE path: `forkyard repos add` into the gateway's store, then `forkyard tasks import x.jsonl`."""
    examples = Path(__file__).resolve().parents[2] / "examples" / "swe"
    data_dir = tmp_path / "data"  # the server_url gateway's (make_settings), whose store is data_dir/repos
    assert main(["repos", "add", str(examples / "repos" / "calc"), "--name", "forkyard/calc",
                 "--data-dir", str(data_dir)]) == 0
    name, commit, where = capsys.readouterr().out.split()
    assert name == "forkyard/calc" and where == str(data_dir / "repos" / "forkyard__calc.git")
    assert main(["repos", "list", "--data-dir", str(data_dir)]) == 0
    assert capsys.readouterr().out.split() == ["forkyard__calc.git", commit]
    assert main(["repos", "add", str(tmp_path / "nowhere"), "--name", "x/y", "--data-dir", str(data_dir)]) == 2
    assert "does not exist" in capsys.readouterr().err

    monkeypatch.setenv("FORKYARD_URL", server_url)
    monkeypatch.setenv("FORKYARD_API_KEY", API_KEY)
    lines = [line for line in (examples / "instances.jsonl").read_text().splitlines() if commit in line]
    instances = tmp_path / "calc.jsonl"
    instances.write_text("\n".join(lines) + "\n")
    assert main(["tasks", "import", str(instances)]) == 0
    imported = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert len(imported) == len(lines) and all(n.startswith("forkyard__calc-") for _, n in imported)

    broken = tmp_path / "broken.jsonl"
    broken.write_text(lines[0] + "\n{\"instance_id\": 3}\n")
    assert main(["tasks", "import", str(broken)]) == 2  # refused before anything is sent
    assert "line 2" in capsys.readouterr().err
    textkit = tmp_path / "textkit.jsonl"
    textkit.write_text(next(line for line in (examples / "instances.jsonl").read_text().splitlines()
                            if "forkyard/textkit" in line) + "\n")
    assert main(["tasks", "import", str(textkit)]) == 2  # the gateway's store lacks the repository
    assert "forkyard/textkit" in capsys.readouterr().err
