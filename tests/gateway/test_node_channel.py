"""The node channel (gateway -> worker node): frames over one TCP connection, calls multiplexed by id,
opened with the node's channel token.

Real sockets on 127.0.0.1; the node's end is :class:`gateway.fleet.worker.NodeCalls` over a
stand-in runtime (the whole path with real worker processes is in tests/e2e/test_fleet.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import pytest

from gateway.fleet.channel import HELLO, FrameError, NodeClient, NodeServer, NodeUnreachable, frame, pb2, read_frame
from gateway.fleet.worker import NodeCalls
from workers.errors import NotSupportedError, SandboxBackendError, SessionNotFoundError
from workers.protocol import StepWire


class SlowRuntime:
    """Steps answer at once, except a step of session ``slow``, which waits for ``release``."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started: list[str] = []
        self.steps: list[tuple[str, str, dict]] = []

    async def step(self, session_id: str, tool: str, arguments: dict) -> StepWire:
        self.started.append(session_id)
        if session_id == "missing":
            raise SessionNotFoundError(f"no session {session_id}")
        if session_id == "slow":
            await self.release.wait()
        self.steps.append((session_id, tool, arguments))
        return StepWire(observation=f"{session_id}: {arguments}", reward=None, terminated=False, truncated=False)

    def session_count(self) -> int:
        return len(self.steps)


async def _no_task(task_id: str):
    raise AssertionError("no call here loads a task")


TOKEN = "node-secret-0123456789"


@pytest.fixture
async def node():
    runtime = SlowRuntime()
    server = NodeServer(NodeCalls(runtime, _no_task).reply, max_bytes=1 << 16, token=TOKEN)
    port = await server.start("127.0.0.1", 0)
    client = NodeClient("n1", f"127.0.0.1:{port}", token=TOKEN, max_bytes=1 << 16)
    try:
        yield runtime, server, client, port
    finally:
        await client.aclose()
        await server.aclose()


async def test_a_slow_call_holds_up_no_other_and_replies_reach_their_callers(node):
    runtime, _, client, _ = node
    slow = asyncio.create_task(client.call("step", session_id="slow", tool="bash", arguments={"command": "sleep"}))
    for _ in range(500):
        if runtime.started:
            break
        await asyncio.sleep(0.01)
    fast = [await client.call("step", session_id=f"s{i}", tool="bash", arguments={"i": i}) for i in range(5)]
    assert [r["observation"] for r in fast] == [f"s{i}: {{'i': {i}}}" for i in range(5)]
    assert not slow.done() and runtime.started[0] == "slow"
    runtime.release.set()
    assert (await slow)["observation"] == "slow: {'command': 'sleep'}"
    assert await client.call("session_count") == 6


async def test_many_concurrent_calls_each_get_their_own_reply(node):
    _, _, client, _ = node
    replies = await asyncio.gather(*(client.call("step", session_id=f"s{i}", tool="t", arguments={"i": i})
                                     for i in range(200)))
    assert [r["observation"] for r in replies] == [f"s{i}: {{'i': {i}}}" for i in range(200)]


async def test_worker_errors_cross_by_code_and_only_node_calls_are_callable(node):
    _, _, client, _ = node
    with pytest.raises(SessionNotFoundError, match="no session missing"):
        await client.call("step", session_id="missing", tool="t", arguments={})
    # Attributes of the node's end are not calls: a peer cannot reach its task loader or its runtime.
    for method in ("load_task", "runtime", "reply", "__init__", "nothing"):
        with pytest.raises(NotSupportedError, match="unknown node call"):
            await client.call(method)
    assert await client.call("session_count") == 0  # the connection survived every error


async def test_a_node_that_goes_away_fails_the_waiting_calls_and_a_dead_port_is_unreachable(node):
    runtime, server, client, port = node
    waiting = asyncio.create_task(client.call("step", session_id="slow", tool="t", arguments={}))
    for _ in range(500):
        if runtime.started:
            break
        await asyncio.sleep(0.01)
    await server.aclose()
    with pytest.raises(SandboxBackendError) as failed:
        await asyncio.wait_for(waiting, 10)
    assert not isinstance(failed.value, NodeUnreachable)  # it was sent: not retried elsewhere
    with pytest.raises(NodeUnreachable, match=f"node n1 \\(127.0.0.1:{port}\\) did not answer"):
        await client.call("session_count")


async def test_the_client_reconnects_to_a_node_back_on_its_port(node):
    runtime, server, client, port = node
    assert await client.call("session_count") == 0
    await server.aclose()
    again = NodeServer(NodeCalls(runtime, _no_task).reply, max_bytes=1 << 16, token=TOKEN)
    await again.start("127.0.0.1", port)
    try:
        for _ in range(50):  # the old connection's end is seen by the reader first
            try:
                assert await client.call("session_count") == 0
                break
            except SandboxBackendError:
                await asyncio.sleep(0.05)
        else:
            pytest.fail("the client never reconnected")
    finally:
        await again.aclose()


def _hello(token: str = TOKEN) -> bytes:
    return frame(pb2.NodeRequest(id=0, method=HELLO, args_json=json.dumps({"token": token})))


async def test_a_wrong_or_missing_token_is_refused_and_nothing_runs(node):
    runtime, _, client, port = node
    step = pb2.NodeRequest(id=1, method="step", args_json=json.dumps({"session_id": "s", "tool": "t", "arguments": {}}))
    for opening in (_hello("guess"), frame(step), frame(pb2.NodeRequest(id=0, method=HELLO, args_json="[1]"))):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(opening + frame(step))
        await writer.drain()
        refusal = pb2.NodeReply.FromString(await asyncio.wait_for(read_frame(reader, 1 << 16), 10))
        assert refusal.id == 0 and json.loads(refusal.error_json)["code"] == "sandbox_error"
        assert "channel token was not presented" in json.loads(refusal.error_json)["message"]
        assert await asyncio.wait_for(reader.read(), 10) == b""  # and closed, answering nothing else
        writer.close()
    assert runtime.started == []  # no step ran
    stranger = NodeClient("n1", f"127.0.0.1:{port}", token="stale-token-of-an-earlier-start")
    try:
        with pytest.raises(NodeUnreachable, match="refused the channel"):  # retried by FleetRuntime with a fresh token
            await stranger.call("session_count")
    finally:
        await stranger.aclose()
    assert await client.call("session_count") == 0  # the right token is served


async def test_an_oversized_or_garbled_frame_drops_only_that_connection(node):
    _, _, client, port = node
    too_big = struct.pack(">I", (1 << 16) + 1) + b"x" * 16
    garbled = struct.pack(">I", 4) + b"\xff\xff\xff\xff"
    for payload in (too_big, garbled, _hello() + too_big, _hello() + garbled, struct.pack(">I", 5000)):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(payload)
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # the node closed it, answering nothing
        writer.close()
    assert await client.call("session_count") == 0  # other gateways' connections are untouched


async def test_read_frame_tells_a_clean_end_from_a_cut_frame():
    def stream(data: bytes) -> asyncio.StreamReader:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return reader

    message = pb2.NodeReply(id=7, result_json=json.dumps({"ok": True}))
    whole = frame(message)
    assert pb2.NodeReply.FromString(await read_frame(stream(whole), 1024)) == message
    assert await read_frame(stream(b""), 1024) is None
    with pytest.raises(FrameError, match="inside a frame's length"):
        await read_frame(stream(whole[:2]), 1024)
    with pytest.raises(FrameError, match="short of a frame"):
        await read_frame(stream(whole[:-1]), 1024)
    with pytest.raises(FrameError, match="over the channel's limit of 4"):
        await read_frame(stream(whole), 4)


async def test_both_ends_keep_the_connection_alive():
    seen: list[int] = []

    async def reply(request):
        return pb2.NodeReply(id=request.id, result_json="1")

    server = NodeServer(reply, max_bytes=1024, token=TOKEN)
    port = await server.start("127.0.0.1", 0)
    client = NodeClient("n1", f"127.0.0.1:{port}", token=TOKEN)
    try:
        assert await client.call("x") == 1
        sock = client._writer.get_extra_info("socket")  # type: ignore[union-attr]
        seen.append(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE))
        seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE))
        (node_end,) = server._connections
        seen.append(node_end.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE))
    finally:
        await client.aclose()
        await server.aclose()
    assert seen == [1, 10, 1]
