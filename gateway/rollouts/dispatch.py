"""The in-process dispatcher (embedded mode): schedules the episodes of active rollouts.

It decides what runs (queued episodes, concurrency, lazy-fork groups, drain) and hands
the episodes it claims to an :class:`~gateway.rollouts.hosting.EpisodeHost`, which runs
them on this node's runtime and has them report into the database.

It owns no state of its own that matters after a crash: every decision is read from and
written to the database through the episode and rollout services, so a restarted
gateway requeues what was interrupted and resumes the rollouts still active.

Two ways of running episodes share sandboxes:

- Branching rollouts run each sample as a trajectory tree (:mod:`workers.branching`):
  the trunk episode forks branch episodes, which this dispatcher stores as they appear.
- Groups of a task that declares deterministic tools (``[environment]
  deterministic_tools = true``) run as one unit on a
  :class:`~workers.shared_env.SharedEnvGroup` (lazy fork, :func:`workers.jobs.run_shared_group`), unless the rollout turns
  ``lazy_fork`` off. The group takes one concurrency slot and one agent slot: its samples
  wait for each other at every step, so they must never queue behind each other.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.episodes import service as episodes_service
from gateway.nodes import service as nodes_service
from gateway.rollouts import service as rollouts_service
from gateway.rollouts.hosting import EpisodeHost
from workers.errors import WorkerError

if TYPE_CHECKING:
    from gateway.rollouts.hosting import LoadedTask

logger = logging.getLogger(__name__)


class Dispatcher:
    """Run every active rollout's queued episodes on this node's runtime."""

    def __init__(
        self,
        *,
        sessionmaker: async_sessionmaker[AsyncSession],
        host: EpisodeHost,
        drain_poll_s: float = 5.0,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._host = host
        self._node = host.node
        self._drain_poll_s = drain_poll_s
        self._rollouts: dict[str, asyncio.Task[None]] = {}
        self._episodes: dict[str, dict[str, asyncio.Task[None]]] = {}
        self._closed = False

    async def start(self) -> None:
        """Requeue what a crash interrupted and resume the rollouts still active."""
        async with self._sessionmaker() as db:
            interrupted = await episodes_service.requeue_interrupted(db_session=db, node=self._node)
        if interrupted:
            logger.warning("requeued %d episode(s) interrupted by a restart", interrupted)
        async with self._sessionmaker() as db:
            active = await rollouts_service.list_active_rollouts(db_session=db)
        for rollout in active:
            self.submit(rollout.id)

    def submit(self, rollout_id: str) -> None:
        """Start running a rollout's episodes in the background (no-op if it already runs)."""
        if self._closed:
            return
        task = self._rollouts.get(rollout_id)
        if task is None or task.done():
            self._rollouts[rollout_id] = asyncio.create_task(self._run_rollout(rollout_id), name=f"rollout {rollout_id}")

    @property
    def running_episodes(self) -> int:
        """Episodes running on this node now (a shared group's samples each count)."""
        return sum(len(running) for running in self._episodes.values())

    async def _draining(self) -> bool:
        async with self._sessionmaker() as db:
            return await nodes_service.is_draining(db_session=db, name=self._node)

    async def cancel(self, rollout_id: str) -> None:
        """Stop a rollout's running episodes (the service has already cancelled it in the DB)."""
        running = list(set(self._episodes.get(rollout_id, {}).values()))
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await self._host.settle()  # the cancelled episodes are failed before the cancel answers

    async def aclose(self) -> None:
        """Stop everything; interrupted episodes stay ``running`` and are requeued at the next start."""
        self._closed = self._host.closing = True
        tasks = list(self._rollouts.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_rollout(self, rollout_id: str) -> None:
        try:
            rollout, plan = await self._host.load_plan(rollout_id)
        except WorkerError as exc:
            logger.warning("rollout %s cannot run: %s", rollout_id, exc)
            async with self._sessionmaker() as db:
                await rollouts_service.fail_rollout(db_session=db, rollout_id=rollout_id, error=str(exc))
            return
        running = self._episodes.setdefault(rollout_id, {})
        slots = asyncio.Semaphore(max(1, rollout.concurrency))
        tasks: dict[str, LoadedTask] = {}
        try:
            while True:
                async with self._sessionmaker() as db:
                    queued = await episodes_service.list_queued_episodes(
                        db_session=db, rollout_id=rollout_id, limit=max(1, rollout.concurrency)
                    )
                queued = [ep for ep in queued if ep.id not in running]
                if not queued:
                    if not running:
                        break
                    await asyncio.wait(list(running.values()), return_when=asyncio.FIRST_COMPLETED)
                    continue
                if await self._draining():  # no new episode starts here; what runs finishes
                    await asyncio.sleep(self._drain_poll_s)
                    continue
                for episode in queued:
                    if episode.id in running:  # taken with its group
                        continue
                    await slots.acquire()
                    if episode.task_id not in tasks:
                        tasks[episode.task_id] = await self._host.load_task(episode.task_id)
                    task, env_version = tasks[episode.task_id]
                    members = [episode]
                    if plan.shares_sandboxes(task) and episode.attempt == 1:
                        members = await self._host.queued_group(episode)
                    started = await self._host.claim(members)
                    if not started:
                        slots.release()
                        continue
                    run = self._host.spawn(rollout, plan, started, task, env_version)
                    for member in started:
                        running[member.id] = run
                    ids = [m.id for m in started]
                    run.add_done_callback(lambda _t, ids=ids: ([running.pop(i, None) for i in ids], slots.release()))
        except asyncio.CancelledError:
            for task in set(running.values()):
                task.cancel()
            await asyncio.gather(*set(running.values()), return_exceptions=True)
            raise
        finally:
            await plan.aclose()
            self._episodes.pop(rollout_id, None)
        logger.info("rollout %s: no episode left to run", rollout_id)
