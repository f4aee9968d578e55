"""A managed rollout against a real vLLM server: token-exact episodes and weight versions.

A recording proxy sits between the gateway and vLLM so the test knows exactly what the
server returned for every turn; the episodes the gateway streams must carry those token
ids and logprobs verbatim.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import forkyard
from tests.live import ROOT, free_port, run_gateway
from tests.policy.test_vllm_server import reload_weights, weight_version
from workers.policy.chat_template import ChatTokenizer

TASKS_DIR = ROOT / "examples" / "tasks" / "terminal"


class RecordingProxy:
    """Forward /inference/v1/generate to vLLM and keep every (request, response) pair."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.calls: list[tuple[dict, dict]] = []
        self._client = httpx.AsyncClient(base_url=upstream, timeout=120)
        app = Starlette(routes=[Route("/{path:path}", self.forward, methods=["GET", "POST"])])
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        upstream = await self._client.request(
            request.method, "/" + request.path_params["path"], content=body,
            headers={"content-type": request.headers.get("content-type", "application/json"),
                     **({"authorization": request.headers["authorization"]}
                        if "authorization" in request.headers else {})},
        )
        if request.url.path == "/inference/v1/generate" and upstream.status_code == 200:
            self.calls.append((await request.json(), upstream.json()))
            return JSONResponse(upstream.json())
        return Response(upstream.content, status_code=upstream.status_code, media_type="application/json")

    def __enter__(self) -> RecordingProxy:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def stack(vllm_server, tmp_path_factory) -> Iterator[tuple[forkyard.Client, RecordingProxy, Path]]:
    data_dir = tmp_path_factory.mktemp("gw-vllm")
    with RecordingProxy(vllm_server.base_url) as proxy, \
            run_gateway("local", data_dir, node=f"vllm-{uuid.uuid4().hex[:6]}") as gw, \
            forkyard.Client(base_url=gw.url, api_key=gw.api_key, timeout=300) as client:
        yield client, proxy, data_dir


def policy_spec(proxy: RecordingProxy, vllm_server, tiny_models, name: str) -> dict:
    return {
        "name": name, "api": "tokens", "base_urls": [proxy.url], "model": vllm_server.model,
        "tokenizer": str(tiny_models.primary), "api_key": vllm_server.api_key,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 24, "seed": 0},
    }


def consume(client: forkyard.Client, rollout_id: str) -> list:
    episodes = []
    for batch in client.rollouts.stream(rollout_id, consumer="trainer", batch_size=8):
        episodes.extend(batch)
        batch.ack()
    return episodes


def test_rollout_is_token_exact_against_vllm(stack, vllm_server, tiny_models):
    client, proxy, _ = stack
    tasks = client.tasks.import_dir(TASKS_DIR)
    rollout = client.rollouts.create(
        tasks={"ids": [t.id for t in tasks]}, group_size=4,
        policy=policy_spec(proxy, vllm_server, tiny_models, "tiny"),
        agent={"max_turns": 2}, limits={"episode_timeout_s": 300, "step_timeout_s": 120}, concurrency=8,
    )
    episodes = consume(client, rollout.id)
    assert len(episodes) == len(tasks) * 4
    assert client.rollouts.get(rollout.id).status == "completed"

    tokenizer = ChatTokenizer(tiny_models.primary)
    def replies_of(episode_id: str) -> list[dict]:
        # Request ids are "<episode id>-<n>"; the proxy saw them in call order.
        return [resp["choices"][0] for req, resp in proxy.calls if req["request_id"].startswith(episode_id + "-")]

    for ep in episodes:
        assert sum(ep.loss_mask) == len(ep.logprobs) > 0
        assert len(ep.input_ids) == len(ep.loss_mask)
        assert ep.weight_versions and set(ep.weight_versions) == {0}
        detail = client.episodes.get(ep.episode_id, tokens=True)
        sampled = []
        replies = replies_of(ep.episode_id)
        assert len(replies) == len(detail.steps)
        for step, reply in zip(detail.steps, replies):
            assert step.completion_ids == reply["token_ids"]
            assert step.logprobs == [c["logprob"] for c in reply["logprobs"]["content"]]
            assert tokenizer.decode(step.completion_ids, skip_special_tokens=True) == step.text
            sampled += step.completion_ids
        # loss_mask marks exactly the sampled tokens, in order.
        assert [t for t, m in zip(ep.input_ids, ep.loss_mask) if m] == sampled
        # The whole sequence decodes to the conversation: prompt, instruction, and every observation that
        # was fed back to the policy. The last step's observation never is: the episode ended after it.
        text = tokenizer.decode(ep.input_ids)
        assert detail.messages[1]["content"] in text
        for step in detail.steps[:-1]:
            assert step.observation in text


def test_a_swe_rollout_is_token_exact_against_vllm(stack, vllm_server, tiny_models):
    """The tiny model will not fix a bug (rewards 0), but every SWE episode completes token-exact, graded."""
    from workers.envs.swe.repos import RepoStore

    client, proxy, data_dir = stack
    examples = ROOT / "examples" / "swe"
    store = RepoStore(data_dir / "repos")  # the gateway's default store
    for name in ("calc", "textkit"):
        store.add(examples / "repos" / name, name=f"forkyard/{name}")
    tasks = client.tasks.import_jsonl(examples / "instances.jsonl")
    chosen = [tasks[0], tasks[-1]]
    rollout = client.rollouts.create(
        tasks={"ids": [t.id for t in chosen]}, group_size=2,
        policy=policy_spec(proxy, vllm_server, tiny_models, "tiny-swe"),
        agent={"max_turns": 2}, limits={"episode_timeout_s": 300, "step_timeout_s": 120}, concurrency=4,
    )
    episodes = consume(client, rollout.id)
    assert len(episodes) == 4 and {e.reward for e in episodes} == {0.0}
    sent = {req["request_id"].rsplit("-", 1)[0] for req, _ in proxy.calls}
    for ep in episodes:
        assert ep.episode_id in sent
        assert sum(ep.loss_mask) == len(ep.logprobs) > 0 and len(ep.input_ids) == len(ep.loss_mask)
        detail = client.episodes.get(ep.episode_id, tokens=True)
        assert "str_replace_editor" in ChatTokenizer(tiny_models.primary).decode(ep.input_ids)  # the family's tools
        assert detail.status in ("completed", "truncated") and detail.info["grading"]["FAIL_TO_PASS"]["failure"]
        replies = [resp["choices"][0] for req, resp in proxy.calls if req["request_id"].startswith(ep.episode_id + "-")]
        assert [s.completion_ids for s in detail.steps] == [r["token_ids"] for r in replies]


def test_weight_reload_and_announce_stamp_later_turns(stack, vllm_server, tiny_models):
    client, proxy, _ = stack
    task = next(iter(client.tasks.list(name="edit-config")))
    http = httpx.Client(base_url=vllm_server.base_url, headers=vllm_server.headers, timeout=60)
    original = weight_version(http)
    try:
        reload_weights(http, str(tiny_models.second), "1")
        client.policies.set_version("tiny-reload", 1)
        rollout = client.rollouts.create(
            tasks={"ids": [task.id]}, group_size=2, policy=policy_spec(proxy, vllm_server, tiny_models, "tiny-reload"),
            agent={"max_turns": 2},
        )
        episodes = consume(client, rollout.id)
    finally:
        reload_weights(http, str(tiny_models.primary), original)
        http.close()
    assert len(episodes) == 2
    for ep in episodes:
        assert set(ep.weight_versions) == {1}
        assert all(s.weight_version == 1 for s in client.episodes.get(ep.episode_id).steps)


def task_named(client: forkyard.Client, name: str):
    (task,) = client.tasks.import_dir(TASKS_DIR / name)  # importing the same content again returns the task
    return task


def check_leaf_is_token_exact(client: forkyard.Client, proxy: RecordingProxy, leaf) -> None:
    """Every policy call on the leaf's path saw exactly the leaf's tokens so far and returned its sampled ones."""
    detail = client.episodes.get(leaf.episode_id, tokens=True)
    calls = {req["request_id"]: (req, resp["choices"][0]) for req, resp in proxy.calls}
    by_owner: dict[str, list] = {}
    for req_id, call in calls.items():
        by_owner.setdefault(req_id.rsplit("-", 1)[0], []).append((int(req_id.rsplit("-", 1)[1]), call))
    offset, sampled = 0, []
    for step in detail.steps:
        owner_calls = [c for _, c in sorted(by_owner[step.episode_id], key=lambda x: x[0])]
        own_steps = [s for s in detail.steps if s.episode_id == step.episode_id]
        request, reply = owner_calls[own_steps.index(step)]
        offset += len(step.prompt_ids)
        assert request["token_ids"] == leaf.input_ids[:offset]  # the context sent is the leaf's prefix
        assert step.completion_ids == reply["token_ids"]
        assert step.logprobs == [c["logprob"] for c in reply["logprobs"]["content"]]
        assert leaf.input_ids[offset:offset + len(step.completion_ids)] == step.completion_ids
        offset += len(step.completion_ids)
        sampled += step.completion_ids
    assert offset == len(leaf.input_ids)
    assert [t for t, m in zip(leaf.input_ids, leaf.loss_mask) if m] == sampled
    assert sum(leaf.loss_mask) == len(leaf.logprobs)


def test_branching_tree_is_token_exact_and_runs_the_prefix_once(stack, vllm_server, tiny_models):
    client, proxy, _ = stack
    task = task_named(client, "word-frequency")
    calls_before = len(proxy.calls)
    rollout = client.rollouts.create(
        tasks=[task.id], group_size=1, policy=policy_spec(proxy, vllm_server, tiny_models, "tiny-tree"),
        agent={"max_turns": 3}, branching={"at_turns": [1], "fanout": 3},
    )
    leaves = consume(client, rollout.id)
    assert len(leaves) == 3 and len({ep.group_id for ep in leaves}) == 1
    tree = client.episodes.tree(leaves[0].episode_id)
    root = tree.root_episode_id
    # root + the trunk's 3 turns + 2 branches x 2 turns; the fork follows turn 0.
    assert len(tree.nodes) == 1 + 3 + 2 * 2
    assert tree.branch_points == [{"node": f"{root}:0", "children": 3}]
    # The shared turn ran once: 7 policy calls and 7 stored steps, not 3 x 3.
    assert len(proxy.calls) - calls_before == 7
    assert sum(e.num_turns for e in client.episodes.list(rollout_id=rollout.id)) == 7
    for leaf in leaves:
        check_leaf_is_token_exact(client, proxy, leaf)
    # Every leaf marks the same shared prefix: turn 0 and the prompt of turn 1, identical tokens in each.
    shared = {ep.shared_prefix_len for ep in leaves}
    assert len(shared) == 1
    (n,) = shared
    assert n > 0 and len({tuple(ep.input_ids[:n]) for ep in leaves}) == 1
    steps = client.episodes.get(leaves[0].episode_id, tokens=True).steps
    assert n == len(steps[0].prompt_ids) + len(steps[0].completion_ids) + len(steps[1].prompt_ids)
    # Past it each branch sampled on its own (their first tokens may still agree: the tiny model is peaked).
    assert len({tuple(ep.input_ids[n:]) for ep in leaves}) > 1


def test_adaptive_branching_spends_its_budget_where_the_policy_is_uncertain(stack, vllm_server, tiny_models):
    client, proxy, _ = stack
    task = task_named(client, "word-frequency")
    spec = policy_spec(proxy, vllm_server, tiny_models, "tiny-adaptive")
    certain = client.rollouts.create(tasks=[task.id], group_size=1, policy=spec, agent={"max_turns": 2},
                                     branching={"adaptive": {"budget": 3, "min_entropy": 99.0}})
    assert len(consume(client, certain.id)) == 1  # a random tiny model is never that uncertain
    rollout = client.rollouts.create(tasks=[task.id], group_size=1, policy=spec, agent={"max_turns": 2},
                                     branching={"adaptive": {"budget": 3, "min_entropy": 0.0, "fanout": 3}})
    leaves = consume(client, rollout.id)
    assert len(leaves) == 4  # 1 + budget
    episodes = {e.id: e for e in client.episodes.list(rollout_id=rollout.id)}
    root = next(e for e in episodes.values() if e.parent_episode_id is None)
    points = client.episodes.get(root.id).info["tree"]["branch_points"]
    assert points and all(p["reason"] == "adaptive" for p in points)
    # fanout 3: the first branch point re-samples its turn twice; the budget caps the rest.
    assert len(points[0]["branches"]) == 2 and sum(len(p["branches"]) for p in points) == 3
    for point in points:
        # The recorded uncertainty is the mean negative logprob of the turn the branches re-sampled.
        parent = client.episodes.get(point["episode_id"], tokens=True)
        step = next(s for s in parent.steps if s.index == point["turn"])
        assert point["uncertainty"] == pytest.approx(-sum(step.logprobs) / len(step.logprobs))
        for branch_id in point["branches"]:
            assert episodes[branch_id].branch_turn == point["turn"]
    for leaf in leaves:
        check_leaf_is_token_exact(client, proxy, leaf)


def test_a_web_rollout_is_token_exact_with_screenshots_as_artifacts(stack, vllm_server, tiny_models):
    """Web episodes in real Chromium: the tokens are the server's, the screenshots are artifacts, not tokens."""
    client, proxy, _ = stack
    (task,) = client.tasks.import_dir(ROOT / "examples" / "tasks" / "web" / "fill-form", environment="web")
    rollout = client.rollouts.create(
        tasks={"ids": [task.id]}, group_size=2, policy=policy_spec(proxy, vllm_server, tiny_models, "tiny-web"),
        agent={"max_turns": 2}, limits={"episode_timeout_s": 300, "step_timeout_s": 120}, concurrency=2,
    )
    episodes = consume(client, rollout.id)
    assert len(episodes) == 2
    tokenizer = ChatTokenizer(tiny_models.primary)
    for ep in episodes:
        detail = client.episodes.get(ep.episode_id, tokens=True)
        assert detail.status in ("completed", "truncated"), detail.error
        replies = [resp["choices"][0] for req, resp in proxy.calls if req["request_id"].startswith(ep.episode_id + "-")]
        assert [s.completion_ids for s in detail.steps] == [r["token_ids"] for r in replies]
        assert sum(ep.loss_mask) == len(ep.logprobs) > 0 and len(ep.input_ids) == len(ep.loss_mask)
        text = tokenizer.decode(ep.input_ids)
        assert "Accessibility tree:" in text and "[name] textbox" in text  # the page, as the policy saw it
        links = detail.info["artifacts"] + [a for s in detail.steps for a in s.artifacts]
        assert links and all(a["media_type"] == "image/png" for a in links)
        for link in links:
            png = client.artifacts.get(link["id"])
            assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) == link["bytes"]
            assert link["id"] not in text and "iVBOR" not in text  # never in the token stream
