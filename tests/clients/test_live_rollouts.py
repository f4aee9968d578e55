"""Managed rollouts through the SDK against a real gateway (`forkyard up` per backend).

The policy is the scripted oracle (each task's solution replayed as one bash call, then
submit), so every episode runs in a real sandbox and earns reward 1.0 without a model.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

import forkyard

ROOT = Path(__file__).resolve().parents[2]

TEST_SH = """#!/bin/bash
if [ "$(cat /tmp/forkyard-rollout.txt 2>/dev/null)" = "hello" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""

ROLLOUT_TASK = {
    "name": "sdk-live-rollout-echo",
    "files": {
        "instruction.md": "Write the word hello into /tmp/forkyard-rollout.txt.\n",
        "task.toml": (
            '[metadata]\nauthor = "forkyard sdk tests"\n\n'
            "[agent]\ntimeout_sec = 300\n\n[verifier]\ntimeout_sec = 60\n\n"
            "[environment]\ncpus = 1\nmemory_mb = 512\n"
        ),
        "environment/Dockerfile": "FROM debian:bookworm\n",
        "tests/test.sh": TEST_SH,
        "solution/solve.sh": "#!/bin/bash\necho hello > /tmp/forkyard-rollout.txt\n",
    },
}

DEADLINE_S = 600
"""Generous bound on waiting for a rollout to finish, so a broken gateway fails instead of hanging."""


def oracle(name: str) -> dict:
    return {"name": f"{name}-{uuid.uuid4().hex[:6]}", "api": "scripted", "model": "oracle"}


@pytest.fixture(scope="module")
def gateway(live_gateway):
    """The live gateway, once it serves rollouts at all."""
    answer = httpx.post(
        f"{live_gateway.url}/v1/rollouts", json={}, headers={"Authorization": f"Bearer {live_gateway.api_key}"},
        timeout=30,
    )
    if answer.status_code in (404, 405):
        pytest.skip("This gateway has no POST /v1/rollouts yet (the server side of managed rollouts is pending).")
    return live_gateway


@pytest.fixture
def client(gateway):
    with forkyard.Client(base_url=gateway.url, api_key=gateway.api_key) as c:
        yield c


@pytest.fixture
async def aclient(gateway):
    async with forkyard.AsyncClient(base_url=gateway.url, api_key=gateway.api_key) as c:
        yield c


@pytest.fixture
def task_id(client) -> str:
    [task] = client.tasks.import_specs([ROLLOUT_TASK])
    return task.id


def check_training_view(episode: forkyard.Episode) -> None:
    assert len(episode.input_ids) == len(episode.loss_mask)
    assert len(episode.logprobs or []) == sum(episode.loss_mask)
    assert episode.reward == 1.0
    assert episode.status is forkyard.EpisodeStatus.COMPLETED and episode.termination == "submitted"


def test_stream_delivers_each_group_once_then_ends(client, task_id):
    rollout = client.rollouts.create(
        tasks=[task_id], group_size=2, policy=oracle("sdk-stream"), agent={"max_turns": 4}
    )
    assert rollout.group_size == 2 and rollout.id
    received: list[forkyard.Episode] = []
    with client.rollouts.stream(rollout.id, consumer="sdk-stream") as stream:
        for batch in stream:
            assert batch.rollout_id == rollout.id and batch.consumer == "sdk-stream"
            received.extend(batch)
            assert batch.ack() == len(batch)
    assert len(received) == 2
    assert len({e.episode_id for e in received}) == 2
    assert len({e.group_id for e in received}) == 1, "both samples of the task form one group"
    seqs = [e.seq for e in received]
    assert all(isinstance(s, int) for s in seqs) and seqs == sorted(seqs)
    for episode in received:
        check_training_view(episode)

    final = client.rollouts.get(rollout.id)
    assert final.status is forkyard.RolloutStatus.COMPLETED and final.done
    assert final.progress.total == final.progress.finished == 2
    assert final.counts.get("completed") == 2

    after = client.rollouts.pull(rollout.id, consumer="sdk-stream")
    assert after.done and len(after) == 0, "acked episodes are never delivered again"

    # Another consumer group gets its own copy of every episode.
    other = client.rollouts.pull(rollout.id, consumer="sdk-other", max_episodes=10, wait_s=5)
    assert sorted(other.episode_ids) == sorted(e.episode_id for e in received)
    assert other.ack() == 2
    assert client.rollouts.pull(rollout.id, consumer="sdk-other").done

    listed = list(client.episodes.list(rollout_id=rollout.id))
    assert sorted(e.id for e in listed) == sorted(e.episode_id for e in received)
    assert all(e.status is forkyard.EpisodeStatus.COMPLETED and e.reward == 1.0 for e in listed)
    detail = client.episodes.get(received[0].episode_id)
    assert detail.steps and detail.steps[0].action is not None
    training = client.episodes.training(received[0].episode_id)
    assert training.input_ids == received[0].input_ids and training.logprobs == received[0].logprobs
    assert list(client.rollouts.dead_letters(rollout.id)) == []
    assert rollout.id in [r.id for r in client.rollouts.list()]


def test_unacked_episodes_are_redelivered_after_their_lease(client, task_id):
    rollout = client.rollouts.create(tasks=[task_id], group_size=1, policy=oracle("sdk-lease"))
    deadline = time.monotonic() + DEADLINE_S
    batch = client.rollouts.pull(rollout.id, consumer="lessee", wait_s=10, visibility_timeout_s=1)
    while not batch and not batch.done and time.monotonic() < deadline:
        batch = client.rollouts.pull(rollout.id, consumer="lessee", wait_s=10, visibility_timeout_s=1)
    assert len(batch) == 1, f"the rollout delivered nothing: {client.rollouts.get(rollout.id)}"
    # Not acked: once the 1 s lease runs out the same episode comes back.
    again = client.rollouts.pull(rollout.id, consumer="lessee", wait_s=10)
    while not again and time.monotonic() < deadline:
        again = client.rollouts.pull(rollout.id, consumer="lessee", wait_s=10)
    assert again.episode_ids == batch.episode_ids
    assert again.ack() == 1
    assert client.rollouts.pull(rollout.id, consumer="lessee").done


def test_bad_rollouts_are_refused_with_the_reason(client, gateway, task_id):
    auth = {"Authorization": f"Bearer {gateway.api_key}"}
    answer = httpx.post(
        f"{gateway.url}/v1/rollouts", headers=auth, timeout=30,
        json={"tasks": {"ids": [task_id]}, "group_size": 0, "policy": oracle("sdk-bad")},
    )
    assert answer.status_code == 422 and "group_size" in answer.json()["error"]["message"]

    missing = f"missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises((forkyard.NotFoundError, forkyard.UnprocessableEntityError)) as info:
        client.rollouts.create(tasks=[missing], group_size=1, policy=oracle("sdk-bad"))
    assert missing in info.value.message

    with pytest.raises(forkyard.UnprocessableEntityError, match="base_urls"):
        client.rollouts.create(
            tasks=[task_id], group_size=1, policy={"name": "sdk-bad", "api": "tokens", "model": "m"},
        )


def test_policy_versions(client):
    name = f"sdk-policy-{uuid.uuid4().hex[:6]}"
    assert client.policies.set_version(name, 3).version == 3
    assert client.policies.pause(name).paused
    current = client.policies.get(name)
    assert (current.name, current.version, current.paused) == (name, 3, True)
    assert not client.policies.resume(name).paused
    with pytest.raises(forkyard.ConflictError):
        client.policies.set_version(name, 2)  # versions never go back
    assert client.policies.set_version(name, 3).version == 3, "announcing the same version again is fine"


def test_example_trainer_runs_to_completion(gateway, task_id):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "trainer.py"), "--task-id", task_id, "--group-size", "2",
         "--consumer", f"trainer-{uuid.uuid4().hex[:6]}", "--policy-name", f"sdk-trainer-{uuid.uuid4().hex[:6]}"],
        env=gateway.env(), capture_output=True, text=True, timeout=DEADLINE_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "completed" in result.stdout and "step 1 " in result.stdout


# -- async ----------------------------------------------------------------------


async def test_async_pull_until_done(aclient, task_id):
    rollout = await aclient.rollouts.create(tasks=[task_id], group_size=2, policy=oracle("sdk-async"))
    received: list[forkyard.Episode] = []
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        batch = await aclient.rollouts.pull(rollout.id, consumer="sdk-async", max_episodes=1, wait_s=10)
        assert isinstance(batch, forkyard.AsyncEpisodeBatch)
        received.extend(batch)
        assert await batch.ack() == len(batch)
        if batch.done:
            break
    assert len(received) == 2
    for episode in received:
        check_training_view(episode)
    assert (await aclient.rollouts.get(rollout.id)).status is forkyard.RolloutStatus.COMPLETED


async def test_async_cancel_ends_the_stream(aclient, task_id):
    rollout = await aclient.rollouts.create(tasks=[task_id], group_size=6, policy=oracle("sdk-cancel"), concurrency=1)
    cancelled = await aclient.rollouts.cancel(rollout.id)
    assert cancelled.id == rollout.id
    deadline = time.monotonic() + DEADLINE_S
    current = await aclient.rollouts.get(rollout.id)
    while current.status is not forkyard.RolloutStatus.CANCELLED and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        current = await aclient.rollouts.get(rollout.id)
    assert current.status is forkyard.RolloutStatus.CANCELLED and current.done
    async with aclient.rollouts.stream(rollout.id, consumer="sdk-cancel") as stream:
        batches = [batch async for batch in stream]  # ends: the rollout is finished
    assert sum(len(b) for b in batches) <= 6
    assert all(e.status in (forkyard.EpisodeStatus.COMPLETED, forkyard.EpisodeStatus.TRUNCATED)
               for b in batches for e in b)
