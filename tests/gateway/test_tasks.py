"""Task import (tar.gz, tar, multipart, JSON), dedupe, format errors, listing with cursors; environments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import select

from gateway.errors import NotFoundError
from gateway.tasks.models import Task
from tests.gateway.conftest import assert_error, tar_of, task_files
from workers.envs.terminal.task import tasks_from_tar


async def test_import_tar_gz_of_several_tasks(gateway):
    body = tar_of({"alpha": task_files("alpha"), "beta": task_files("beta")})
    response = await gateway.client.post("/v1/tasks", content=body, headers={"Content-Type": "application/gzip"})
    assert response.status_code == 201, response.text
    items = response.json()["items"]
    assert [t["name"] for t in items] == ["alpha", "beta"]
    for item in items:
        assert item["id"].startswith("task_") and item["environment"] == "terminal"
        assert len(item["content_hash"]) == 64 and item["metadata"] == {"difficulty": "easy"}
        assert item["instruction"] == task_files(item["name"])["instruction.md"]
    # The stored archive decodes back to the same task.
    async with gateway.app.state.sessionmaker() as db:
        archive = await db.scalar(select(Task.archive).where(Task.id == items[0]["id"]))
        (decoded,) = tasks_from_tar(archive)
        assert decoded.name == "alpha" and decoded.content_hash == items[0]["content_hash"]


async def test_import_plain_tar_and_multipart(gateway):
    plain = await gateway.client.post("/v1/tasks", content=tar_of({"plain": task_files("plain")}, gz=False),
                                      headers={"Content-Type": "application/x-tar"})
    assert plain.status_code == 201, plain.text
    multi = await gateway.client.post(
        "/v1/tasks", files={"file": ("tasks.tar.gz", tar_of({"multi": task_files("multi")}), "application/gzip")}
    )
    assert multi.status_code == 201, multi.text
    assert [t["name"] for t in plain.json()["items"] + multi.json()["items"]] == ["plain", "multi"]
    no_file = await gateway.client.post("/v1/tasks", files={"note": (None, "a field, not a file")})
    assert "multipart/form-data" in no_file.request.headers["content-type"]
    assert "no file" in assert_error(no_file, 400, "bad_request")["message"]
    urlencoded = await gateway.client.post("/v1/tasks", data={"note": "x"})
    assert_error(urlencoded, 415, "unsupported_media_type")


async def test_reimport_returns_existing_task_and_changed_content_is_new(gateway):
    first = await gateway.import_task("same")
    again = await gateway.client.post("/v1/tasks", content=tar_of({"same": task_files("same")}),
                                      headers={"Content-Type": "application/gzip"})
    assert again.json()["items"][0]["id"] == first["id"]
    changed = await gateway.import_task("same", instruction="Something else entirely.\n")
    assert changed["id"] != first["id"] and changed["content_hash"] != first["content_hash"]
    async with gateway.app.state.sessionmaker() as db:
        assert len((await db.scalars(select(Task).where(Task.name == "same"))).all()) == 2
    by_name = (await gateway.client.get("/v1/tasks", params={"name": "same"})).json()["items"]
    assert [t["id"] for t in by_name] == [first["id"], changed["id"]]


async def test_task_format_errors_name_file_and_field(gateway):
    error = assert_error(await gateway.client.post(
        "/v1/tasks", json={"tasks": [{"name": "bad", "files": task_files("bad", timeout='"abc"')}]}),
        422, "task_format_error")
    assert "task.toml" in error["message"] and "timeout_sec" in error["message"]
    files = task_files("nover")
    del files["tests/test.sh"]
    error = assert_error(await gateway.client.post("/v1/tasks", content=tar_of({"nover": files}),
                                                   headers={"Content-Type": "application/gzip"}),
                         422, "task_format_error")
    assert "tests/test.sh" in error["message"]
    error = assert_error(await gateway.client.post("/v1/tasks", content=b"not a tar at all",
                                                   headers={"Content-Type": "application/gzip"}),
                         422, "task_format_error")
    assert "tar" in error["message"]
    assert_error(await gateway.client.post("/v1/tasks", json={"tasks": []}), 422, "validation_error")
    assert_error(await gateway.client.post("/v1/tasks", content=b"", headers={"Content-Type": "application/gzip"}),
                 400, "bad_request")
    error = assert_error(await gateway.client.post("/v1/tasks", content=b"x", headers={"Content-Type": "text/plain"}),
                         415, "unsupported_media_type")
    assert "text/plain" in error["message"]
    # Nothing half-imported, and a good import still works.
    assert (await gateway.client.get("/v1/tasks")).json()["items"] == []
    assert (await gateway.import_task("fine"))["name"] == "fine"


async def test_unknown_environment_is_refused(gateway):
    error = assert_error(await gateway.client.post(
        "/v1/tasks", json={"tasks": [{"name": "x", "environment": "nope", "files": task_files("x")}]}),
        422, "validation_error")
    assert "nope" in error["message"]
    assert_error(await gateway.client.post("/v1/tasks", params={"environment": "nope"},
                                           content=tar_of({"x": task_files("x")}),
                                           headers={"Content-Type": "application/gzip"}), 422, "validation_error")


async def test_list_tasks_pages_with_opaque_cursors(gateway):
    names = [f"t{i}" for i in range(5)]
    response = await gateway.client.post("/v1/tasks", json={"tasks": [{"name": n, "files": task_files(n)}
                                                                       for n in names]})
    ids = [t["id"] for t in response.json()["items"]]
    seen, cursor, pages = [], None, 0
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = (await gateway.client.get("/v1/tasks", params=params)).json()
        pages += 1
        seen += [t["id"] for t in page["items"]]
        cursor = page["next"]
        if cursor is None:
            break
        assert not cursor.startswith("task_")  # opaque, not a raw id
    assert sorted(seen) == sorted(ids) and len(seen) == 5 and pages == 3
    assert (await gateway.client.get("/v1/tasks", params={"environment": "terminal", "limit": 50})
            ).json()["next"] is None
    assert (await gateway.client.get("/v1/tasks", params={"environment": "other"})).json()["items"] == []
    one = await gateway.client.get(f"/v1/tasks/{ids[3]}")
    assert one.status_code == 200 and one.json()["name"] == "t3"
    assert_error(await gateway.client.get("/v1/tasks", params={"cursor": "!!garbage!!"}), 400, "bad_request")
    error = assert_error(await gateway.client.get("/v1/tasks", params={"limit": 0}), 422, "validation_error")
    assert "limit" in error["message"]


async def test_environments_default_create_conflict_list(gateway):
    page = (await gateway.client.get("/v1/environments")).json()
    assert [e["name"] for e in page["items"]] == ["terminal", "swe", "web"] and page["next"] is None
    assert page["items"][0]["family"] == "terminal"
    created = await gateway.client.post("/v1/environments", json={"name": "terminal-hard", "family": "terminal",
                                                                   "version": "2", "description": "harder"})
    assert created.status_code == 201, created.text
    env = created.json()
    assert env["id"].startswith("env_") and env["version"] == "2" and env["description"] == "harder"
    assert (await gateway.client.get(f"/v1/environments/{env['id']}")).json() == env
    assert [t["function"]["name"] for t in env["tools"]] == ["bash", "submit"]  # the family's tools
    assert env["tools"][0]["function"]["parameters"]["required"] == ["command"]
    assert_error(await gateway.client.post("/v1/environments", json={"name": "terminal-hard"}), 409, "conflict")
    error = assert_error(await gateway.client.post("/v1/environments", json={"name": "x", "family": "chess"}),
                         422, "unknown_family")
    assert "'chess'" in error["message"] and "terminal" in error["message"]
    task = await gateway.client.post("/v1/tasks", json={"tasks": [{"name": "h", "environment": "terminal-hard",
                                                                   "files": task_files("h")}]})
    assert task.json()["items"][0]["environment"] == "terminal-hard"
    listed = (await gateway.client.get("/v1/tasks", params={"environment": "terminal-hard"})).json()["items"]
    assert [t["name"] for t in listed] == ["h"]


async def test_task_asking_for_more_than_a_sandbox_may_have_is_refused_at_import(gateway):
    for extra, field in (
        ("cpus = 64", "environment.cpus"),
        ("memory_mb = 204800", "environment.memory_mb"),
        ('storage = "200T"', "environment.storage_mb"),
    ):
        files = task_files("greedy")
        files["task.toml"] += f"\n[environment]\n{extra}\n"
        error = assert_error(await gateway.client.post("/v1/tasks", json={"tasks": [{"name": "greedy", "files": files}]}),
                             422, "resources_exceeded")
        assert field in error["message"] and "greedy" in error["message"]
        error = assert_error(await gateway.client.post("/v1/tasks", content=tar_of({"greedy": files}),
                                                       headers={"Content-Type": "application/gzip"}),
                             422, "resources_exceeded")
        assert field in error["message"]
    assert (await gateway.client.get("/v1/tasks")).json()["items"] == []
    files = task_files("modest")
    files["task.toml"] += "\n[environment]\ncpus = 1\nmemory_mb = 512\n"
    assert (await gateway.client.post("/v1/tasks", json={"tasks": [{"name": "modest", "files": files}]})).status_code == 201


async def test_import_reports_the_task_toml_keys_forkyard_does_not_use(gateway):
    files = task_files("harborish")
    files["task.toml"] = files["task.toml"].replace("[verifier]\n", "[verifier]\nuser = \"root\"\n")
    files["task.toml"] += "\n[environment]\ngpus = 0\nallow_internet = false\n"
    response = await gateway.client.post("/v1/tasks", json={"tasks": [{"name": "harborish", "files": files}]})
    assert response.status_code == 201, response.text
    (item,) = response.json()["items"]
    assert item["warnings"] == ["task.toml: [verifier] user is not used by Forkyard",
                                "task.toml: [environment] gpus is not used by Forkyard"]
    listed = (await gateway.client.get(f"/v1/tasks/{item['id']}")).json()
    assert listed["warnings"] == []  # only the import answer carries them


def test_decoded_tasks_drop_the_least_recently_used_past_their_byte_budget():
    from gateway.tasks.service import DecodedTasks

    (task,) = tasks_from_tar(_plain_tar("kept"))
    cache = DecodedTasks(max_bytes=100)
    cache.put("a", task, 40)
    cache.put("b", task, 40)
    assert cache.get("a") is task  # a is now the most recently used
    cache.put("c", task, 40)  # over budget: b goes
    assert cache.get("b") is None and cache.get("a") is task and cache.get("c") is task
    cache.put("huge", task, 101)  # larger than the whole budget: never kept
    assert cache.get("huge") is None and cache.get("a") is task


async def test_a_stored_task_is_decoded_once_per_process(gateway, monkeypatch):
    from gateway.tasks import service as tasks_service

    response = await gateway.client.post("/v1/tasks", content=_plain_tar("decoded-once"),
                                         headers={"Content-Type": "application/x-tar"})
    assert response.status_code == 201, response.text
    task_id = response.json()["items"][0]["id"]
    decodes = []
    from workers.envs.terminal import FAMILY

    real = FAMILY.decode_task
    monkeypatch.setattr(FAMILY, "decode_task", lambda data: decodes.append(len(data)) or real(data))
    monkeypatch.setattr(tasks_service, "decoded_tasks", tasks_service.DecodedTasks())
    async with gateway.app.state.sessionmaker() as db:
        first = await tasks_service.load_task(db_session=db, task_id=task_id)
        second = await tasks_service.load_task(db_session=db, task_id=task_id)
        with pytest.raises(NotFoundError):
            await tasks_service.load_task(db_session=db, task_id="task_missing")
    assert first is second and first.name == "decoded-once" and len(decodes) == 1


def _plain_tar(name: str) -> bytes:
    return tar_of({name: task_files(name)}, gz=False)


# ------------------------------------------------------------------ SWE instances (JSONL)


SWE_EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "swe"


async def test_swe_instances_import_as_jsonl_all_or_nothing(tmp_path):
    from gateway.app import create_app
    from tests.gateway.conftest import FakeRuntime, asgi_client, make_settings
    from workers.envs.swe.repos import RepoStore

    settings = make_settings(tmp_path)
    store = RepoStore(settings.swe.repo_store)  # data_dir/repos, the default
    store.add(SWE_EXAMPLES / "repos" / "calc", name="forkyard/calc")
    app = create_app(settings, runtime=FakeRuntime())
    lines = [line for line in (SWE_EXAMPLES / "instances.jsonl").read_text().splitlines() if "forkyard/calc" in line]
    jsonl = {"Content-Type": "application/x-ndjson"}
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        env = [e for e in (await client.get("/v1/environments")).json()["items"] if e["name"] == "swe"]
        assert env and env[0]["family"] == "swe"
        assert [t["function"]["name"] for t in env[0]["tools"]] == ["bash", "str_replace_editor", "submit"]

        # A bad line, a repository the store lacks, a commit it lacks: each named, nothing imported.
        bad = "\n".join([lines[0], '{"instance_id": "x"}', lines[1].replace("forkyard/calc", "forkyard/textkit"),
                         lines[2].replace(json.loads(lines[2])["base_commit"], "abcdef0")])
        error = assert_error(await client.post("/v1/tasks", params={"environment": "swe"}, content=bad.encode(),
                                               headers=jsonl), 422, "task_format_error")
        assert "line 2: repo: is required" in error["message"]
        assert (await client.get("/v1/tasks", params={"environment": "swe"})).json()["items"] == []
        bad = "\n".join([lines[0], lines[1].replace("forkyard/calc", "forkyard/textkit")])
        error = assert_error(await client.post("/v1/tasks", params={"environment": "swe"}, content=bad.encode(),
                                               headers=jsonl), 422, "task_format_error")
        assert "'forkyard/textkit' is not in the repository store" in error["message"]
        assert (await client.get("/v1/tasks", params={"environment": "swe"})).json()["items"] == []

        created = await client.post("/v1/tasks", params={"environment": "swe"}, content="\n".join(lines).encode(),
                                    headers=jsonl)
        assert created.status_code == 201, created.text
        items = created.json()["items"]
        assert len(items) == len(lines) >= 8 and {i["family"] for i in items} == {"swe"}
        assert items[0]["metadata"]["repo"] == "forkyard/calc" and items[0]["metadata"]["FAIL_TO_PASS"]
        again = await client.post("/v1/tasks", params={"environment": "swe"}, content="\n".join(lines).encode(),
                                  headers=jsonl)
        assert [i["id"] for i in again.json()["items"]] == [i["id"] for i in items]  # identical: the same rows
        # A terminal task cannot land in the swe environment, nor an instance in terminal.
        assert_error(await client.post("/v1/tasks", json={"tasks": [{"name": "h", "environment": "swe",
                                                                      "files": task_files("h")}]}),
                     422, "task_format_error")
        assert_error(await client.post("/v1/tasks", params={"environment": "terminal"},
                                       content=lines[0].encode(), headers=jsonl), 422, "task_format_error")
