"""Policy clients: the server pool, error handling against real misbehaving HTTP servers, the scripted
policy, and the tokens/chat clients against a real vLLM server (tests with ``vllm`` in their name)."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from tests.policy.vllm_server import VLLMServer
from workers.envs.base import openai_tools
from workers.envs.terminal import FAMILY, ORACLE_DIR
from workers.envs.terminal.task import load_task_dir
from workers.policy import create_policy_client
from workers.policy.base import Generation, PolicyError, Sampling, parse_weight_version
from workers.policy.chat import ChatPolicy
from workers.policy.chat_template import ChatTokenizer
from workers.policy.router import ServerPool, normalize_base_url
from workers.policy.scripted import ScriptedPolicy, oracle_actions
from workers.policy.tokens import TokensPolicy
from workers.policy.toolcalls import parse_tool_calls

TOOLS = openai_tools(FAMILY.tools)

EXAMPLE_TASKS = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "terminal"
MESSAGES = [
    {"role": "system", "content": "You are an agent in a Linux terminal."},
    {"role": "user", "content": "Print the working directory."},
]

# --------------------------------------------------------------------------- ServerPool


def test_base_urls_are_normalized_and_checked():
    assert normalize_base_url("http://gpu-1:8000/") == "http://gpu-1:8000"
    assert normalize_base_url("https://inference.example/v1") == "https://inference.example"
    assert normalize_base_url("http://host:8000/prefix/v1/") == "http://host:8000/prefix"
    for bad in ("gpu-1:8000", "ftp://host", "http://", "http://host?x=1"):
        with pytest.raises(ValueError):
            normalize_base_url(bad)
    with pytest.raises(ValueError, match="distinct"):
        ServerPool(["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="at least one"):
        ServerPool([])


def test_pool_sends_new_episodes_to_the_least_loaded_server():
    pool = ServerPool(["http://a:1", "http://b:1", "http://c:1"])
    first = pool.acquire("e1")
    second = pool.acquire("e2")
    third = pool.acquire("e3")
    assert {first, second, third} == set(pool.servers)  # each idle server takes one
    pool.done(second)
    pool.done(third)
    # first is still busy: a new episode goes elsewhere, to the idle server with fewer pinned episodes.
    fourth = pool.acquire("e4")
    assert fourth != first and pool.in_flight(fourth) == 1
    pool.done(fourth)
    # Now second/third carry one pinned episode each, fourth two; the next one avoids fourth.
    assert pool.choose("e5") not in (first, fourth)


def test_pool_keeps_an_episode_on_its_server_until_released():
    pool = ServerPool(["http://a:1", "http://b:1"])
    home = pool.acquire("e1")
    for _ in range(3):  # the busiest server, yet every turn of e1 stays there
        assert pool.acquire("e1") == home
    assert pool.in_flight(home) == 4 and pool.pinned(home) == 1
    other = pool.acquire("e2")
    assert other != home
    for _ in range(4):
        pool.done(home)
    pool.release("e1")
    pool.release("e1")  # idempotent
    assert pool.affinity("e1") is None and pool.pinned(home) == 0
    assert pool.in_flight(home) == 0
    assert pool.choose("e3") == home  # idle and unpinned again


def test_pool_moves_episodes_off_a_server_that_is_down():
    pool = ServerPool(["http://a:1", "http://b:1"], down_cooldown_s=60)
    home = pool.choose("e1")
    other = next(s for s in pool.servers if s != home)
    pool.mark_down(home)
    assert pool.is_down(home)
    assert pool.choose("e1") == other and pool.affinity("e1") == other
    assert pool.pinned(home) == 0 and pool.pinned(other) == 1
    assert pool.choose("e2") == other  # new episodes avoid the down server too
    pool.mark_down(other)
    assert pool.choose("e1") == other  # everything down: stay put rather than fail here


def test_sampling_from_dict():
    # One definition (workers.protocol.SamplingSpec): a stored dict is read by the API's own rules.
    s = Sampling.from_dict({"temperature": 0.7, "top_p": 0.9, "max_tokens": 64, "stop": ["###"], "seed": 3})
    assert s == Sampling(temperature=0.7, top_p=0.9, max_tokens=64, stop=["###"], seed=3)
    assert Sampling.from_dict(None) == Sampling()
    for bad, where in (({"max_tokens": 0}, "max_tokens"), ({"top_p": 0}, "top_p"), ({"temperature": -1}, "temperature"),
                       ({"seed": "x"}, "seed"), ({"stop": [""]}, "stop.0"), ({"stop": "###"}, "stop"),
                       ({"x": 1}, "x")):
        with pytest.raises(PolicyError, match=rf"^policy\.sampling\.{where}: "):
            Sampling.from_dict(bad)


def test_weight_version_labels():
    assert [parse_weight_version(v) for v in (7, "7", "v12", " 3 ", "default", None, True, -1)] == [
        7, 7, 12, 3, None, None, None, None,
    ]


# --------------------------------------------------------------------------- a real misbehaving server


@dataclass
class FakeServer:
    """A real HTTP server on 127.0.0.1 whose path prefix picks a behaviour: ``{url}/{mode}``."""

    root: str
    hits: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bodies: dict[str, list[dict]] = field(default_factory=lambda: defaultdict(list))

    def url(self, mode: str) -> str:
        return f"{self.root}/{mode}"


def _tokens_answer(body: dict, *, version: str | None = "7") -> dict:
    n = min(3, body["sampling_params"]["max_tokens"])
    ids = [11, 12, 13][:n]
    return {
        "request_id": body.get("request_id"),
        "choices": [{
            "index": 0,
            "finish_reason": "length",
            "token_ids": ids,
            "text": "abc"[:n],
            "logprobs": {"content": [{"token_id": t, "logprob": -0.5 * (i + 1)} for i, t in enumerate(ids)]},
            "weight_versions": None if version is None else [{"version": version, "start": 0, "end": n}],
        }],
    }


def _chat_answer(body: dict) -> dict:
    return {
        "id": "chatcmpl-1",
        "model": body["model"],
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": "hello"},
            "finish_reason": "stop",
            "token_ids": [21, 22],
            "logprobs": {"content": [{"token": "hel", "logprob": -0.25}, {"token": "lo", "logprob": -1.0}]},
        }],
        "prompt_token_ids": [1, 2, 3],
    }


async def _generate_endpoint(request: Request) -> Response:
    mode = request.path_params["mode"]
    server: FakeServer = request.app.state.fake
    server.hits[mode] += 1
    raw = await request.body()
    body = json.loads(raw)
    server.bodies[mode].append(body)
    good = _tokens_answer(body)
    choice = good["choices"][0]
    if mode == "good":
        return JSONResponse(good)
    if mode == "nonjson":
        return PlainTextResponse("<html><body>upstream says hi</body></html>")
    if mode == "http500":
        return PlainTextResponse("Internal Server Error", status_code=500)
    if mode == "http400":
        return JSONResponse({"error": {"message": "max_tokens is too large", "type": "BadRequestError", "code": 400}},
                            status_code=400)
    if mode == "notobject":
        return JSONResponse([1, 2, 3])
    if mode == "nochoices":
        return JSONResponse({"request_id": "r"})
    if mode == "nologprobs":
        choice["logprobs"] = None
    elif mode == "shortlogprobs":
        choice["logprobs"]["content"].pop()
    elif mode == "wrongtoken":
        choice["logprobs"]["content"][1]["token_id"] = 999
    elif mode == "badids":
        choice["token_ids"] = [11, "12", 13]
    elif mode == "positivelogprob":
        choice["logprobs"]["content"][0]["logprob"] = 0.7
    elif mode == "badversions":
        choice["weight_versions"] = "7"
    elif mode == "abort":
        choice["finish_reason"] = "abort"
    elif mode == "flaky503" and server.hits[mode] == 1:
        return JSONResponse({"error": {"message": "engine is starting"}}, status_code=503)
    elif mode == "always503":
        return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
    elif mode == "slow":
        await asyncio.sleep(3)  # well past the client timeout; short so shutdown is quick
    elif mode == "mixedversions":
        choice["weight_versions"] = [{"version": "8", "start": 0, "end": 1}, {"version": "9", "start": 1, "end": 3}]
    elif mode == "defaultversion":
        choice["weight_versions"] = [{"version": "default", "start": 0, "end": 3}]
    return JSONResponse(good)


async def _chat_endpoint(request: Request) -> Response:
    mode = request.path_params["mode"]
    server: FakeServer = request.app.state.fake
    server.hits[mode] += 1
    body = json.loads(await request.body())
    server.bodies[mode].append(body)
    good = _chat_answer(body)
    choice = good["choices"][0]
    if mode == "noauto" and body.get("tool_choice") == "auto":
        message = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        return JSONResponse({"error": {"message": message, "type": "BadRequestError", "code": 400}}, status_code=400)
    if mode == "toolcalls":
        choice["message"] = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "pwd"}'}},
                {"id": "c2", "type": "function", "function": {"name": "submit", "arguments": "{}"}},
            ],
        }
        choice["finish_reason"] = "tool_calls"
    elif mode == "plainopenai":  # no token ids, no logprobs, no prompt ids
        del choice["token_ids"], good["prompt_token_ids"]
        choice["logprobs"] = None
    elif mode == "mismatch":
        choice["token_ids"] = [21, 22, 23]
    elif mode == "nomessage":
        del choice["message"]
    elif mode == "badcontent":
        choice["message"]["content"] = {"text": "hi"}
    return JSONResponse(good)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    port = _free_port()
    app = Starlette(routes=[
        Route("/{mode}/inference/v1/generate", _generate_endpoint, methods=["POST"]),
        Route("/{mode}/v1/chat/completions", _chat_endpoint, methods=["POST"]),
    ])
    fake = FakeServer(root=f"http://127.0.0.1:{port}")
    app.state.fake = fake
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="fake-policy-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the fake policy server did not start")
            time.sleep(0.05)
        yield fake
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _dead_url() -> str:
    return f"http://127.0.0.1:{_free_port()}"  # nothing listens there


SAMPLING = Sampling(temperature=0.8, top_p=0.95, max_tokens=3, stop=["</tool_call>"], seed=5)


async def _tokens(base_urls, **kwargs) -> Generation:
    policy = TokensPolicy(base_urls, model="m", max_attempts=kwargs.pop("max_attempts", 3), **kwargs)
    try:
        return await policy.generate(episode_id="ep", prompt_ids=[1, 2, 3], messages=[], tools=[], sampling=SAMPLING)
    finally:
        await policy.aclose()


async def test_tokens_client_request_and_answer(fake_server):
    gen = await _tokens([fake_server.url("good")])
    body = fake_server.bodies["good"][-1]
    assert body["token_ids"] == [1, 2, 3]
    assert body["model"] == "m"
    assert body["output_mode"] == "text"  # no local tokenizer: the server decodes
    params = body["sampling_params"]
    assert params["logprobs"] == 0 and params["max_tokens"] == 3 and params["seed"] == SAMPLING.seed_for("ep", [])
    assert params["temperature"] == 0.8 and params["top_p"] == 0.95 and params["stop"] == ["</tool_call>"]
    assert params["include_stop_str_in_output"] is True
    expected = _tokens_answer(body)["choices"][0]
    assert gen.token_ids == expected["token_ids"]
    assert gen.logprobs == [c["logprob"] for c in expected["logprobs"]["content"]]
    assert gen.text == expected["text"]
    assert gen.prompt_token_ids == [1, 2, 3]
    assert gen.finish_reason == "length"
    assert gen.weight_version == 7
    assert gen.server == fake_server.url("good")


async def test_tokens_client_decodes_ids_with_a_local_tokenizer(fake_server, tiny_models):
    tok = ChatTokenizer(tiny_models.primary)
    gen = await _tokens([fake_server.url("good")], tokenizer=tok)
    body = fake_server.bodies["good"][-1]
    assert body["output_mode"] == "tokens"
    assert gen.text == tok.decode(gen.token_ids, skip_special_tokens=True)


async def test_weight_version_spans(fake_server):
    assert (await _tokens([fake_server.url("mixedversions")])).weight_version == 8  # the oldest
    assert (await _tokens([fake_server.url("defaultversion")])).weight_version is None


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("nonjson", "non-JSON body"),
        ("http500", "HTTP 500"),
        ("http400", "HTTP 400"),
        ("notobject", "instead of a JSON object"),
        ("nochoices", "'choices'"),
        ("nologprobs", "no per-token logprobs"),
        ("shortlogprobs", "2 logprobs for 3 sampled tokens"),
        ("wrongtoken", "logprob for token 999"),
        ("badids", "not a list of token ids"),
        ("positivelogprob", "not a log probability"),
        ("badversions", "weight_versions"),
        ("abort", "aborted"),
    ],
)
async def test_tokens_client_rejects_garbage(fake_server, mode, expected):
    with pytest.raises(PolicyError) as info:
        await _tokens([fake_server.url(mode)])
    message = str(info.value)
    assert expected in message
    assert fake_server.url(mode) in message  # names the server
    assert info.value.server == fake_server.url(mode)
    # The server's own words stay in the gateway's log: a reason reaches API clients, and
    # base_urls are theirs to choose (no reading arbitrary URLs through dead-letter reasons).
    assert "max_tokens is too large" not in message
    assert fake_server.hits[mode] >= 1


async def test_unreachable_server_fails_with_its_name(fake_server):
    dead = _dead_url()
    with pytest.raises(PolicyError) as info:
        await _tokens([dead], max_attempts=2)
    assert dead in str(info.value) and "unreachable" in str(info.value) and "2 tries" in str(info.value)


async def test_an_unreachable_server_is_skipped_for_a_live_one(fake_server):
    dead, good = _dead_url(), fake_server.url("good")
    policy = TokensPolicy([dead, good], max_attempts=3)
    try:
        for episode in ("e1", "e2", "e3"):
            gen = await policy.generate(
                episode_id=episode, prompt_ids=[4, 5], messages=[], tools=[], sampling=SAMPLING
            )
            assert gen.server == good
            assert policy.pool.affinity(episode) == good
        policy.release("e1")
        assert policy.pool.affinity("e1") is None
    finally:
        await policy.aclose()


async def test_503_is_retried_then_succeeds(fake_server):
    gen = await _tokens([fake_server.url("flaky503")])
    assert fake_server.hits["flaky503"] == 2
    assert gen.token_ids


async def test_503_retries_are_bounded(fake_server):
    with pytest.raises(PolicyError, match="HTTP 503.*gave up after 3 tries") as info:
        await _tokens([fake_server.url("always503")], max_attempts=3)
    assert "overloaded" not in str(info.value) and "overloaded" in (info.value.detail or "")
    assert fake_server.hits["always503"] == 3


async def test_a_hung_server_times_out(fake_server):
    with pytest.raises(PolicyError, match="did not answer"):
        await _tokens([fake_server.url("slow")], timeout_s=0.5)
    assert fake_server.hits["slow"] == 1  # a timeout is not retried


async def test_tokens_client_needs_prompt_ids(fake_server):
    policy = TokensPolicy([fake_server.url("good")])
    try:
        with pytest.raises(PolicyError, match="prompt token ids"):
            await policy.generate(episode_id="e", prompt_ids=None, messages=MESSAGES, tools=[], sampling=SAMPLING)
    finally:
        await policy.aclose()
    with pytest.raises(PolicyError, match="closed"):
        await policy.generate(episode_id="e", prompt_ids=[1], messages=[], tools=[], sampling=SAMPLING)


async def _chat(mode: str, fake: FakeServer, *, tools=TOOLS, policy: ChatPolicy | None = None) -> Generation:
    own = policy is None
    policy = policy or ChatPolicy([fake.url(mode)], model="served")
    try:
        return await policy.generate(episode_id="ep", prompt_ids=None, messages=MESSAGES, tools=tools,
                                     sampling=SAMPLING)
    finally:
        if own:
            await policy.aclose()


async def test_chat_client_request_and_answer(fake_server):
    gen = await _chat("good", fake_server)
    body = fake_server.bodies["good"][-1]
    assert body["model"] == "served" and body["messages"] == MESSAGES and body["tools"] == TOOLS
    assert body["logprobs"] is True and body["return_token_ids"] is True and body["tool_choice"] == "auto"
    assert body["max_tokens"] == 3 and body["seed"] == SAMPLING.seed_for("ep", MESSAGES)
    assert body["stop"] == ["</tool_call>"]
    assert gen.text == "hello"
    assert gen.token_ids == [21, 22] and gen.logprobs == [-0.25, -1.0]
    assert gen.prompt_token_ids == [1, 2, 3]
    assert gen.weight_version is None and gen.finish_reason == "stop"


async def test_chat_client_writes_server_parsed_tool_calls_back_as_text(fake_server):
    gen = await _chat("toolcalls", fake_server)
    assert gen.finish_reason == "tool_calls"
    assert parse_tool_calls(gen.text) == [
        {"name": "bash", "arguments": {"command": "pwd"}},
        {"name": "submit", "arguments": {}},
    ]


async def test_chat_client_falls_back_to_tool_choice_none(fake_server):
    policy = ChatPolicy([fake_server.url("noauto")], model="served")
    try:
        first = await _chat("noauto", fake_server, policy=policy)
        await _chat("noauto", fake_server, policy=policy)
    finally:
        await policy.aclose()
    assert first.text == "hello"
    assert [b["tool_choice"] for b in fake_server.bodies["noauto"]] == ["auto", "none", "none"]


async def test_chat_client_without_token_ids(fake_server):
    gen = await _chat("plainopenai", fake_server, tools=[])
    assert "tools" not in fake_server.bodies["plainopenai"][-1]
    assert gen.text == "hello" and gen.token_ids is None and gen.logprobs is None and gen.prompt_token_ids is None


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("mismatch", "2 logprobs for 3 sampled tokens"), ("nomessage", "message"), ("badcontent", "not a string")],
)
async def test_chat_client_rejects_garbage(fake_server, mode, expected):
    with pytest.raises(PolicyError) as info:
        await _chat(mode, fake_server)
    assert expected in str(info.value) and fake_server.url(mode) in str(info.value)


# --------------------------------------------------------------------------- create_policy_client


async def test_create_policy_client(fake_server, tiny_models):
    chat = create_policy_client({"name": "test", "api": "chat", "base_urls": [fake_server.url("good")], "model": "served"})
    tokens = create_policy_client(
        {"name": "test", "api": "tokens", "base_urls": [fake_server.url("good")], "model": "m", "tokenizer": str(tiny_models.primary)}
    )
    try:
        assert isinstance(chat, ChatPolicy) and chat.api == "chat"
        assert isinstance(tokens, TokensPolicy) and tokens.api == "tokens"
        assert tokens.tokenizer is not None and tokens.tokenizer.name == str(tiny_models.primary)
    finally:
        await chat.aclose()
        await tokens.aclose()
    for spec, expected in [
        ({"name": "test", "api": "grpc", "base_urls": ["http://a:1"]}, r"policy\.api: Input should be 'tokens', 'chat' or 'scripted'"),
        ({"name": "test", "api": "chat", "base_urls": []}, "base_urls"),
        ({"name": "test", "api": "chat", "base_urls": ["http://a:1"]}, "model"),
        ({"name": "test", "api": "chat", "base_urls": ["not a url"], "model": "m"}, r"policy\.base_urls\.0: .*valid URL"),
        ({"name": "test", "api": "tokens", "base_urls": ["http://a:1"]}, "model is required for the tokens api"),
        ({"name": "test", "api": "tokens", "base_urls": ["http://a:1"], "model": "m", "tokenizer": "/nonexistent/tok"},
         "/nonexistent/tok"),
        ({"name": "test", "api": "scripted"}, "actions or a task"),
        ({"name": "test", "api": "scripted", "actions": [{"arguments": {}}]}, "tool"),
    ]:
        with pytest.raises(PolicyError, match=expected):
            create_policy_client(spec)


# --------------------------------------------------------------------------- scripted


def _example_tasks() -> list[Path]:
    return sorted(p for p in EXAMPLE_TASKS.iterdir() if (p / "solution" / "solve.sh").is_file())


@pytest.mark.parametrize("task_dir", _example_tasks(), ids=lambda p: p.name)
async def test_scripted_oracle_replays_the_solution(task_dir):
    task = load_task_dir(task_dir)
    solve = (task_dir / "solution" / "solve.sh").read_text()
    policy = create_policy_client({"name": "test", "api": "scripted"}, task=task)
    assert policy.api == "scripted"

    async def turn(episode: str, done: int) -> list[dict]:
        history = MESSAGES + [{"role": "assistant", "content": "..."}] * done
        gen = await policy.generate(episode_id=episode, prompt_ids=None, messages=history, tools=TOOLS,
                                    sampling=Sampling())
        assert gen.server == "scripted" and gen.token_ids is None
        return parse_tool_calls(gen.text)

    (call,) = await turn("a", 0)
    assert call["name"] == "bash" and call["arguments"]["timeout"] == task.agent_timeout_s
    assert call["arguments"]["command"].endswith(f"bash {ORACLE_DIR}/solve.sh < /dev/null")
    assert max(solve.splitlines(), key=len) not in call["arguments"]["command"]  # packed, not inlined as text
    assert await turn("b", 0) == await turn("c", 0) != []  # the turn, not the episode, picks the action
    assert await turn("a", 1) == [{"name": "submit", "arguments": {}}]
    with pytest.raises(PolicyError, match="no action left"):
        await turn("a", 2)
    await policy.aclose()


async def test_scripted_one_of_picks_reproducibly_per_episode_and_turn():
    choices = [{"tool": "bash", "arguments": {"command": f"echo {i}"}} for i in range(4)]
    policy = ScriptedPolicy([{"one_of": choices}, {"tool": "submit"}])

    async def first(episode: str, seed: int | None) -> str:
        gen = await policy.generate(episode_id=episode, prompt_ids=None, messages=MESSAGES, tools=TOOLS,
                                    sampling=Sampling(seed=seed))
        return parse_tool_calls(gen.text)[0]["arguments"]["command"]

    picks = [await first(f"ep{i}", 7) for i in range(40)]
    assert picks == [await first(f"ep{i}", 7) for i in range(40)]  # same episode, seed, turn: same pick
    assert set(picks) == {f"echo {i}" for i in range(4)}  # and the episodes diverge
    with pytest.raises(PolicyError, match="one_of"):
        ScriptedPolicy([{"one_of": []}])
    with pytest.raises(PolicyError, match=r"0\.one_of\[1\]"):
        ScriptedPolicy([{"one_of": [{"tool": "bash"}, {"arguments": {}}]}])


def test_each_call_gets_its_own_seed_derived_from_the_rollout_seed():
    """One seed on every call would make the samples of a group (and the branches of a tree) identical."""
    seeded = Sampling(seed=5)
    turn1 = [*MESSAGES, {"role": "assistant", "content": "x"}]
    seeds = {seeded.seed_for(ep, msgs) for ep in ("a", "b") for msgs in (MESSAGES, turn1)}
    assert len(seeds) == 4 and all(0 <= s < 2**31 for s in seeds)
    assert seeded.seed_for("a", turn1) == Sampling(seed=5).seed_for("a", turn1)  # reproducible
    assert seeded.seed_for("a", MESSAGES) != Sampling(seed=6).seed_for("a", MESSAGES)
    assert Sampling().seed_for("a", MESSAGES) is None


def test_oracle_command_unpacks_exactly_the_solution_files(tmp_path):
    """The packed solution is the task's solution/ byte for byte, with solve.sh executable."""
    import base64
    import io
    import re
    import tarfile

    task_dir = tmp_path / "packed"
    shutil.copytree(_example_tasks()[0], task_dir)
    (task_dir / "solution" / "data.bin").write_bytes(bytes(range(256)) * 3)
    task = load_task_dir(task_dir)
    bash_call, submit = oracle_actions(task)
    assert submit == {"tool": "submit", "arguments": {}}
    (packed,) = re.findall(r"printf %s '([A-Za-z0-9+/=]+)'", bash_call["arguments"]["command"])
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(packed)), mode="r:gz") as tar:
        members = {m.name: (m.mode, tar.extractfile(m).read()) for m in tar.getmembers()}
    assert {name: data for name, (_, data) in members.items()} == dict(task.solution_files)
    assert members["solve.sh"][0] == 0o755 and members["data.bin"][0] == 0o644


async def test_scripted_actions_in_json_format_with_token_ids(tiny_models):
    tok = ChatTokenizer(tiny_models.primary)
    actions = [{"tool": "bash", "arguments": {"command": "ls"}}, {"tool": "submit"}]
    policy = create_policy_client({"name": "test", "api": "scripted", "actions": actions}, tool_call_format="json", tokenizer=tok)
    texts = []
    for _ in actions:
        history = MESSAGES + [{"role": "assistant", "content": t} for t in texts]
        gen = await policy.generate(episode_id="e", prompt_ids=[1, 2], messages=history, tools=TOOLS,
                                    sampling=Sampling())
        assert gen.token_ids[-1] == tok.end_of_turn_id
        assert tok.decode(gen.token_ids[:-1]) == gen.text
        assert gen.logprobs == [0.0] * len(gen.token_ids)
        texts.append(gen.text)
    assert [parse_tool_calls(t, "json") for t in texts] == [
        [{"name": "bash", "arguments": {"command": "ls"}}],
        [{"name": "submit", "arguments": {}}],
    ]
    with pytest.raises(PolicyError):
        ScriptedPolicy([])


# --------------------------------------------------------------------------- against a real vLLM server


def _vllm_weight_version(server: VLLMServer) -> str:
    response = httpx.get(f"{server.base_url}/weight_info", headers=server.headers, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["weight_version"]


def _set_vllm_weight_version(server: VLLMServer, version: str) -> None:
    response = httpx.post(f"{server.base_url}/update_weight_version", json={"new_version": version},
                          headers=server.headers, timeout=30)
    assert response.status_code == 200, response.text


def _check_sampled(gen: Generation, tok: ChatTokenizer, *, max_tokens: int) -> None:
    assert gen.token_ids and gen.logprobs is not None
    assert len(gen.token_ids) == len(gen.logprobs) <= max_tokens
    assert all(math.isfinite(lp) and lp <= 0 for lp in gen.logprobs)
    assert gen.finish_reason in ("stop", "length", "tool_calls")
    assert (gen.finish_reason == "length") == (len(gen.token_ids) == max_tokens and not tok.ends_turn(gen.token_ids))


async def test_tokens_policy_against_vllm(vllm_server, tiny_models):
    tok = ChatTokenizer(tiny_models.primary)
    policy = TokensPolicy([vllm_server.base_url], model=vllm_server.model, tokenizer=tok, api_key=vllm_server.api_key)
    sampling = Sampling(temperature=1.0, max_tokens=24, seed=7)
    try:
        prompt = tok.initial_prompt_ids(MESSAGES, TOOLS)
        gen = await policy.generate(episode_id="v1", prompt_ids=prompt, messages=MESSAGES, tools=TOOLS,
                                    sampling=sampling)
        _check_sampled(gen, tok, max_tokens=24)
        assert gen.text == tok.decode(gen.token_ids, skip_special_tokens=True)
        assert gen.prompt_token_ids == prompt
        assert gen.server == vllm_server.base_url
        assert gen.weight_version == parse_weight_version(_vllm_weight_version(vllm_server))

        # Second turn: the episode's ids grow by appending; the server takes the longer prompt.
        history = [*MESSAGES, {"role": "assistant", "content": gen.text}]
        observation = [{"role": "tool", "content": "/app\n[exit code: 0]"}]
        context = prompt + gen.token_ids + tok.observation_ids(
            history, observation, TOOLS, completion_ended=tok.ends_turn(gen.token_ids)
        )
        again = await policy.generate(episode_id="v1", prompt_ids=context, messages=[], tools=TOOLS,
                                      sampling=sampling)
        _check_sampled(again, tok, max_tokens=24)
        assert tok.decode(context).startswith(tok.decode(prompt + gen.token_ids))
    finally:
        await policy.aclose()


async def test_tokens_policy_text_mode_against_vllm(vllm_server, tiny_models):
    """Without a local tokenizer the server decodes; same call seed and prompt, same ids as with one."""
    tok = ChatTokenizer(tiny_models.primary)
    prompt = tok.initial_prompt_ids(MESSAGES, TOOLS)
    sampling = Sampling(temperature=1.0, max_tokens=16, seed=11)
    with_tok = TokensPolicy([vllm_server.base_url], model=vllm_server.model, tokenizer=tok, api_key=vllm_server.api_key)
    server_text = TokensPolicy([vllm_server.base_url], model=vllm_server.model, api_key=vllm_server.api_key)
    try:
        a = await with_tok.generate(episode_id="t1", prompt_ids=prompt, messages=[], tools=[], sampling=sampling)
        b = await server_text.generate(episode_id="t1", prompt_ids=prompt, messages=[], tools=[], sampling=sampling)
    finally:
        await with_tok.aclose()
        await server_text.aclose()
    _check_sampled(b, tok, max_tokens=16)
    assert b.token_ids == a.token_ids
    assert b.text == a.text == tok.decode(a.token_ids, skip_special_tokens=True)


async def test_tokens_policy_reports_the_vllm_weight_version(vllm_server, tiny_models):
    tok = ChatTokenizer(tiny_models.primary)
    policy = TokensPolicy([vllm_server.base_url], model=vllm_server.model, tokenizer=tok, api_key=vllm_server.api_key)
    before = _vllm_weight_version(vllm_server)
    new = (parse_weight_version(before) or 0) + 41
    try:
        _set_vllm_weight_version(vllm_server, str(new))
        gen = await policy.generate(episode_id="w", prompt_ids=tok.initial_prompt_ids(MESSAGES, TOOLS),
                                    messages=[], tools=[], sampling=Sampling(max_tokens=4, seed=1))
        assert gen.weight_version == new
    finally:
        _set_vllm_weight_version(vllm_server, before)
        await policy.aclose()


async def test_chat_policy_against_vllm(vllm_server, tiny_models):
    tok = ChatTokenizer(tiny_models.primary)
    policy = ChatPolicy([vllm_server.base_url], model=vllm_server.model, api_key=vllm_server.api_key)
    try:
        gen = await policy.generate(episode_id="c1", prompt_ids=None, messages=MESSAGES, tools=TOOLS,
                                    sampling=Sampling(temperature=1.0, max_tokens=24, seed=3))
    finally:
        await policy.aclose()
    _check_sampled(gen, tok, max_tokens=24)
    # The server rendered the same prompt the tokens api would start from.
    assert gen.prompt_token_ids == tok.initial_prompt_ids(MESSAGES, TOOLS)
    decoded = tok.decode(gen.token_ids, skip_special_tokens=True)
    if gen.finish_reason == "tool_calls":  # the server's hermes parser took the calls out; they come back as text
        assert "<tool_call>" in decoded and parse_tool_calls(gen.text)
    else:
        # A sample cut by max_tokens can end inside a UTF-8 character: the server holds those bytes back.
        assert gen.text == decoded or (gen.finish_reason == "length" and decoded.rstrip("\ufffd") == gen.text)
