"""The gateway's :class:`~workers.protocol.EpisodeReporter`: episodes report into the database.

The policy state (announced version, pause flag) is read before every turn of every
episode, so it is cached per policy in a :class:`PolicyStates`: one database read per
policy per refresh interval, whatever the number of episodes running, and pushed at once
when this gateway changes it (:meth:`PolicyStates.changed`, called by the policies API).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.artifacts.service import store_artifacts
from gateway.episodes import service as episodes_service
from gateway.policies import service as policies_service
from workers.protocol import EpisodeResult, PolicyState, StepRecord

logger = logging.getLogger(__name__)

#: How old a cached policy state may get before it is read again (a change made through
#: another gateway is seen within this; one made through this gateway at once).
POLICY_REFRESH_S = 0.25


class PolicyStates:
    """The announced version and pause flag of each policy, cached for :data:`POLICY_REFRESH_S`."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], *, refresh_s: float = POLICY_REFRESH_S) -> None:
        self._sessionmaker = sessionmaker
        self._refresh_s = refresh_s
        self._cached: dict[str, tuple[float, PolicyState]] = {}
        self._reading: dict[str, asyncio.Future[PolicyState]] = {}
        self._changed: dict[str, asyncio.Event] = {}
        self.reads = 0
        """Database reads so far (the cache's whole cost)."""

    async def get(self, name: str) -> PolicyState:
        """Return ``name``'s state, read at most :data:`POLICY_REFRESH_S` ago (one read shared by all callers)."""
        cached = self._cached.get(name)
        if cached is not None and time.monotonic() - cached[0] < self._refresh_s:
            return cached[1]
        reading = self._reading.get(name)
        if reading is None:
            reading = asyncio.ensure_future(self._read(name))
            self._reading[name] = reading
            reading.add_done_callback(lambda _f: self._reading.pop(name, None))
        return await asyncio.shield(reading)

    async def _read(self, name: str) -> PolicyState:
        async with self._sessionmaker() as db:
            version = await policies_service.current_version(db_session=db, name=name)
            paused = await policies_service.is_paused(db_session=db, name=name)
        self.reads += 1
        state = PolicyState(version=version, paused=paused)
        self._cached[name] = (time.monotonic(), state)
        return state

    def changed(self, name: str) -> None:
        """Drop ``name``'s cached state and wake its paused episodes to read it again."""
        self._cached.pop(name, None)
        event = self._changed.pop(name, None)
        if event is not None:
            event.set()

    async def wait_until_unpaused(self, name: str) -> None:
        """Return once ``name`` is not paused: woken by :meth:`changed`, or after one refresh interval."""
        while (await self.get(name)).paused:
            event = self._changed.setdefault(name, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), self._refresh_s)
            except TimeoutError:
                pass


class DatabaseReporter:
    """Report the episodes of one rollout into the database, for the node running them.

    ``lease``: the fencing token the episodes were claimed under; every write carries it,
    so an attempt that lost its episode (a node found down whose work was handed on, a
    duplicate delivery) can no longer change it: its writes raise
    :class:`~gateway.episodes.service.LeaseLostError`, and its result is dropped.
    """

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        *,
        node: str,
        policy_name: str,
        policies: PolicyStates,
        on_store_failure: Callable[[str, str], Awaitable[None]],
        lease: str | None = None,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._lease = lease
        self._node = node
        self._policy_name = policy_name
        self._policies = policies
        self._on_store_failure = on_store_failure

    async def record_step(self, episode_id: str, step: StepRecord) -> None:
        async with self._sessionmaker() as db:
            values = step.as_dict()
            if step.artifacts:
                values["artifacts"] = await store_artifacts(db_session=db, files=step.artifacts)
            await episodes_service.record_step(db_session=db, episode_id=episode_id, step=values, lease=self._lease)

    async def finish(self, episode_id: str, result: EpisodeResult) -> None:
        try:
            async with self._sessionmaker() as db:
                info = result.info
                if result.artifacts:
                    info = {**info, "artifacts": await store_artifacts(db_session=db, files=result.artifacts)}
                await episodes_service.finish_episode(
                    db_session=db, episode_id=episode_id, status=result.status, termination=result.termination,
                    reward=result.reward, error=result.error, messages=result.messages,
                    timings=result.timings, weight_versions=result.weight_versions, info=info,
                    lease=self._lease,
                )
        except episodes_service.LeaseLostError as exc:
            logger.warning("episode %s: result dropped: %s", episode_id, exc)
        except Exception as exc:  # the episode must end somehow, or its group and rollout never do
            logger.exception("episode %s: storing its result failed", episode_id)
            await self._on_store_failure(episode_id, f"storing the result failed: {type(exc).__name__}: {exc}")

    async def spawn_branches(self, parent_episode_id: str, turn: int, n: int) -> list[str]:
        async with self._sessionmaker() as db:
            return await episodes_service.spawn_branches(
                db_session=db, parent_episode_id=parent_episode_id, turn=turn, n=n, node=self._node,
                lease=self._lease)

    async def policy_state(self) -> PolicyState:
        return await self._policies.get(self._policy_name)

    async def wait_until_unpaused(self) -> None:
        await self._policies.wait_until_unpaused(self._policy_name)
