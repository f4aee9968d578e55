"""An in-memory :class:`~workers.protocol.EpisodeReporter`: episodes run with nothing to report to.

For running the data plane on its own (benchmarks, tests of the runner, a script that
drives episodes without a gateway): steps and branch results are kept in dicts, branch
ids are derived from their parent's, and the policy state is whatever the owner sets.
"""

from __future__ import annotations

import asyncio
import itertools

from workers.protocol import EpisodeResult, PolicyState, StepRecord


class MemoryReporter:
    """Keep every reported step and result in memory; the policy state is set by the owner."""

    def __init__(self, *, version: int = 0) -> None:
        self.steps: dict[str, list[StepRecord]] = {}
        self.results: dict[str, EpisodeResult] = {}
        self.spawned: list[tuple[str, int, int]] = []
        self._state = PolicyState(version=version)
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._ids = itertools.count(1)

    async def record_step(self, episode_id: str, step: StepRecord) -> None:
        self.steps.setdefault(episode_id, []).append(step)

    async def finish(self, episode_id: str, result: EpisodeResult) -> None:
        self.results[episode_id] = result

    async def spawn_branches(self, parent_episode_id: str, turn: int, n: int) -> list[str]:
        self.spawned.append((parent_episode_id, turn, n))
        return [f"{parent_episode_id}.{turn}.{next(self._ids)}" for _ in range(n)]

    async def policy_state(self) -> PolicyState:
        return self._state

    async def wait_until_unpaused(self) -> None:
        await self._unpaused.wait()

    def set_policy(self, *, version: int | None = None, paused: bool | None = None) -> None:
        """Announce a version and/or pause or resume, as a trainer would."""
        update = {k: v for k, v in (("version", version), ("paused", paused)) if v is not None}
        self._state = self._state.model_copy(update=update)
        if self._state.paused:
            self._unpaused.clear()
        else:
            self._unpaused.set()


__all__ = ["MemoryReporter"]
