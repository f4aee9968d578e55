"""The escape suite, API level: inputs built to crash the gateway or to make it a proxy."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidRequestError
from gateway.policies.service import check_inference_servers
from tests.gateway.conftest import assert_error, gateway  # noqa: F401 - the fixture
from tests.gateway.rollout_helpers import (
    SCRIPTED_POLICY,
    import_tasks,
    recording_dispatcher,
)

TOKENS_POLICY = {"name": "pol-tokens", "api": "tokens", "model": "m", "base_urls": ["http://127.0.0.1:9/"]}


def _integer_fields_without_maximum(doc: dict) -> list[str]:
    """Return every integer or number an API request may carry that the OpenAPI document leaves unbounded."""
    schemas = doc.get("components", {}).get("schemas", {})
    found: list[str] = []

    def walk(node, where: str) -> None:
        if isinstance(node, dict):
            if node.get("type") in ("integer", "number") and not {"maximum", "exclusiveMaximum"} & set(node):
                found.append(where)
            for key, value in node.items():
                walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}[{i}]")

    def refs(node, out: set[str]) -> None:
        if isinstance(node, dict):
            if "$ref" in node:
                out.add(node["$ref"].rsplit("/", 1)[-1])
            for value in node.values():
                refs(value, out)
        elif isinstance(node, list):
            for value in node:
                refs(value, out)

    wanted: set[str] = set()
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            for param in op.get("parameters", []):
                walk(param.get("schema", {}), f"{method.upper()} {path} ?{param['name']}")
            refs(op.get("requestBody", {}), wanted)
    done: set[str] = set()
    while wanted - done:
        name = (wanted - done).pop()
        done.add(name)
        refs(schemas.get(name, {}), wanted)
    for name in sorted(done):
        walk(schemas.get(name, {}), name)
    return found


async def test_every_integer_input_is_bounded(gateway):  # noqa: F811
    doc = (await gateway.client.get("/openapi.json")).json()
    assert _integer_fields_without_maximum(doc) == []


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"max_staleness": 2**63}, "max_staleness"),
        ({"policy": {**SCRIPTED_POLICY, "sampling": {"seed": 2**64}}}, "seed"),
        ({"branching": {"at_turns": [2**63], "fanout": 2}}, "at_turns"),
    ],
)
async def test_huge_integers_are_a_4xx_naming_the_field(gateway, change, field):  # noqa: F811
    task_ids = await import_tasks(gateway.client, ["hello"])
    body = {"tasks": task_ids, "group_size": 1, "policy": SCRIPTED_POLICY, **change}
    error = assert_error(await gateway.client.post("/v1/rollouts", json=body), 422, "validation_error")
    assert field in error["message"]


async def test_huge_stream_cursors_are_a_4xx(gateway):  # noqa: F811
    task_ids = await import_tasks(gateway.client, ["hello"])
    with recording_dispatcher(gateway.app):
        rollout = (await gateway.client.post(
            "/v1/rollouts", json={"tasks": task_ids, "group_size": 1, "policy": SCRIPTED_POLICY})).json()
    pull = await gateway.client.post(f"/v1/rollouts/{rollout['id']}/pull", json={"consumer": "c", "cursor": 2**63})
    assert "cursor" in assert_error(pull, 422, "validation_error")["message"]
    stream = await gateway.client.get(f"/v1/rollouts/{rollout['id']}/stream", params={"consumer": "c", "cursor": 2**63})
    assert_error(stream, 422, "validation_error")
    stream = await gateway.client.get(f"/v1/rollouts/{rollout['id']}/stream", params={"consumer": "c"},
                                      headers={"Last-Event-ID": str(2**64)})
    assert "Last-Event-ID" in assert_error(stream, 400, "bad_request")["message"]


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "http://metadata.google.internal", "http://169.254.169.254"])
async def test_rollouts_cannot_aim_the_gateway_at_any_host(gateway, url):  # noqa: F811
    task_ids = await import_tasks(gateway.client, ["hello"])
    body = {"tasks": task_ids, "group_size": 1, "policy": {**TOKENS_POLICY, "base_urls": [url]}}
    error = assert_error(await gateway.client.post("/v1/rollouts", json=body), 422, "policy_host_not_allowed")
    assert "FORKYARD_POLICY_HOSTS" in error["message"]
    assert (await gateway.client.get("/v1/rollouts")).json()["items"] == []


def test_inference_server_allow_list_matching():
    allowed = ["localhost", "127.0.0.0/8", "::1", "*.gpu.internal", "10.1.0.0/16"]
    for url in ("http://localhost:8000", "http://127.0.0.2", "http://[::1]:8000", "http://a.gpu.internal:1",
                "http://10.1.2.3:8000", "http://LOCALHOST."):
        check_inference_servers([url], allowed=allowed)
    for url in ("http://10.2.0.1", "http://gpu.internal.evil.com", "http://evilgpu.internal", "http://[::2]"):
        with pytest.raises(InvalidRequestError):
            check_inference_servers([url], allowed=allowed)
    check_inference_servers(["http://anything.example:1"], allowed=["*"])
