"""The sessions' gRPC step channel: the same steps, records and errors as REST, over one stream."""

from __future__ import annotations

import json

import grpc
import pytest

from gateway.app import create_app
from gateway.grpc.codegen import modules
from tests.gateway.conftest import API_KEY, FakeRuntime, Gateway, asgi_client, make_settings

pb2, pb2_grpc = modules()


@pytest.fixture
async def grpc_gateway(tmp_path):
    runtime = FakeRuntime()
    app = create_app(make_settings(tmp_path, grpc_port=0), runtime=runtime)
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        gw = Gateway(app, runtime, client)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.state.grpc_port}") as channel:
            gw.stub = pb2_grpc.SessionsStub(channel)
            yield gw


def _attach(gw: Gateway, session_id: str, requests: list, key: str = API_KEY):
    async def send():
        for r in requests:
            yield r

    return gw.stub.Attach(send(), metadata=(("authorization", f"Bearer {key}"), ("x-forkyard-session", session_id)))


def _step(seq: int, tool: str, **arguments) -> object:
    return pb2.StepRequest(seq=seq, tool=tool, arguments_json=json.dumps(arguments))


async def test_steps_over_one_stream_match_rest_and_are_recorded(grpc_gateway):
    task = await grpc_gateway.import_task("hello")
    session = await grpc_gateway.open_session(task["id"])
    replies = [r async for r in _attach(grpc_gateway, session["id"], [
        _step(1, "bash", command="echo one"),
        _step(2, "nope"),  # an error is in-band: the stream goes on
        pb2.StepRequest(seq=3, tool="bash", arguments_json="[1]"),
        _step(4, "bash", command="echo two"),
    ])]
    assert [r.seq for r in replies] == [1, 2, 3, 4]
    rest = await grpc_gateway.client.post(f"/v1/sessions/{session['id']}/step",
                                          json={"action": {"tool": "bash", "arguments": {"command": "echo one"}}})
    assert replies[0].observation == rest.json()["observation"] and not replies[0].HasField("error")
    assert (replies[1].error.code, replies[1].error.status) == ("invalid_action", 422)
    assert (replies[2].error.code, replies[2].error.status) == ("validation_error", 422)
    assert replies[3].observation and json.loads(replies[3].info_json) == rest.json()["info"]
    steps = (await grpc_gateway.client.get(f"/v1/sessions/{session['id']}/steps")).json()["items"]
    commands = [s["action"]["arguments"].get("command") for s in steps]
    assert commands == ["echo one", "echo two", "echo one"]  # two through gRPC, then the REST one


async def test_a_closed_session_answers_in_band_and_the_end_step_has_its_reward(grpc_gateway):
    task = await grpc_gateway.import_task("hello")
    session = await grpc_gateway.open_session(task["id"])
    replies = [r async for r in _attach(grpc_gateway, session["id"], [
        _step(1, "bash", command="solve"), _step(2, "submit"), _step(3, "bash", command="ls")])]
    assert replies[1].terminated and replies[1].HasField("reward")
    assert replies[1].reward == (await grpc_gateway.client.get(f"/v1/sessions/{session['id']}")).json()["reward"]
    assert replies[2].error.code == "session_closed"


async def test_a_bad_key_or_an_unknown_session_ends_the_call(grpc_gateway):
    task = await grpc_gateway.import_task("hello")
    session = await grpc_gateway.open_session(task["id"])
    with pytest.raises(grpc.aio.AioRpcError) as bad_key:
        _ = [r async for r in _attach(grpc_gateway, session["id"], [_step(1, "bash", command="ls")], key="fy_nope")]
    assert bad_key.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        _ = [r async for r in _attach(grpc_gateway, "sess_missing", [_step(1, "bash", command="ls")])]
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "sess_missing" in unknown.value.details()
