"""A rollout against a real vLLM that requires an API key (``vllm serve --api-key``).

The key travels in the policy spec and is kept as a secret: the rollout completes with
it, fails clearly with a wrong one, and no response or gateway log line shows it.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator

import httpx
import pytest

import forkyard
from tests.live import ROOT, run_gateway
from tests.policy.conftest import serve_tiny_model
from tests.policy.vllm_server import VLLMServer

TASKS_DIR = ROOT / "examples" / "tasks" / "terminal"
KEY = "sk-test-" + secrets.token_hex(16)


@pytest.fixture(scope="module")
def keyed_vllm(tiny_models, tmp_path_factory) -> Iterator[VLLMServer]:
    """A vLLM server of its own, started with ``--api-key``."""
    yield from serve_tiny_model(tiny_models, tmp_path_factory, "vllm-key", ("--api-key", KEY))


def test_rollout_reaches_a_vllm_behind_an_api_key(keyed_vllm, tiny_models, tmp_path):
    body = {"model": keyed_vllm.model, "prompt": "hi", "max_tokens": 1}
    assert httpx.post(keyed_vllm.base_url + "/v1/completions", json=body, timeout=60).status_code == 401
    with run_gateway("local", tmp_path / "gw", node=f"key-{uuid.uuid4().hex[:6]}") as gw, \
            forkyard.Client(base_url=gw.url, api_key=gw.api_key, timeout=300) as client:
        (task,) = [t for t in client.tasks.import_dir(TASKS_DIR) if t.name == "count-log-errors"]

        def rollout(name: str, key: str):
            policy = {"name": name, "api": "chat", "base_urls": [keyed_vllm.base_url], "model": keyed_vllm.model,
                      "api_key": key, "tool_choice": "auto", "sampling": {"max_tokens": 16, "seed": 0}}
            created = client.rollouts.create(tasks=[task.id], group_size=2, policy=policy, agent={"max_turns": 2},
                                             max_attempts=1, limits={"episode_timeout_s": 300})
            episodes = []
            for batch in client.rollouts.stream(created.id, consumer="t"):
                episodes.extend(batch)
                batch.ack()
            return client.rollouts.get(created.id), episodes

        done, episodes = rollout("keyed", KEY)
        assert done.status == "completed" and len(episodes) == 2, done
        assert all(sum(ep.loss_mask) > 0 for ep in episodes)  # the model's sampled tokens came back

        failed, _ = rollout("wrong-key", "sk-wrong-" + secrets.token_hex(8))
        reasons = {d.reason for d in client.rollouts.dead_letters(failed.id)}
        assert reasons and all("401" in r and "policy.api_key is wrong" in r for r in reasons), reasons

        http = httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {gw.api_key}"}, timeout=60)
        for path in (f"/v1/rollouts/{done.id}", "/v1/rollouts", "/v1/episodes", f"/v1/rollouts/{failed.id}/dead_letters"):
            response = http.get(path)
            assert KEY not in response.text, path
        http.close()
    assert KEY not in gw.log.read_text(errors="replace")
