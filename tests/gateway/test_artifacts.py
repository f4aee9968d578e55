"""Artifacts: a step's files are stored apart, linked from the step and served by id."""

from __future__ import annotations

import json

from tests.gateway.conftest import asgi_client, assert_error
from workers.protocol import StepWire, wire_json_default


async def bash(gateway, session_id: str, command: str) -> dict:
    response = await gateway.client.post(f"/v1/sessions/{session_id}/step",
                                         json={"action": {"tool": "bash", "arguments": {"command": command}}})
    assert response.status_code == 200, response.text
    return response.json()


async def test_a_steps_file_is_linked_and_served_not_inlined(gateway):
    task = await gateway.import_task()
    session = await gateway.open_session(task["id"])
    step = await bash(gateway, session["id"], "screenshot page-one")
    (link,) = step["info"]["artifacts"]
    assert link["name"] == "shot.png" and link["media_type"] == "image/png" and link["bytes"] == 8 + 8
    assert link["url"] == f"/v1/artifacts/{link['id']}" and link["id"].startswith("art_")
    assert "page-one" not in step["observation"] and "PNG" not in json.dumps(step)  # only the link travels
    got = await gateway.client.get(link["url"])
    assert got.status_code == 200 and got.headers["content-type"] == "image/png"
    assert got.content == b"\x89PNG\r\n\x1a\npage-one"

    again = await bash(gateway, session["id"], "screenshot page-one")
    assert again["info"]["artifacts"][0]["id"] == link["id"]  # the same bytes: one artifact
    other = await bash(gateway, session["id"], "screenshot page-two")
    assert other["info"]["artifacts"][0]["id"] != link["id"]


async def test_unknown_artifact_is_404_and_artifacts_need_a_key(gateway):
    assert_error(await gateway.client.get("/v1/artifacts/art_nope"), 404, "not_found")
    async with asgi_client(gateway.app, api_key=None) as anonymous:
        assert_error(await anonymous.get("/v1/artifacts/art_nope"), 401, "unauthorized")


def test_artifacts_cross_the_node_wire_as_base64():
    wire = StepWire(observation="o", reward=None, terminated=False, truncated=False, info={"a": 1},
                    artifacts={"screenshot.png": bytes(range(256))})
    sent = json.loads(json.dumps(wire.model_dump(), default=wire_json_default))
    assert isinstance(sent["artifacts"]["screenshot.png"], str)
    assert StepWire.model_validate(sent) == wire
