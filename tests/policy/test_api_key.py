"""A rollout against a real vLLM that requires an API key (``vllm serve --api-key``).

The key travels in the policy spec and is kept as a secret: the rollout completes with
it, fails clearly with a wrong one, and no response or gateway log line shows it. The
server is the session's (``tests/policy/conftest.py`` starts it behind a key).
"""

from __future__ import annotations

import secrets
import uuid

import httpx

import forkyard
from tests.live import ROOT, run_gateway

TASKS_DIR = ROOT / "examples" / "tasks" / "terminal"


def test_rollout_reaches_a_vllm_behind_an_api_key(vllm_server, tiny_models, tmp_path):
    key = vllm_server.api_key
    assert key, "the session's vLLM runs behind a key"
    body = {"model": vllm_server.model, "prompt": "hi", "max_tokens": 1}
    assert httpx.post(vllm_server.base_url + "/v1/completions", json=body, timeout=60).status_code == 401
    with run_gateway("local", tmp_path / "gw", node=f"key-{uuid.uuid4().hex[:6]}") as gw, \
            forkyard.Client(base_url=gw.url, api_key=gw.api_key, timeout=300) as client:
        (task,) = [t for t in client.tasks.import_dir(TASKS_DIR) if t.name == "count-log-errors"]

        def rollout(name: str, key: str):
            policy = {"name": name, "api": "chat", "base_urls": [vllm_server.base_url], "model": vllm_server.model,
                      "api_key": key, "tool_choice": "auto", "sampling": {"max_tokens": 16, "seed": 0}}
            created = client.rollouts.create(tasks=[task.id], group_size=2, policy=policy, agent={"max_turns": 2},
                                             max_attempts=1, limits={"episode_timeout_s": 300})
            episodes = []
            for batch in client.rollouts.stream(created.id, consumer="t"):
                episodes.extend(batch)
                batch.ack()
            return client.rollouts.get(created.id), episodes

        done, episodes = rollout("keyed", key)
        assert done.status == "completed" and len(episodes) == 2, done
        assert all(sum(ep.loss_mask) > 0 for ep in episodes)  # the model's sampled tokens came back

        failed, _ = rollout("wrong-key", "sk-wrong-" + secrets.token_hex(8))
        reasons = {d.reason for d in client.rollouts.dead_letters(failed.id)}
        assert reasons and all("401" in r and "policy.api_key is wrong" in r for r in reasons), reasons

        http = httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {gw.api_key}"}, timeout=60)
        for path in (f"/v1/rollouts/{done.id}", "/v1/rollouts", "/v1/episodes", f"/v1/rollouts/{failed.id}/dead_letters"):
            response = http.get(path)
            assert key not in response.text, path
        http.close()
    assert key not in gw.log.read_text(errors="replace")
