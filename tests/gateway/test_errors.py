"""Every failure answers {"error": {code, message, request_id}}, and the gateway keeps working after it."""

from __future__ import annotations

import logging

import pytest

from gateway.app import create_app
from gateway.errors import summarize_validation_errors
from tests.gateway.conftest import FakeRuntime, asgi_client, assert_error, make_settings

BASH_LS = {"action": {"tool": "bash", "arguments": {"command": "ls"}}}


@pytest.fixture
async def live(gateway):
    """The gateway with one open session that must stay usable after every error."""
    task = await gateway.import_task("keepalive")
    gateway.other = await gateway.open_session(task["id"])
    gateway.task = task
    yield gateway
    alive = await gateway.client.post(f"/v1/sessions/{gateway.other['id']}/step",
                                      json={"action": {"tool": "bash", "arguments": {"command": "echo alive"}}})
    assert alive.status_code == 200 and alive.json()["observation"].startswith("alive")
    assert (await gateway.client.get("/healthz")).json() == {"status": "ok"}


async def test_unknown_task_is_404(live):
    error = assert_error(await live.client.post("/v1/sessions", json={"task_id": "task_does_not_exist"}),
                         404, "not_found")
    assert "task_does_not_exist" in error["message"] and "Task" in error["message"]
    assert_error(await live.client.get("/v1/tasks/task_nope"), 404, "not_found")
    assert_error(await live.client.get("/v1/sessions/sess_nope"), 404, "not_found")
    assert_error(await live.client.delete("/v1/sessions/sess_nope"), 404, "not_found")
    assert_error(await live.client.get("/v1/environments/env_nope"), 404, "not_found")


async def test_unknown_route_and_method(live):
    error = assert_error(await live.client.get("/v1/nothing-here"), 404, "not_found")
    assert "/v1/nothing-here" in error["message"]
    error = assert_error(await live.client.put("/v1/tasks"), 405, "method_not_allowed")
    assert "PUT" in error["message"]


async def test_malformed_action_is_422_naming_the_field(live):
    sid = live.other["id"]
    error = assert_error(await live.client.post(f"/v1/sessions/{sid}/step", json={"action": {"arguments": {}}}),
                         422, "validation_error")
    assert "action.tool" in error["message"] and "required" in error["message"]
    error = assert_error(await live.client.post(f"/v1/sessions/{sid}/step", json={"action": {"tool": "bash",
                         "arguments": "ls"}}), 422, "validation_error")
    assert "action.arguments" in error["message"]
    error = assert_error(await live.client.post(f"/v1/sessions/{sid}/step", content=b"{not json",
                                                headers={"Content-Type": "application/json"}),
                         422, "validation_error")
    assert "JSON" in error["message"]


async def test_unknown_tool_and_bad_arguments_are_invalid_action(live):
    sid = live.other["id"]
    error = assert_error(await live.client.post(f"/v1/sessions/{sid}/step",
                                                json={"action": {"tool": "rm_rf", "arguments": {}}}),
                         422, "invalid_action")
    assert "rm_rf" in error["message"]
    assert_error(await live.client.post(f"/v1/sessions/{sid}/step",
                                        json={"action": {"tool": "bash", "arguments": {"nonsense": 1}}}),
                 422, "invalid_action")
    # Invalid actions are not counted and leave the session open.
    info = (await live.client.get(f"/v1/sessions/{sid}")).json()
    assert info["state"] == "open" and info["steps"] == 0


async def test_step_on_closed_session_is_409(live):
    opened = await live.open_session(live.task["id"])
    assert (await live.client.delete(f"/v1/sessions/{opened['id']}")).status_code == 204
    assert_error(await live.client.post(f"/v1/sessions/{opened['id']}/step", json=BASH_LS), 409, "session_closed")
    done = await live.open_session(live.task["id"])
    await live.client.post(f"/v1/sessions/{done['id']}/step", json={"action": {"tool": "submit"}})
    error = assert_error(await live.client.post(f"/v1/sessions/{done['id']}/step", json=BASH_LS),
                         409, "session_closed")
    assert "terminated" in error["message"]


async def test_oversized_body_is_413(tmp_path):
    app = create_app(make_settings(tmp_path, max_body_bytes=4096), runtime=FakeRuntime())
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        big = b"x" * 10_000
        error = assert_error(await client.post("/v1/tasks", content=big,
                                               headers={"Content-Type": "application/gzip"}), 413, "payload_too_large")
        assert "4096" in error["message"]

        async def chunks():  # no Content-Length: the limit is enforced while reading
            for _ in range(10):
                yield b"y" * 1000

        streamed = await client.post("/v1/tasks", content=chunks(), headers={"Content-Type": "application/gzip"})
        assert "content-length" not in streamed.request.headers
        assert_error(streamed, 413, "payload_too_large")
        json_big = await client.post("/v1/sessions", content=chunks(), headers={"Content-Type": "application/json"})
        assert_error(json_big, 413, "payload_too_large")
        assert (await client.get("/v1/tasks")).status_code == 200


async def test_unexpected_exception_is_500_without_traceback(live, caplog):
    caplog.set_level(logging.ERROR)
    response = await live.client.post(
        f"/v1/sessions/{live.other['id']}/step",
        json={"action": {"tool": "bash", "arguments": {"command": "crash-the-runtime"}}},
        headers={"X-Request-ID": "req-crash-1"},
    )
    error = assert_error(response, 500, "internal_error")
    assert error["request_id"] == "req-crash-1"
    assert "simulated" not in error["message"] and "fy_" not in response.text
    assert any("req-crash-1" in r.getMessage() and r.exc_info for r in caplog.records)


async def test_request_id_is_echoed_or_generated(live):
    given = await live.client.get("/v1/tasks", headers={"X-Request-ID": "trace-abc.123"})
    assert given.headers["x-request-id"] == "trace-abc.123"
    generated = await live.client.get("/v1/tasks", headers={"X-Request-ID": "bad id with spaces"})
    assert generated.headers["x-request-id"].startswith("req_")
    assert (await live.client.get("/healthz")).headers["x-request-id"].startswith("req_")


async def test_a_lost_sandbox_is_503_and_fails_its_session(tmp_path):
    from workers.errors import SandboxLostError

    class CrashingRuntime(FakeRuntime):
        async def step(self, session_id, tool, arguments):
            raise SandboxLostError("the sandbox's shell died")

    runtime = CrashingRuntime()
    app = create_app(make_settings(tmp_path), runtime=runtime)
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        from tests.gateway.conftest import task_files

        task_id = (await client.post("/v1/tasks", json={"tasks": [{"name": "t", "files": task_files("t")}]})
                   ).json()["items"][0]["id"]
        sid = (await client.post("/v1/sessions", json={"task_id": task_id})).json()["id"]
        error = assert_error(await client.post(f"/v1/sessions/{sid}/step", json=BASH_LS), 503, "sandbox_lost")
        assert "shell died" in error["message"]
        info = (await client.get(f"/v1/sessions/{sid}")).json()
        assert info["state"] == "failed" and runtime.sessions == {}


def test_validation_summary_names_field_and_counts_more():
    errors = [
        {"type": "missing", "loc": ("body", "action", "tool"), "msg": "Field required"},
        {"type": "string_type", "loc": ("query", "name"), "msg": "Input should be a valid string"},
        {"type": "int_parsing", "loc": ("query", "limit"), "msg": "Input should be a valid integer"},
    ]
    assert summarize_validation_errors(errors) == "Body field 'action.tool' is required (and 2 more problems)."
    assert summarize_validation_errors(errors[2:]) == (
        "Query parameter 'limit' is invalid: Input should be a valid integer."
    )


async def test_healthz_and_openapi_need_no_key(tmp_path):
    app = create_app(make_settings(tmp_path), runtime=FakeRuntime())
    async with app.router.lifespan_context(app), asgi_client(app, api_key=None) as client:
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        spec = (await client.get("/openapi.json")).json()
        assert "/v1/sessions/{session_id}/step" in spec["paths"]
        assert "application/gzip" in spec["paths"]["/v1/tasks"]["post"]["requestBody"]["content"]
