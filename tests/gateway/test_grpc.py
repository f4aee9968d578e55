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


async def test_a_snapshot_and_a_fork_over_the_stream_answer_what_rest_answers(grpc_gateway):
    task = await grpc_gateway.import_task("hello")
    session = await grpc_gateway.open_session(task["id"])
    replies = [r async for r in _attach(grpc_gateway, session["id"], [
        _step(1, "bash", command="solve it"),
        pb2.StepRequest(seq=2, snapshot=pb2.Snapshot()),  # in order with the steps: it holds step 1
        _step(3, "bash", command="echo after"),
    ])]
    assert [r.seq for r in replies] == [1, 2, 3] and not any(r.HasField("error") for r in replies)
    snap = json.loads(replies[1].result_json)
    assert snap["session_id"] == session["id"] and snap["steps"] == 1 and not replies[0].result_json
    rest = (await grpc_gateway.client.get(f"/v1/snapshots/{snap['id']}")).json()
    assert rest == snap
    replies = [r async for r in _attach(grpc_gateway, session["id"], [
        pb2.StepRequest(seq=4, fork=pb2.Fork(snapshot_id=snap["id"], n=2)),
        pb2.StepRequest(seq=5, fork=pb2.Fork(snapshot_id=snap["id"])),  # n = 0 means 1
        pb2.StepRequest(seq=6, fork=pb2.Fork(snapshot_id="snap_missing")),
        pb2.StepRequest(seq=7, fork=pb2.Fork(snapshot_id=snap["id"], n=65)),
    ])]
    forks = [json.loads(r.result_json)["items"] for r in replies[:2]]
    assert [len(f) for f in forks] == [2, 1]
    assert (replies[2].error.code, replies[2].error.status) == ("not_found", 404)
    assert (replies[3].error.code, replies[3].error.status) == ("validation_error", 422)
    for fork in forks[0] + forks[1]:
        assert fork["snapshot_id"] == snap["id"] and fork["steps"] == 1 and fork["state"] == "open"
        row = (await grpc_gateway.client.get(f"/v1/sessions/{fork['id']}")).json()
        assert row["state"] == "open" and row["snapshot_id"] == snap["id"]
    # A fork steps on a stream of its own and carries the state: the step before the snapshot wins.
    (end,) = [r async for r in _attach(grpc_gateway, forks[1][0]["id"], [_step(1, "submit")])]
    assert end.terminated and end.reward == 1.0


async def test_a_snapshot_of_a_closed_session_answers_in_band(grpc_gateway):
    task = await grpc_gateway.import_task("hello")
    session = await grpc_gateway.open_session(task["id"])
    replies = [r async for r in _attach(grpc_gateway, session["id"], [
        _step(1, "submit"), pb2.StepRequest(seq=2, snapshot=pb2.Snapshot())])]
    assert replies[0].terminated and (replies[1].error.code, replies[1].error.status) == ("session_closed", 409)
    assert (await grpc_gateway.client.get("/v1/snapshots", params={"session_id": session["id"]})).json()["items"] == []
