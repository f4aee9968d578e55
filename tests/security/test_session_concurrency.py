"""The escape suite, session level: a flood of concurrent steps on one session, and a close amid them.

Against a real ``forkyard up`` (uvicorn on 127.0.0.1, both backends): every request
gets an answer (200, or 409 ``session_busy`` while another step runs), the history
holds exactly the steps that were answered 200, and a close in the middle of running
steps ends the session ``closed``, never ``failed``. Bounded: a fixed number of
requests over a fixed number of connections.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.clients.test_live import ECHO_TASK

pytestmark = pytest.mark.timeout(300)

STEPS = 300
CONNECTIONS = 60


async def _open(client: httpx.AsyncClient) -> str:
    task = (await client.post("/v1/tasks", json={"tasks": [ECHO_TASK]})).json()["items"][0]
    response = await client.post("/v1/sessions", json={"task_id": task["id"]})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _step(session_id: str, command: str) -> tuple[str, dict]:
    return f"/v1/sessions/{session_id}/step", {"action": {"tool": "bash", "arguments": {"command": command}}}


async def test_concurrent_steps_are_answered_one_at_a_time(live_gateway):
    limits = httpx.Limits(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS)
    headers = {"Authorization": f"Bearer {live_gateway.api_key}"}
    async with httpx.AsyncClient(base_url=live_gateway.url, headers=headers, limits=limits, timeout=120) as client:
        session_id = await _open(client)
        try:
            path, body = _step(session_id, "echo step >> /tmp/steps; sleep 0.01")
            answers = await asyncio.gather(*(client.post(path, json=body) for _ in range(STEPS)),
                                           return_exceptions=True)
            dropped = [a for a in answers if isinstance(a, BaseException)]
            assert dropped == []
            codes = [a.status_code for a in answers]
            assert set(codes) <= {200, 409}, codes
            busy = [a.json()["error"]["code"] for a in answers if a.status_code == 409]
            assert set(busy) <= {"session_busy"}
            ok = codes.count(200)
            assert ok >= 1
            info = (await client.get(f"/v1/sessions/{session_id}")).json()
            assert info["steps"] == ok and info["state"] == "open"
            # Every answered step ran exactly once.
            path, body = _step(session_id, "wc -l < /tmp/steps")
            count = (await client.post(path, json=body)).json()["observation"].split()[0]
            assert int(count) == ok
        finally:
            await client.delete(f"/v1/sessions/{session_id}")


async def test_close_amid_running_steps_ends_the_session_closed(live_gateway):
    headers = {"Authorization": f"Bearer {live_gateway.api_key}"}
    async with httpx.AsyncClient(base_url=live_gateway.url, headers=headers, timeout=120) as client:
        session_id = await _open(client)
        path, body = _step(session_id, "sleep 30")
        running = asyncio.ensure_future(client.post(path, json=body))
        await asyncio.sleep(1.0)  # the step is in the sandbox now
        closed = await client.delete(f"/v1/sessions/{session_id}")
        assert closed.status_code == 204
        answer = await asyncio.wait_for(running, 60)
        # The close interrupts the step (it does not wait out its 30 s): the step answers, as closed.
        assert answer.status_code == 409, answer.text
        assert answer.json()["error"]["code"] == "session_closed"
        info = (await client.get(f"/v1/sessions/{session_id}")).json()
        assert info["state"] == "closed", info
        assert (await client.get("/healthz")).status_code == 200
