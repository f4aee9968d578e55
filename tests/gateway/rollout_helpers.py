"""Helpers for rollout, episode and delivery tests: create rollouts, play the runner's part.

No dispatcher runs in these tests: episodes are driven through the service functions the
dispatcher calls (mark running, record steps, finish), exactly as the runner would.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx
from fastapi import FastAPI
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.episodes import service as episodes_service
from gateway.episodes.models import Episode
from gateway.rollouts.executor import Executor
from tests.gateway.conftest import task_files

SCRIPTED_POLICY = {"name": "pol-test", "api": "scripted"}


class RecordingDispatcher:
    """Stands in for the app's executor: records what the API asks of it and runs nothing."""

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.cancelled: list[str] = []

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    def submit(self, rollout_id: str) -> None:
        self.submitted.append(rollout_id)

    async def cancel(self, rollout_id: str) -> None:
        self.cancelled.append(rollout_id)


@contextmanager
def recording_dispatcher(app: FastAPI) -> Iterator[RecordingDispatcher]:
    """Swap ``app.state.executor`` for a recorder (these tests play the runner themselves), then restore it."""
    previous = getattr(app.state, "executor", None)
    recorder = RecordingDispatcher()
    assert isinstance(recorder, Executor)
    app.state.executor = recorder
    try:
        yield recorder
    finally:
        app.state.executor = previous


def float32(value: float) -> float:
    """Return ``value`` rounded to float32, as a server's logprob would be."""
    return struct.unpack("f", struct.pack("f", value))[0]


async def import_tasks(client: httpx.AsyncClient, names: Sequence[str]) -> list[str]:
    """Import one small task per name and return their ids in order."""
    response = await client.post("/v1/tasks", json={"tasks": [{"name": n, "files": task_files(n)} for n in names]})
    assert response.status_code == 201, response.text
    return [t["id"] for t in response.json()["items"]]


async def create_rollout(client: httpx.AsyncClient, task_ids: Sequence[str], **fields: Any) -> dict[str, Any]:
    """Create a rollout with a scripted policy (overridable) and return its body."""
    body = {"tasks": {"ids": list(task_ids)}, "group_size": 2, "policy": SCRIPTED_POLICY, **fields}
    response = await client.post("/v1/rollouts", json=body)
    assert response.status_code == 201, response.text
    return response.json()


async def episodes_of(sessionmaker: async_sessionmaker[AsyncSession], rollout_id: str) -> list[Episode]:
    """Return every episode row of a rollout in (task, sample, attempt) order."""
    async with sessionmaker() as db:
        stmt = (select(Episode).where(Episode.rollout_id == rollout_id)
                .order_by(Episode.task_index, Episode.sample_index, Episode.attempt))
        return list((await db.scalars(stmt)).all())


def make_step(index: int, rng: random.Random, *, version: int | None, first: bool) -> dict[str, Any]:
    """Return a StepRecord-shaped dict with random token ids and float32 logprobs."""
    prompt = [rng.randrange(1, 150_000) for _ in range(rng.randint(5, 12) if first else rng.randint(2, 6))]
    completion = [rng.randrange(1, 150_000) for _ in range(rng.randint(1, 9))]
    return {
        "index": index, "parent_index": index - 1 if index else None, "prompt_ids": prompt,
        "completion_ids": completion, "logprobs": [float32(-rng.random() * 5) for _ in completion],
        "weight_version": version, "finish_reason": "stop", "text": f"turn {index}",
        "action": {"tool": "bash", "arguments": {"command": f"echo {index}"}}, "parse_error": None,
        "observation": f"{index}\n[exit code 0]", "reward": None, "timings": {"policy_s": 0.01, "env_s": 0.02},
        "server": "scripted",
    }


async def play_episode(
    sessionmaker: async_sessionmaker[AsyncSession], episode_id: str, *, status: str = "completed",
    termination: str | None = "submitted", reward: float | None = 1.0, versions: Sequence[int] = (0,),
    error: str | None = None, current_version: int | None = None, seed: int = 0, info: dict[str, Any] | None = None,
) -> tuple[Episode, list[dict[str, Any]]]:
    """Run an episode the way the runner reports one: start, one step per version, finish.

    ``info`` is added to the result's info (e.g. the runner's ``failure_info`` of a failed episode).
    """
    rng = random.Random(seed)
    steps = [make_step(i, rng, version=v, first=i == 0) for i, v in enumerate(versions)]
    async with sessionmaker() as db:
        assert await episodes_service.mark_episode_running(db_session=db, episode_id=episode_id, node="test-node")
        for step in steps:
            assert await episodes_service.record_step(db_session=db, episode_id=episode_id, step=step) is not None
        episode = await episodes_service.finish_episode(
            db_session=db, episode_id=episode_id, status=status, termination=termination, reward=reward,
            error=error, messages=[{"role": "user", "content": "do it"}], timings={"total_s": 0.1},
            weight_versions=list(versions), info={"seed": seed, **(info or {})}, current_version=current_version,
        )
    return episode, steps
