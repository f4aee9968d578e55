"""Fixtures for gateway tests: a fake worker runtime, a fresh SQLite gateway per test, task builders.

The fake runtime stands in for ``workers.runtime.WorkerRuntime`` (same methods) so these
tests exercise the API logic; the real runtime and sandboxes are covered end to end in tests/e2e.
"""

from __future__ import annotations

import atexit
import collections
import io
import secrets
import shutil
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from gateway.app import create_app
from gateway.settings import Settings
from sandboxes.base import LABEL_NODE, LABEL_OWNER, SandboxInfo, SandboxState
from sandboxes.errors import SandboxNotFoundError
from sandboxes.snapshots import Snapshot, snapshot_metadata
from workers.envs.base import EnvSnapshot as SessionSnapshot
from workers.envs.base import StepResult
from workers.envs.terminal.task import TerminalTask
from workers.errors import (
    ActionError,
    ImageBuildError,
    SessionClosedError,
    SessionNotFoundError,
    TaskSetupError,
)
from workers.runtime import SessionOpened

NODE = "test-node"
API_KEY = "fy_" + "t" * 40

BASH_TOOL = {"type": "function", "function": {"name": "bash", "description": "Run a command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
SUBMIT_TOOL = {"type": "function", "function": {"name": "submit", "description": "Finish.", "parameters": {
    "type": "object", "properties": {}}}}


class FakeRuntime:
    """An in-memory WorkerRuntime: sandboxes are dicts; bash echoes; submit rewards 'solve' commands."""

    loads_tasks = False
    sole_gateway = True

    def __init__(self, node: str = NODE) -> None:
        self.node = node
        self.backend_name = "fake"
        self.sandboxes: dict[str, SandboxInfo] = {}
        self.sessions: dict[str, dict[str, Any]] = {}
        self.started = False
        self.closed = False
        self.reaped: list[str] = []
        self.snapshots: dict[str, dict[str, Any]] = {}
        """Backend snapshots: id -> the fake session state they captured."""
        self.deleted_snapshots: list[str] = []
        self.counters: collections.Counter[str] = collections.Counter()
        self.setup_cache = None
        self.made: list[SandboxInfo] = []
        """Every sandbox made, as made (the backends' ledger)."""

    async def start(self, *, progress: Callable[[str], None] | None = None) -> None:
        if progress:
            progress("fake base image ready")
        self.started = True

    def add_orphan(self, owner: str, sandbox_id: str | None = None, *, labels: Mapping[str, str] | None = None) -> str:
        """Create a sandbox no live session of this runtime owns (as a crashed process would leave)."""
        sandbox_id = sandbox_id or "sbx_" + secrets.token_hex(6)
        self.sandboxes[sandbox_id] = SandboxInfo(
            id=sandbox_id, backend="fake", node=self.node, state=SandboxState.READY, image="fake/base:1",
            created_at=time.time(), labels={LABEL_NODE: self.node, LABEL_OWNER: owner, **(labels or {})},
        )
        self.made.append(self.sandboxes[sandbox_id])
        return sandbox_id

    async def open_session(self, session_id: str, task: TerminalTask, *, labels: Mapping[str, str] | None = None,
                           env_version: str = "") -> SessionOpened:
        if task.metadata.get("fake_fail_build"):
            raise ImageBuildError("environment/Dockerfile line 2: unsupported instruction 'FROBNICATE'")
        if task.metadata.get("fake_fail_reset"):
            raise TaskSetupError(f"task {task.name!r}: forkyard/reset.sh failed with exit code 3: no such package")
        sandbox_id = "sbx_" + secrets.token_hex(6)
        info = SandboxInfo(
            id=sandbox_id, backend="fake", node=self.node, state=SandboxState.READY, image="fake/env:1",
            created_at=time.time(),
            labels={LABEL_NODE: self.node, LABEL_OWNER: session_id, "forkyard.task": task.name, **(labels or {})},
        )
        self.sandboxes[sandbox_id] = info
        self.made.append(info)
        self.sessions[session_id] = {"sandbox": sandbox_id, "task": task, "done": False, "solved": False,
                                     "env_version": env_version}
        self.counters["resets"] += 1
        return SessionOpened(session_id, info, task.instruction, [BASH_TOOL, SUBMIT_TOOL])

    def sandboxes_made_after(self, mark: int) -> tuple[list[SandboxInfo], int]:
        return self.made[mark:], len(self.made)

    def has_session(self, session_id: str) -> bool:
        return session_id in self.sessions

    def session_count(self) -> int:
        return len(self.sessions)

    def load_report(self) -> dict[str, Any]:
        return {"sessions": self.session_count()}

    async def run_command(self, kind: str, args: Mapping[str, Any]) -> str:
        """Kill a sandbox (as the real runtime does); other commands need a pool or a cache this runtime lacks."""
        if kind != "kill_sandbox" or args["sandbox_id"] not in self.sandboxes:
            raise ValueError(f"cannot {kind} here")
        del self.sandboxes[args["sandbox_id"]]
        return f"destroyed sandbox {args['sandbox_id']}"

    async def step(self, session_id: str, tool: str, arguments: dict[str, Any]) -> StepResult:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(f"no open session {session_id} on node {self.node}")
        if session["done"]:
            raise SessionClosedError(f"session {session_id} has ended")
        self.counters["env_steps"] += 1
        if tool == "bash":
            if set(arguments) - {"command", "timeout"} or not isinstance(arguments.get("command"), str):
                raise ActionError("bash takes {'command': string, 'timeout'?: number}")
            command = arguments["command"]
            if command.startswith("screenshot "):  # a step that made a file, as a web page's screenshot
                png = b"\x89PNG\r\n\x1a\n" + command[11:].encode()
                return StepResult("[exit code 0]", None, False, False, {"exit_code": 0}, artifacts={"shot.png": png})
            if command == "crash-the-runtime":
                raise RuntimeError("simulated bug in the runtime (api_key=fy_secretsecretsecret)")
            if "solve" in command:
                session["solved"] = True
            output = command[5:] if command.startswith("echo ") else ""
            return StepResult(f"{output}\n[exit code 0]", None, False, False, {"exit_code": 0})
        if tool == "submit":
            session["done"] = True
            reward = 1.0 if session["solved"] else 0.0
            return StepResult(f"reward: {reward}", reward, True, False, {"verifier": {"exit_code": 0}})
        raise ActionError(f"unknown tool {tool!r}; the tools are bash and submit")

    async def snapshot_session(self, session_id: str, *, metadata: Mapping[str, str] | None = None
                               ) -> SessionSnapshot:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(f"no open session {session_id} on node {self.node}")
        if session["done"]:
            raise SessionClosedError(f"session {session_id} has ended")
        snap_id = secrets.token_hex(16)
        self.snapshots[snap_id] = {"solved": session["solved"]}
        snap = Snapshot(id=snap_id, backend="fake", node=self.node, image="fake/env:1", ref=f"fake/snap:{snap_id}",
                        created_at=time.time(), metadata=snapshot_metadata(metadata))
        return SessionSnapshot(snap, {"steps": 0, "time_left_s": 60.0})

    def snapshot_from_json(self, data: Mapping[str, Any]) -> SessionSnapshot:
        return SessionSnapshot.from_json(data)

    async def fork_session(self, snapshot: SessionSnapshot, new_session_ids: list[str], task: TerminalTask, *,
                           labels: Mapping[str, str] | None = None,
                           launched: Callable[[], None] | None = None) -> list[SessionOpened]:
        if launched is not None:
            launched()
        state = self.snapshots.get(snapshot.id)
        if state is None:
            raise SandboxNotFoundError(f"no snapshot {snapshot.id!r} on node {self.node!r}")
        opened = []
        for session_id in new_session_ids:
            result = await self.open_session(session_id, task, labels=labels)
            self.sessions[session_id]["solved"] = state["solved"]
            opened.append(result)
        return opened

    async def delete_snapshot(self, snapshot_id: str, *, node: str | None = None) -> None:
        if self.snapshots.pop(snapshot_id, None) is not None:
            self.deleted_snapshots.append(snapshot_id)

    async def close_session(self, session_id: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is not None:
            self.sandboxes.pop(session["sandbox"], None)

    async def list_sandboxes(self) -> list[SandboxInfo]:
        return list(self.sandboxes.values())

    async def reap(self, keep_owner_ids: set[str] = frozenset()) -> list[str]:
        reaped = []
        for info in list(self.sandboxes.values()):
            owner = info.labels.get(LABEL_OWNER)
            if owner in self.sessions or owner in keep_owner_ids:
                continue
            del self.sandboxes[info.id]
            reaped.append(info.id)
        self.reaped.extend(reaped)
        return reaped

    async def sweep_transient_snapshots(self, keep_session_snapshots: set[str] | None = None) -> list[str]:
        return []  # the fake takes no tree or lazy-fork snapshots

    async def aclose(self) -> None:
        for session_id in list(self.sessions):
            await self.close_session(session_id)
        self.closed = True


# --------------------------------------------------------------------------- tasks


def task_files(name: str = "hello", *, instruction: str | None = None, metadata: str = "",
               timeout: str = "60") -> dict[str, str]:
    """Return the files of a small valid terminal task."""
    return {
        "instruction.md": instruction or f"Create /app/{name}.txt holding the word {name}.\n",
        "task.toml": f'version = "1.0"\n\n[metadata]\ndifficulty = "easy"\n{metadata}\n\n'
                     f"[agent]\ntimeout_sec = {timeout}\n\n[verifier]\ntimeout_sec = 30\n",
        "environment/Dockerfile": "FROM ubuntu:24.04\nWORKDIR /app\n",
        "tests/test.sh": f"#!/bin/bash\ntest -f /app/{name}.txt && echo 1 > /logs/verifier/reward.txt\n",
    }


def tar_of(tasks: Mapping[str, Mapping[str, str]], *, gz: bool = True) -> bytes:
    """Return a tar(.gz) holding each task as a top-level folder."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as archive:
        for name, files in tasks.items():
            for path, text in files.items():
                data = text.encode()
                info = tarfile.TarInfo(f"{name}/{path}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_task_dir(root: Path, name: str, files: Mapping[str, str] | None = None) -> Path:
    """Write a task directory under ``root`` and return it."""
    task_dir = root / name
    for path, text in (files or task_files(name)).items():
        (task_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (task_dir / path).write_text(text)
    return task_dir


# --------------------------------------------------------------------------- app


_MIGRATED: list[Path] = []
"""A SQLite database migrated to head once per test process, copied for each gateway."""


def _migrated_database() -> Path:
    if not _MIGRATED:
        from gateway.db import upgrade_database

        path = Path(tempfile.mkdtemp(prefix="forkyard-test-db-")) / "forkyard.db"
        upgrade_database(f"sqlite:///{path}")
        atexit.register(shutil.rmtree, path.parent, True)
        _MIGRATED.append(path)
    return _MIGRATED[0]


def make_settings(tmp_path: Path, **overrides: Any) -> Settings:
    """Return settings for a gateway on a fresh SQLite file in ``tmp_path``.

    The file starts as a copy of one migrated to head (the gateway's own migration then finds
    nothing to do): running the migrations for each of a few hundred tests cost about a minute.
    tests/gateway/test_migrations.py runs them from empty.
    """
    values: dict[str, Any] = {
        "data_dir": tmp_path / "data", "node": NODE, "bootstrap_api_key": API_KEY,
        "image_cache_dir": tmp_path / "images",
    }
    values.update(overrides)
    data_dir = Path(values["data_dir"])
    if values.get("database_url") is None and not (data_dir / "forkyard.db").exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_migrated_database(), data_dir / "forkyard.db")
    return Settings(**values)


class Gateway:
    """An app with its lifespan running, a fake runtime and an authenticated client."""

    def __init__(self, app: FastAPI, runtime: FakeRuntime, client: httpx.AsyncClient) -> None:
        self.app = app
        self.runtime = runtime
        self.client = client

    async def import_task(self, name: str = "hello", **kwargs: Any) -> dict[str, Any]:
        spec = {"name": name, "files": task_files(name, **kwargs)}
        response = await self.client.post("/v1/tasks", json={"tasks": [spec]})
        assert response.status_code == 201, response.text
        return response.json()["items"][0]

    async def open_session(self, task_id: str) -> dict[str, Any]:
        response = await self.client.post("/v1/sessions", json={"task_id": task_id})
        assert response.status_code == 201, response.text
        return response.json()


def asgi_client(app: FastAPI, *, api_key: str | None = API_KEY) -> httpx.AsyncClient:
    """Return a client that calls ``app`` in-process."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway.test",
                             headers=headers, timeout=30)


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    """A gateway on a fresh SQLite file with a fake runtime, lifespan started and stopped around the test."""
    runtime = FakeRuntime()
    app = create_app(make_settings(tmp_path), runtime=runtime)
    async with app.router.lifespan_context(app):
        async with asgi_client(app) as client:
            yield Gateway(app, runtime, client)


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """Assert ``response`` is the JSON error shape with this status and code; return the error object."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"code", "message", "request_id"}, error
    assert error["code"] == code, error
    assert error["message"] and error["message"].endswith("."), error
    assert "Traceback" not in error["message"]
    assert error["request_id"] == response.headers["x-request-id"]
    return error
