"""Resource namespaces: environments, tasks (import, paging), sandboxes, and the models they return."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from datetime import datetime

import httpx
import pytest

import forkyard


def task_json(i: int, **extra) -> dict:
    return {
        "id": f"t{i}",
        "name": f"task-{i}",
        "environment": "terminal",
        "content_hash": f"{i:064x}",
        "instruction": f"Do thing {i}.",
        "metadata": {"difficulty": "easy"},
        "created_at": "2025-01-02T03:04:05Z",
        **extra,
    }


def paged_tasks(total: int, page_size: int):
    """A fake GET /v1/tasks that pages `total` tasks with opaque cursors."""

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.method == "GET" and request.url.path == "/v1/tasks"
        start = int(request.url.params.get("cursor", "c0")[1:])
        limit = int(request.url.params["limit"])
        assert limit == page_size
        end = min(start + limit, total)
        nxt = f"c{end}" if end < total else None
        return httpx.Response(200, json={"items": [task_json(i) for i in range(start, end)], "next": nxt})

    return handler


async def test_task_list_pages_through_every_item(twin):
    twin.handle(paged_tasks(total=7, page_size=3))
    tasks = await twin.collect(twin.client.tasks.list(environment="terminal", limit=3))
    assert [t.id for t in tasks] == [f"t{i}" for i in range(7)]
    assert all(isinstance(t, forkyard.Task) for t in tasks)
    assert [r.url.params.get("cursor") for r in twin.requests] == [None, "c3", "c6"]
    assert all(r.url.params["environment"] == "terminal" for r in twin.requests)
    assert all("name" not in r.url.params for r in twin.requests), "unset filters are not sent"


async def test_task_list_fetches_lazily(twin):
    twin.handle(paged_tasks(total=100, page_size=10))
    pager = twin.client.tasks.list(limit=10)
    assert twin.requests == [], "nothing is fetched before iteration"
    if twin.kind == "sync":
        iterator = iter(pager)
        first = [next(iterator) for _ in range(12)]
    else:
        iterator = pager.__aiter__()
        first = [await iterator.__anext__() for _ in range(12)]
    assert [t.id for t in first] == [f"t{i}" for i in range(12)]
    assert len(twin.requests) == 2


async def test_pages_and_first_page(twin):
    twin.handle(paged_tasks(total=5, page_size=2))
    pages = await twin.collect(twin.client.tasks.list(limit=2).pages())
    assert [[t.id for t in p.items] for p in pages] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert [p.next for p in pages] == ["c2", "c4", None]
    first = await twin.call(twin.client.tasks.list(limit=2, cursor="c2").first_page)
    assert isinstance(first, forkyard.Page)
    assert [t.id for t in first.items] == ["t2", "t3"] and first.next == "c4"


async def test_task_list_filters_by_name(twin):
    twin.handle(lambda r: httpx.Response(200, json={"items": [task_json(3)], "next": None}))
    assert [t.id for t in await twin.collect(twin.client.tasks.list(name="task-3"))] == ["t3"]
    assert dict(twin.requests[0].url.params) == {"name": "task-3", "limit": "50"}


async def test_repeated_cursor_stops_iteration(twin):
    twin.handle(lambda r: httpx.Response(200, json={"items": [task_json(0)], "next": "same"}))
    assert len(await twin.collect(twin.client.tasks.list(cursor="same"))) == 1
    assert len(twin.requests) == 1


@pytest.mark.parametrize("limit", [0, -5])
async def test_bad_page_size_is_refused(twin, limit):
    with pytest.raises(ValueError, match="limit must be at least 1"):
        twin.client.tasks.list(limit=limit)
    assert twin.requests == []


async def test_task_get_quotes_the_id(twin):
    twin.respond(httpx.Response(200, json=task_json(1)))
    task = await twin.call(twin.client.tasks.get, "weird/../id")
    assert twin.requests[0].url.raw_path == b"/v1/tasks/weird%2F..%2Fid"
    assert task.created_at == datetime.fromisoformat("2025-01-02T03:04:05+00:00")
    assert task.metadata == {"difficulty": "easy"}
    with pytest.raises(ValueError, match="task_id"):
        await twin.call(twin.client.tasks.get, "")


# -- task import ---------------------------------------------------------------


def write_task(root, name: str, *, extra: dict[str, str] | None = None):
    task = root / name
    (task / "tests").mkdir(parents=True)
    (task / "environment").mkdir()
    (task / "instruction.md").write_text(f"Solve {name}.\n")
    (task / "task.toml").write_text('[metadata]\ndifficulty = "easy"\n')
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm\n")
    test_sh = task / "tests" / "test.sh"
    test_sh.write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    test_sh.chmod(0o755)
    for rel, text in (extra or {}).items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(text)
    return task


def read_archive(data: bytes) -> dict[str, tuple[bytes, int]]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {m.name: (tar.extractfile(m).read(), m.mode) for m in tar.getmembers() if m.isfile()}


def import_answer(request: httpx.Request) -> httpx.Response:
    names = sorted({name.split("/")[0] for name in read_archive(request.content)})
    return httpx.Response(201, json={"items": [task_json(i, name=n) for i, n in enumerate(names)]})


async def test_import_dir_uploads_one_task_dir(twin, tmp_path):
    task_dir = write_task(tmp_path, "hello", extra={".git/HEAD": "ref", "__pycache__/x.pyc": "junk"})
    twin.handle(import_answer)
    tasks = await twin.call(twin.client.tasks.import_dir, task_dir)
    assert [t.name for t in tasks] == ["hello"]
    request = twin.requests[0]
    assert request.method == "POST" and request.url.path == "/v1/tasks"
    assert request.url.params["environment"] == "terminal"
    assert request.headers["content-type"] == "application/gzip"
    files = read_archive(request.content)
    assert sorted(files) == [
        "hello/environment/Dockerfile", "hello/instruction.md", "hello/task.toml", "hello/tests/test.sh",
    ]
    assert files["hello/instruction.md"] == (b"Solve hello.\n", 0o644)
    assert files["hello/tests/test.sh"][1] == 0o755


async def test_import_dir_uploads_a_dir_of_task_dirs(twin, tmp_path):
    for name in ("beta", "alpha"):
        write_task(tmp_path, name)
    (tmp_path / "notes").mkdir()  # not a task: no task.toml / instruction.md
    (tmp_path / "README.md").write_text("a suite")
    twin.handle(import_answer)
    tasks = await twin.call(twin.client.tasks.import_dir, str(tmp_path), environment="terminal-v2")
    assert [t.name for t in tasks] == ["alpha", "beta"]
    assert twin.requests[0].url.params["environment"] == "terminal-v2"
    assert {name.split("/")[0] for name in read_archive(twin.requests[0].content)} == {"alpha", "beta"}


async def test_import_dir_archive_is_deterministic(twin, tmp_path):
    task_dir = write_task(tmp_path, "hello")
    twin.handle(import_answer)
    await twin.call(twin.client.tasks.import_dir, task_dir)
    os.utime(task_dir / "instruction.md", (1, 1))
    await twin.call(twin.client.tasks.import_dir, task_dir)
    first, second = (r.content for r in twin.requests)
    assert first == second
    assert gzip.decompress(first)  # a real gzip stream


async def test_import_dir_refuses_what_is_not_a_task(twin, tmp_path):
    with pytest.raises(ValueError, match="neither a task directory"):
        await twin.call(twin.client.tasks.import_dir, tmp_path)
    with pytest.raises(FileNotFoundError):
        await twin.call(twin.client.tasks.import_dir, tmp_path / "missing")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(NotADirectoryError):
        await twin.call(twin.client.tasks.import_dir, tmp_path / "file.txt")
    assert twin.requests == []


async def test_import_dir_surfaces_task_format_errors(twin, tmp_path):
    task_dir = write_task(tmp_path, "broken")
    message = "task.toml: [agent] timeout_sec must be a positive number, got 'abc'"
    twin.respond(twin.error(422, "task_format_error", message))
    with pytest.raises(forkyard.UnprocessableEntityError) as info:
        await twin.call(twin.client.tasks.import_dir, task_dir)
    assert info.value.code == "task_format_error" and info.value.message == message


async def test_import_specs_sends_json(twin):
    twin.respond(httpx.Response(201, json={"items": [task_json(1, name="a"), task_json(2, name="b")]}))
    specs = [
        {"name": "a", "files": {"instruction.md": "A", "tests/test.sh": b"exit 0\n"}},
        {"name": "b", "environment": "other", "files": {"instruction.md": "B"}},
    ]
    tasks = await twin.call(twin.client.tasks.import_specs, specs)
    assert [t.name for t in tasks] == ["a", "b"]
    assert twin.requests[0].headers["content-type"] == "application/json"
    assert twin.body() == {
        "tasks": [
            {"name": "a", "environment": "terminal", "files": {"instruction.md": "A", "tests/test.sh": "exit 0\n"}},
            {"name": "b", "environment": "other", "files": {"instruction.md": "B"}},
        ]
    }


@pytest.mark.parametrize(
    ("specs", "error", "match"),
    [
        ([], ValueError, "at least one"),
        ([{"files": {"a": "b"}}], ValueError, "name"),
        ([{"name": "x", "files": {}}], ValueError, "files"),
        ([{"name": "x", "files": {"blob.bin": b"\xff\xfe"}}], ValueError, "not UTF-8"),
        ([{"name": "x", "files": {"n.txt": 3}}], TypeError, "str or bytes"),
    ],
)
async def test_import_specs_refuses_bad_specs(twin, specs, error, match):
    with pytest.raises(error, match=match):
        await twin.call(twin.client.tasks.import_specs, specs)
    assert twin.requests == []


# -- environments and sandboxes ------------------------------------------------------


async def test_environments_create_and_list(twin):
    env = {"id": "e1", "name": "shell", "family": "terminal", "version": "1", "description": None,
           "created_at": "2025-01-01T00:00:00Z"}
    twin.respond(httpx.Response(201, json=env), httpx.Response(200, json={"items": [env], "next": None}))
    created = await twin.call(twin.client.environments.create, "shell")
    assert isinstance(created, forkyard.Environment) and created.id == "e1"
    assert twin.body(0) == {"name": "shell", "family": "terminal", "version": "1"}
    assert [e.name for e in await twin.collect(twin.client.environments.list())] == ["shell"]


async def test_environment_create_sends_description(twin):
    env = {"id": "e2", "name": "web", "family": "web", "version": "2", "description": "Browser tasks."}
    twin.respond(httpx.Response(201, json=env))
    await twin.call(twin.client.environments.create, "web", family="web", version="2", description="Browser tasks.")
    assert twin.body() == {"name": "web", "family": "web", "version": "2", "description": "Browser tasks."}


async def test_sandboxes_list(twin):
    box = {"id": "sb1", "node": "n1", "backend": "local", "state": "busy", "task_id": "t1", "task_name": "hello",
           "session_id": "s1", "age_s": 12.5, "created_at": "2025-01-01T00:00:00Z"}
    twin.respond(httpx.Response(200, json={"items": [box, {**box, "id": "sb2", "state": "hibernating"}], "next": None}))
    boxes = await twin.collect(twin.client.sandboxes.list())
    assert [b.id for b in boxes] == ["sb1", "sb2"]
    assert boxes[0].state is forkyard.SandboxState.BUSY
    assert boxes[1].state == "hibernating", "a state this SDK does not know must not break parsing"
    assert twin.requests[0].url.path == "/v1/sandboxes"


def test_models_keep_unknown_fields():
    task = forkyard.Task.model_validate({**task_json(1), "difficulty_score": 0.7})
    assert task.model_extra == {"difficulty_score": 0.7}
    assert task.model_dump()["difficulty_score"] == 0.7
    info = forkyard.SessionInfo.model_validate({"id": "s", "task_id": "t", "state": "closed", "gpu": "none"})
    assert info.state is forkyard.SessionState.CLOSED and info.gpu == "none"
    step = forkyard.StepResult.model_validate({"observation": "", "reward": 1, "terminated": True, "truncated": False})
    assert step.reward == 1.0 and step.done and step.info == {}
