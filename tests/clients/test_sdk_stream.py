"""Server-sent events: the parser, and client.rollouts.stream over a fake gateway (both twins).

The fake gateway answers with streamed bodies that can break off mid-way, as a dropped
connection does; the stream must resume with Last-Event-ID and end at `event: end`.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

import forkyard
from forkyard._streaming import ServerSentEvent, SSEDecoder

SSE_HEADERS = {"content-type": "text/event-stream; charset=utf-8"}


# -- the parser ---------------------------------------------------------------------------


def decode_all(*chunks: bytes, last_event_id: str | None = None) -> list[ServerSentEvent]:
    decoder = SSEDecoder(last_event_id)
    events: list[ServerSentEvent] = []
    for chunk in chunks:
        events.extend(decoder.feed(chunk))
    return events


def test_multi_line_data_is_joined_with_newlines():
    [event] = decode_all(b"event: episodes\nid: 7\ndata: [1,\ndata: 2]\n\n")
    assert event == ServerSentEvent(event="episodes", data="[1,\n2]", id="7")
    assert json.loads(event.data) == [1, 2]


def test_comments_and_heartbeats_are_skipped():
    events = decode_all(b": heartbeat\n\n:\n\ndata: one\n: inside an event\ndata: two\n\n: ping\n\n")
    assert events == [ServerSentEvent(data="one\ntwo")]


def test_byte_by_byte_chunks_crlf_and_utf8_split_give_the_same_events():
    raw = "\ufeffevent: a\r\nid: 1\r\ndata: h\u00e9llo \u2603\r\n\r\nevent: b\rdata: x\r\rdata: last\n\n".encode()
    whole = decode_all(raw)
    assert [(e.event, e.data, e.id) for e in whole] == [
        ("a", "h\u00e9llo \u2603", "1"), ("b", "x", "1"), ("message", "last", "1"),
    ]
    assert decode_all(*(raw[i:i + 1] for i in range(len(raw)))) == whole


def test_field_rules_follow_the_spec():
    events = decode_all(
        b"data:no-space\n\n"           # the space after the colon is optional
        b"data:  two-spaces\n\n"       # only one space is stripped
        b"data\n\n"                    # a field name alone means an empty value
        b"id: 5\nretry: 2500\nfoo: bar\ndata: x\n\n"   # unknown fields are ignored
        b"id: 6\x00\nretry: soon\ndata: y\n\n"          # an id with NUL and a non-numeric retry are ignored
    )
    assert [e.data for e in events] == ["no-space", " two-spaces", "", "x", "y"]
    assert [e.id for e in events] == [None, None, None, "5", "5"]
    assert [e.retry_ms for e in events][-1] == 2500


def test_id_only_blocks_update_the_last_id_without_an_event():
    decoder = SSEDecoder("3")
    assert decoder.feed(b"id: 9\n\n") == []
    assert decoder.last_event_id == "9"
    [event] = decoder.feed(b"data: z\n\n")
    assert event.id == "9"


def test_a_half_received_event_is_not_dispatched():
    decoder = SSEDecoder()
    assert decoder.feed(b"event: episodes\ndata: [1, 2") == []
    assert decoder.feed(b"]\n") == []
    [event] = decoder.feed(b"\n")
    assert event.data == "[1, 2]"


def test_an_event_type_without_data_is_still_dispatched():
    assert decode_all(b"event: end\n\n") == [ServerSentEvent(event="end")]


# -- client.rollouts.stream -------------------------------------------------------------


class Body(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A streamed response body: chunks, then either a clean end or a dropped connection."""

    def __init__(self, *chunks: str | bytes, drop: Exception | None = None) -> None:
        self.chunks = [c.encode() if isinstance(c, str) else c for c in chunks]
        self.drop = drop
        self.closed = False

    def __iter__(self):
        yield from self.chunks
        if self.drop is not None:
            raise self.drop

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        if self.drop is not None:
            raise self.drop

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.closed = True


def sse(body: Body, status: int = 200, headers: dict | None = None) -> httpx.Response:
    return httpx.Response(status, headers=headers or SSE_HEADERS, stream=body)


def episode(n: int, group: str = "g0", reward: float = 1.0) -> dict:
    return {
        "episode_id": f"e{n}", "seq": n, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "logprobs": [-0.5, -0.25],
        "reward": reward, "group_id": group, "weight_versions": [0], "termination": "submitted", "status": "completed",
    }


def episodes_event(*ns: int, seq: int | None = None) -> str:
    payload = json.dumps([episode(n) for n in ns])
    return f"event: episodes\nid: {seq if seq is not None else max(ns)}\ndata: {payload}\n\n"


END = "event: end\ndata: {}\n\n"


def stream_requests(twin) -> list[httpx.Request]:
    return [r for r in twin.requests if r.url.path.endswith("/stream")]


async def test_stream_yields_batches_until_end(twin):
    body = Body(": connected\n\n", episodes_event(1, 2), ": heartbeat\n\n", episodes_event(3), END)
    twin.respond(sse(body))
    batches = await twin.collect(twin.client.rollouts.stream("r1", consumer="trainer", batch_size=2))
    assert [b.episode_ids for b in batches] == [["e1", "e2"], ["e3"]]
    assert [b.cursor for b in batches] == [2, 3]
    first = batches[0]
    expected_cls = forkyard.EpisodeBatch if twin.kind == "sync" else forkyard.AsyncEpisodeBatch
    assert isinstance(first, expected_cls)
    assert (first.rollout_id, first.consumer, first.done) == ("r1", "trainer", False)
    assert isinstance(first[0], forkyard.Episode) and first[0].logprobs == [-0.5, -0.25]
    assert first[0].status is forkyard.EpisodeStatus.COMPLETED
    [request] = twin.requests
    assert request.method == "GET" and request.url.path == "/v1/rollouts/r1/stream"
    assert dict(request.url.params) == {"consumer": "trainer", "batch_size": "2"}
    assert request.headers["accept"] == "text/event-stream"
    assert "last-event-id" not in request.headers
    assert request.headers["authorization"] == f"Bearer {twin.api_key}"
    assert body.closed, "the response is closed once the end event arrives"
    assert twin.sleeps == []


async def test_stream_resumes_with_last_event_id_after_a_dropped_connection(twin):
    first = Body(episodes_event(1, 2), "event: episodes\nid: 3\ndata: [", drop=httpx.RemoteProtocolError("peer closed"))
    second = Body(episodes_event(3, 4), END)
    twin.respond(sse(first), sse(second))
    batches = await twin.collect(twin.client.rollouts.stream("r1", consumer="c"))
    assert [b.episode_ids for b in batches] == [["e1", "e2"], ["e3", "e4"]]
    requests = stream_requests(twin)
    assert len(requests) == 2
    assert requests[1].headers["last-event-id"] == "2", "the half-received event 3 does not count"
    assert dict(requests[1].url.params) == {"consumer": "c"}
    assert len(twin.sleeps) == 1 and twin.sleeps[0] > 0
    assert first.closed and second.closed


async def test_stream_resumes_when_the_gateway_closes_before_end(twin):
    twin.respond(sse(Body(episodes_event(1))), sse(Body(": hi\n\n", END)))
    batches = await twin.collect(twin.client.rollouts.stream("r1", consumer="c"))
    assert [b.episode_ids for b in batches] == [["e1"]]
    assert stream_requests(twin)[1].headers["last-event-id"] == "1"


async def test_stream_honours_the_server_retry_hint(twin):
    twin.respond(sse(Body("retry: 3000\n\n", episodes_event(1))), sse(Body(END)))
    await twin.collect(twin.client.rollouts.stream("r1", consumer="c"))
    assert twin.sleeps == [3.0]


async def test_stream_starts_from_a_given_cursor_and_passes_delivery_options(twin):
    twin.respond(sse(Body(END)))
    stream = twin.client.rollouts.stream("r1", consumer="c", cursor=41, visibility_timeout_s=120, redeliver=True)
    assert await twin.collect(stream) == []
    request = twin.requests[0]
    assert request.headers["last-event-id"] == "41"
    assert dict(request.url.params) == {"consumer": "c", "visibility_timeout_s": "120", "redeliver": "true"}


async def test_stream_reconnects_a_bounded_number_of_times(twin):
    twin.handle(lambda request: httpx.ConnectError("connection refused"))
    with pytest.raises(forkyard.APIConnectionError, match=r"stream of rollout r1 dropped .* 3 reconnect attempts"):
        await twin.collect(twin.client.rollouts.stream("r1", consumer="c", max_reconnects=3))
    assert len(twin.requests) == 4
    assert len(twin.sleeps) == 3


async def test_an_event_resets_the_reconnect_budget(twin):
    drop = httpx.ReadError("reset by peer")
    twin.respond(
        sse(Body(episodes_event(1), drop=drop)),
        sse(Body(episodes_event(2), drop=drop)),
        sse(Body(episodes_event(3), drop=drop)),
        sse(Body(END)),
    )
    batches = await twin.collect(twin.client.rollouts.stream("r1", consumer="c", max_reconnects=1))
    assert [b.episode_ids for b in batches] == [["e1"], ["e2"], ["e3"]]
    assert [r.headers.get("last-event-id") for r in stream_requests(twin)] == [None, "1", "2", "3"]


async def test_a_read_timeout_counts_as_a_drop(twin):
    twin.respond(sse(Body(episodes_event(1), drop=httpx.ReadTimeout("no bytes"))))
    twin.handle(lambda request: httpx.ReadTimeout("still nothing"))
    with pytest.raises(forkyard.APITimeoutError):
        await twin.collect(twin.client.rollouts.stream("r1", consumer="c", max_reconnects=2))
    assert [r.headers.get("last-event-id") for r in stream_requests(twin)] == [None, "1", "1"]


async def test_a_missing_rollout_is_raised_without_retrying(twin):
    twin.respond(twin.error(404, "not_found", "Rollout r9 does not exist."))
    with pytest.raises(forkyard.NotFoundError, match="Rollout r9 does not exist"):
        await twin.collect(twin.client.rollouts.stream("r9", consumer="c"))
    assert len(twin.requests) == 1 and twin.sleeps == []


async def test_an_unavailable_gateway_is_retried(twin):
    twin.respond(twin.error(503, "unavailable", "Starting up.", headers={"Retry-After": "2"}), sse(Body(END)))
    assert await twin.collect(twin.client.rollouts.stream("r1", consumer="c")) == []
    assert twin.sleeps == [2.0]


async def test_a_json_answer_is_not_taken_for_a_stream(twin):
    twin.respond(httpx.Response(200, json={"episodes": []}))
    with pytest.raises(forkyard.APIResponseValidationError, match="not an event stream"):
        await twin.collect(twin.client.rollouts.stream("r1", consumer="c"))


async def test_episodes_given_out_are_not_given_again_after_a_reconnect(twin):
    twin.respond(
        sse(Body(episodes_event(1, 2), drop=httpx.RemoteProtocolError("gone"))),
        sse(Body(episodes_event(1, 2, 3, seq=3), episodes_event(2, seq=3), END)),
    )
    batches = await twin.collect(twin.client.rollouts.stream("r1", consumer="c"))
    assert [b.episode_ids for b in batches] == [["e1", "e2"], ["e3"]]


async def test_acked_episodes_are_forgotten_and_batch_ack_sends_exactly_its_ids(twin):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/ack"):
            return httpx.Response(200, json={"acked": len(json.loads(request.content)["episode_ids"])})
        return sse(Body(episodes_event(1, 2), episodes_event(3), END))

    twin.handle(handler)
    stream = twin.client.rollouts.stream("r1", consumer="learner")
    seen = []
    if twin.kind == "sync":
        for batch in stream:
            seen.append(batch.episode_ids)
            assert batch.ack() == len(batch)
            assert batch.acked
    else:
        async for batch in stream:
            seen.append(batch.episode_ids)
            assert await batch.ack() == len(batch)
            assert batch.acked
    assert seen == [["e1", "e2"], ["e3"]]
    acks = [json.loads(r.content) for r in twin.requests if r.url.path == "/v1/rollouts/r1/ack"]
    assert acks == [
        {"consumer": "learner", "episode_ids": ["e1", "e2"]},
        {"consumer": "learner", "episode_ids": ["e3"]},
    ]


async def test_leaving_the_loop_early_closes_the_connection(twin):
    body = Body(episodes_event(1), episodes_event(2), END)
    twin.respond(sse(body))
    stream = twin.client.rollouts.stream("r1", consumer="c")
    if twin.kind == "sync":
        with stream:
            first = next(iter(stream))
    else:
        async with stream:
            first = await stream.__anext__()
    assert first.episode_ids == ["e1"]
    assert body.closed
    assert len(twin.requests) == 1


async def test_unknown_events_are_ignored(twin):
    twin.respond(sse(Body("event: progress\ndata: {\"finished\": 3}\n\n", "data: plain message\n\n",
                          episodes_event(1), END)))
    batches = await twin.collect(twin.client.rollouts.stream("r1", consumer="c"))
    assert [b.episode_ids for b in batches] == [["e1"]]


async def test_a_malformed_episodes_event_is_an_error(twin):
    twin.respond(sse(Body("event: episodes\nid: 1\ndata: [{\"seq\": 1}]\n\n")))
    with pytest.raises(forkyard.APIError, match=r"malformed 'episodes' event \(id 1\) on the stream of rollout r1"):
        await twin.collect(twin.client.rollouts.stream("r1", consumer="c"))


async def test_an_error_event_makes_the_stream_resume_after_its_last_event(twin):
    failure = json.dumps({"error": {"code": "internal_error", "message": "The stream failed; reconnect."}})
    twin.respond(
        sse(Body(episodes_event(1), f"event: error\ndata: {failure}\n\n", episodes_event(9))),
        sse(Body(episodes_event(2), END)),
    )
    batches = await twin.collect(twin.client.rollouts.stream("r1", consumer="c"))
    assert [b.episode_ids for b in batches] == [["e1"], ["e2"]], "nothing after the error event is read"
    assert [r.headers.get("last-event-id") for r in stream_requests(twin)] == [None, "1"]


async def test_repeated_error_events_give_up_with_the_gateway_message(twin):
    failure = json.dumps({"error": {"code": "internal_error", "message": "Database is locked."}})
    twin.handle(lambda request: sse(Body(f"event: error\ndata: {failure}\n\n")))
    with pytest.raises(forkyard.APIConnectionError, match="2 reconnect attempts: the gateway reported: Database is locked"):
        await twin.collect(twin.client.rollouts.stream("r1", consumer="c", max_reconnects=2))
    assert len(twin.requests) == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"consumer": ""}, "consumer"),
        ({"consumer": "c", "batch_size": 0}, "batch_size"),
        ({"consumer": "c", "max_reconnects": -1}, "max_reconnects"),
    ],
)
async def test_bad_stream_arguments_are_refused_before_sending(twin, kwargs, message):
    with pytest.raises(ValueError, match=message):
        twin.client.rollouts.stream("r1", **kwargs)
    with pytest.raises(ValueError, match="rollout_id"):
        twin.client.rollouts.stream("", consumer="c")
    assert twin.requests == []


# -- over a real socket -------------------------------------------------------------------


class StreamingGateway(BaseHTTPRequestHandler):
    """Serves /v1/rollouts/r1/stream from a script of connections, each a list of raw writes.

    A connection whose script is cut short by ``DROP`` closes the socket with bytes of
    the declared Content-Length still missing, as a crashed proxy would.
    """

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.server.seen_last_ids.append(self.headers.get("Last-Event-ID"))
        writes = self.server.connections.pop(0)
        dropped = writes[-1] is DROP
        payload = b"".join(w.encode() for w in writes if w is not DROP)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(payload) + (1000 if dropped else 0)))
        self.end_headers()
        for write in writes:
            if write is DROP:
                break
            self.wfile.write(write.encode())
            self.wfile.flush()
        self.close_connection = True

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.acks.append(body)
        data = json.dumps({"acked": len(body["episode_ids"])}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args):
        pass


DROP = object()


@pytest.fixture
def streaming_gateway():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StreamingGateway)
    server.connections, server.seen_last_ids, server.acks = [], [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_stream_over_a_real_socket_survives_drops(kind, streaming_gateway):
    streaming_gateway.connections += [
        # dropped mid-event: the declared length is never reached
        [": hello\n\n", episodes_event(1, 2), "event: episodes\nid: 3\nda", DROP],
        # closed cleanly but before the end event
        ["retry: 0\n\n", episodes_event(3)],
        [": heartbeat\n\n", episodes_event(4, 5), END],
    ]
    url = f"http://127.0.0.1:{streaming_gateway.server_address[1]}"
    sleeps: list[float] = []
    if kind == "sync":
        client = forkyard.Client(base_url=url, api_key="sk-real")
        client._sleep = sleeps.append
        with client, client.rollouts.stream("r1", consumer="c") as stream:
            batches = []
            for batch in stream:
                batch.ack()
                batches.append(batch.episode_ids)
    else:
        client = forkyard.AsyncClient(base_url=url, api_key="sk-real")

        async def no_sleep(seconds: float) -> None:
            sleeps.append(seconds)

        client._sleep = no_sleep
        async with client, client.rollouts.stream("r1", consumer="c") as stream:
            batches = []
            async for batch in stream:
                await batch.ack()
                batches.append(batch.episode_ids)
    assert batches == [["e1", "e2"], ["e3"], ["e4", "e5"]]
    assert streaming_gateway.seen_last_ids == [None, "2", "3"]
    assert [a["episode_ids"] for a in streaming_gateway.acks] == batches
    assert len(sleeps) == 2
