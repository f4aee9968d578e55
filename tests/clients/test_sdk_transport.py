"""The SDK over real sockets: a refused port, a gateway that never answers, a real HTTP server."""

from __future__ import annotations

import io
import json
import socket
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import forkyard


def make_client(kind: str, base_url: str, **kwargs):
    sleeps: list[float] = []
    if kind == "sync":
        client = forkyard.Client(base_url=base_url, api_key="sk-real", **kwargs)
        client._sleep = sleeps.append
    else:
        client = forkyard.AsyncClient(base_url=base_url, api_key="sk-real", **kwargs)

        async def fake_sleep(seconds: float) -> None:
            sleeps.append(seconds)

        client._sleep = fake_sleep
    return client, sleeps


async def call(fn, *args, **kwargs):
    result = fn(*args, **kwargs)
    return await result if hasattr(result, "__await__") else result


async def close(client):
    if isinstance(client, forkyard.AsyncClient):
        await client.aclose()
    else:
        client.close()


@pytest.fixture
def refused_url():
    """A localhost URL nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def silent_url():
    """A localhost URL that accepts connections but never answers."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


class ScriptedGateway(BaseHTTPRequestHandler):
    """Answers from the server's script; records what it received."""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        body = self.rfile.read(length) if length else b""
        self.server.received.append((self.command, self.path, dict(self.headers), body))
        status, headers, payload = self.server.script.pop(0)
        data = json.dumps(payload).encode() if payload is not None else b""
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = _answer

    def log_message(self, format, *args):  # keep test output quiet
        pass


@pytest.fixture
def gateway():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedGateway)
    server.script, server.received = [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_refused_connection_is_retried_then_raised(kind, refused_url):
    client, sleeps = make_client(kind, refused_url, max_retries=2)
    try:
        with pytest.raises(forkyard.APIConnectionError) as info:
            await call(client.sessions.step, "s1", "bash", command="ls")
    finally:
        await close(client)
    assert not isinstance(info.value, forkyard.APITimeoutError)
    assert refused_url in str(info.value)
    assert len(sleeps) == 2, "a POST that never left is safe to resend"


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_unanswered_request_times_out(kind, silent_url):
    client, sleeps = make_client(kind, silent_url, max_retries=1, timeout=0.3)
    try:
        with pytest.raises(forkyard.APITimeoutError):
            await call(client.sessions.step, "s1", "submit")
        assert sleeps == [], "a POST that may have run is not resent"
        with pytest.raises(forkyard.APITimeoutError):
            await call(client.tasks.get, "t1")
        assert len(sleeps) == 1
    finally:
        await close(client)


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_real_http_round_trip(kind, gateway, tmp_path):
    url = f"http://127.0.0.1:{gateway.server_address[1]}"
    task = {"id": "t1", "name": "hello", "environment": "terminal", "content_hash": "ab", "instruction": "Hi."}
    gateway.script += [
        (503, {"Retry-After": "0"}, {"error": {"code": "unavailable", "message": "Starting.", "request_id": "r1"}}),
        (201, {}, {"items": [task]}),
        (404, {"X-Request-ID": "r2"},
         {"error": {"code": "not_found", "message": "No task 'nope'.", "request_id": "r2"}}),
    ]
    task_dir = tmp_path / "hello"
    task_dir.mkdir()
    (task_dir / "instruction.md").write_text("Hi.")
    client, sleeps = make_client(kind, url)
    try:
        [imported] = await call(client.tasks.import_dir, task_dir)
        assert imported.id == "t1"
        with pytest.raises(forkyard.NotFoundError) as info:
            await call(client.tasks.get, "nope")
    finally:
        await close(client)
    assert sleeps == [0.0]
    assert str(info.value) == "404 not_found: No task 'nope'. (request id: r2)"
    (method, path, headers, body), _, _ = gateway.received
    assert (method, path) == ("POST", "/v1/tasks?environment=terminal")
    assert headers["Authorization"] == "Bearer sk-real"
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
        assert tar.getnames() == ["hello/instruction.md"]
    assert gateway.received[1][3] == body
