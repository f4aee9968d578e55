"""Sessions: the resource calls and the Session / AsyncSession helpers."""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager

import httpx
import pytest

import forkyard

BASH_TOOL = {"type": "function", "function": {"name": "bash", "description": "Run a command.", "parameters": {}}}
SUBMIT_TOOL = {"type": "function", "function": {"name": "submit", "description": "Finish.", "parameters": {}}}


class FakeSessions:
    """A tiny stateful stand-in for the gateway's session endpoints."""

    def __init__(self, *, close_status: int = 204) -> None:
        self.close_status = close_status
        self.state: dict[str, str] = {}
        self.actions: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST" and path == "/v1/sessions":
            sid = f"s{len(self.state) + 1}"
            self.state[sid] = "open"
            task_id = json.loads(request.content)["task_id"]
            return httpx.Response(201, json={
                "id": sid, "task_id": task_id, "state": "open", "observation": "Print hello.",
                "tools": [BASH_TOOL, SUBMIT_TOOL], "sandbox_id": f"sb-{sid}", "created_at": "2025-01-01T00:00:00Z",
            })
        sid = path.split("/")[3]
        if request.method == "POST" and path.endswith("/step"):
            action = json.loads(request.content)["action"]
            self.actions.append(action)
            if self.state[sid] != "open":
                return _error(409, "session_closed", f"Session {sid} is {self.state[sid]}.")
            if action["tool"] == "submit":
                self.state[sid] = "terminated"
                return httpx.Response(200, json={"observation": "Verifier passed.", "reward": 1.0,
                                                 "terminated": True, "truncated": False,
                                                 "info": {"reward_details": {"reward": 1.0}}})
            observation = f"$ {action['arguments'].get('command')}\nhello\n[exit 0]"
            return httpx.Response(200, json={"observation": observation, "reward": None,
                                             "terminated": False, "truncated": False, "info": {}})
        if request.method == "GET":
            return httpx.Response(200, json={
                "id": sid, "task_id": "t1", "state": self.state[sid], "sandbox_id": f"sb-{sid}",
                "steps": len(self.actions), "reward": None, "created_at": "2025-01-01T00:00:00Z", "closed_at": None,
            })
        if request.method == "DELETE":
            if self.close_status != 204:
                return _error(self.close_status, "x", "Close failed.")
            self.state[sid] = "closed"
            return httpx.Response(204)
        raise AssertionError(f"unexpected {request.method} {path}")


def _error(status: int, code: str, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message, "request_id": "req-s"}})


@asynccontextmanager
async def open_session(twin, task_id: str = "t1"):
    """Enter the session helper the way a user of each twin would."""
    if twin.kind == "sync":
        with twin.client.sessions.create(task_id) as session:
            yield session
    else:
        async with twin.client.sessions.create(task_id) as session:
            yield session


async def test_session_helper_runs_an_episode_and_closes(twin):
    fake = FakeSessions()
    twin.handle(fake)
    async with open_session(twin) as s:
        assert isinstance(s, forkyard.Session if twin.kind == "sync" else forkyard.AsyncSession)
        assert (s.id, s.task_id, s.sandbox_id) == ("s1", "t1", "sb-s1")
        assert s.observation == "Print hello."
        assert [t["function"]["name"] for t in s.tools] == ["bash", "submit"]
        result = await twin.call(s.step, "bash", command="echo hello")
        assert isinstance(result, forkyard.StepResult)
        assert s.observation == result.observation and "hello" in result.observation
        assert not s.done and s.reward is None
        final = await twin.call(s.submit)
        assert final.terminated and final.reward == 1.0
        assert s.done and s.reward == 1.0 and s.last_result is final
        info = await twin.call(s.refresh)
        assert info.state is forkyard.SessionState.TERMINATED and s.info is info
        assert fake.state["s1"] == "terminated"
    assert fake.state["s1"] == "closed" and s.closed
    assert fake.actions == [
        {"tool": "bash", "arguments": {"command": "echo hello"}},
        {"tool": "submit", "arguments": {}},
    ]
    assert [(r.method, r.url.path) for r in twin.requests][-1] == ("DELETE", "/v1/sessions/s1")


async def test_close_is_idempotent(twin):
    fake = FakeSessions()
    twin.handle(fake)
    async with open_session(twin) as s:
        await twin.call(s.close if twin.kind == "sync" else s.aclose)
    assert [r.method for r in twin.requests].count("DELETE") == 1


async def test_body_error_wins_over_close_error(twin, caplog):
    twin.handle(FakeSessions(close_status=500))
    with pytest.raises(KeyError, match="mine"):
        async with open_session(twin) as s:
            raise KeyError("mine")
    assert not s.closed
    warnings = [
        r for r in caplog.records
        if r.levelno == logging.WARNING and "Could not close session s1" in r.getMessage()
    ]
    assert len(warnings) == 1 and warnings[0].exc_info is not None


async def test_close_error_without_body_error_is_raised(twin):
    twin.handle(FakeSessions(close_status=409))
    with pytest.raises(forkyard.ConflictError, match="Close failed"):
        async with open_session(twin):
            pass


async def test_closing_a_vanished_session_is_fine(twin):
    twin.handle(FakeSessions(close_status=404))
    async with open_session(twin) as s:
        pass
    assert s.closed


async def test_step_errors_keep_the_session_usable(twin):
    fake = FakeSessions()
    twin.handle(fake)
    async with open_session(twin) as s:
        await twin.call(s.submit)
        with pytest.raises(forkyard.ConflictError) as info:
            await twin.call(s.step, "bash", {"command": "ls"})
        assert info.value.code == "session_closed" and info.value.request_id == "req-s"
    assert fake.state["s1"] == "closed"


async def test_resource_calls_by_id(twin):
    fake = FakeSessions()
    twin.handle(fake)
    session = await twin.call(twin.client.sessions.create, "t9")  # the async opener is awaitable too
    session_id = session.id
    result = await twin.call(twin.client.sessions.step, session_id, "bash", {"command": "ls", "timeout": 5}, timeout=10)
    assert "hello" in result.observation
    assert fake.actions[-1] == {"tool": "bash", "arguments": {"command": "ls", "timeout": 10}}
    got = await twin.call(twin.client.sessions.get, session_id)
    assert isinstance(got, forkyard.SessionInfo) and got.state == "open" and got.steps == 1
    assert await twin.call(twin.client.sessions.close, session_id) is None
    assert fake.state[session_id] == "closed"


async def test_step_arguments_may_be_named_tool(twin):
    fake = FakeSessions()
    twin.handle(fake)
    async with open_session(twin) as s:
        await twin.call(s.step, "bash", command="ls", tool="x")
    assert fake.actions == [{"tool": "bash", "arguments": {"command": "ls", "tool": "x"}}]


async def test_bad_ids_are_refused_before_sending(twin):
    with pytest.raises(ValueError, match="task_id"):
        await twin.call(twin.client.sessions.create, "")
    with pytest.raises(ValueError, match="session_id"):
        await twin.call(twin.client.sessions.step, "", "bash")
    with pytest.raises(ValueError, match="tool"):
        await twin.call(twin.client.sessions.step, "s1", "")
    assert twin.requests == []


async def test_async_create_can_also_be_awaited(make_twin):
    twin = make_twin("async")
    fake = FakeSessions()
    twin.handle(fake)
    async with await twin.client.sessions.create("t1") as s:
        await s.step("bash", command="ls")
    assert fake.state == {"s1": "closed"}

    session = await twin.client.sessions.create("t1")
    try:
        assert session.observation == "Print hello."
    finally:
        await session.aclose()
    assert fake.state["s2"] == "closed"


async def test_async_opener_is_single_use(make_twin):
    twin = make_twin("async")
    twin.handle(FakeSessions())
    opener = twin.client.sessions.create("t1")
    session = await opener
    try:
        with pytest.raises(RuntimeError, match="already"):
            await opener
    finally:
        await session.aclose()
    assert len([r for r in twin.requests if r.method == "POST"]) == 1
