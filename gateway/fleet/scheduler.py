"""The distributed mode's :class:`~gateway.rollouts.executor.Executor`: place episodes on worker nodes.

Every gateway runs one :class:`FleetScheduler`. A pass (every ``schedule_s``, or at once
when a rollout is submitted) reads the nodes that are up and not draining, counts what each
runs or has been sent, and for each active rollout places queued episodes on the nodes with
the most free slots (:func:`gateway.episodes.service.dispatch_queued`, under the rollout's
row lock, so several gateways never place one episode twice), then sends each as a Celery
job on the chosen node's queue. Nothing is lost if a gateway dies between the two: an
episode sent long ago and still queued is placed again after ``redispatch_s``.

The scheduler also hands on the work of nodes found down (their running episodes get new
attempts, their sessions end failed), as every node's heartbeat does. Cancelling a
rollout is a database flag (already set by the API) plus a message on
:data:`~gateway.fleet.queues.CANCEL_CHANNEL` that the nodes running it act on; Celery's
``revoke`` is never used (it cannot stop a job that runs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db import utcnow
from gateway.episodes import service as episodes_service
from gateway.fleet.queues import CANCEL_CHANNEL, RUN_EPISODE, celery_app, node_queue
from gateway.nodes import recovery
from gateway.nodes import service as nodes_service
from gateway.rollouts import service as rollouts_service

if TYPE_CHECKING:
    from gateway.settings import Settings

logger = logging.getLogger(__name__)


class FleetScheduler:
    """Place the queued episodes of active rollouts on worker nodes, as Celery jobs."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], settings: Settings) -> None:
        assert settings.redis_url, "the distributed mode needs FORKYARD_REDIS_URL"
        self._sessionmaker = sessionmaker
        self._redis_url = settings.redis_url
        self._fleet = settings.fleet
        self._heartbeat_s = settings.nodes.heartbeat_s
        self._celery = celery_app(settings.redis_url, visibility_timeout_s=settings.fleet.visibility_timeout_s)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._redis: Any = None
        self._settled_at = 0.0
        self.sent = 0
        """Jobs sent so far."""

    async def start(self) -> None:
        """Start placing episodes (what was queued or running before is picked up as it is)."""
        from redis.asyncio import Redis

        self._redis = Redis.from_url(self._redis_url)
        self._task = asyncio.create_task(self._run(), name="fleet scheduler")

    def submit(self, rollout_id: str) -> None:
        """Have the next pass come now (every active rollout is placed on every pass)."""
        self._wake.set()

    async def cancel(self, rollout_id: str) -> None:
        """Tell the nodes running ``rollout_id`` to stop it (the database already says it is cancelled)."""
        try:
            await self._redis.publish(CANCEL_CHANNEL, rollout_id)
        except Exception:  # the nodes also notice within a heartbeat, reading the database
            logger.warning("rollout %s: publishing its cancel failed", rollout_id, exc_info=True)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._redis is not None:
            await self._redis.aclose()
        await asyncio.to_thread(self._celery.close)

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._fleet.schedule_s)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.schedule()
            except Exception:  # the database or Redis hiccuped: the next pass tries again
                logger.warning("fleet scheduler: a pass failed", exc_info=True)

    async def schedule(self) -> int:
        """Run one pass; return how many jobs it sent."""
        if time.monotonic() - self._settled_at >= self._heartbeat_s:
            self._settled_at = time.monotonic()
            async with self._sessionmaker() as db:
                await recovery.settle_down_nodes(db_session=db, exclude="")
        async with self._sessionmaker() as db:
            nodes = await nodes_service.list_nodes(db_session=db)
        down = [n.name for n in nodes if n.state == "down"]
        eligible = {n.name: n.capacity for n in nodes if n.state == "up"}
        if not eligible:
            return 0
        sent_after = utcnow() - timedelta(seconds=self._fleet.redispatch_s)
        async with self._sessionmaker() as db:
            busy = await episodes_service.in_flight_by_node(db_session=db, sent_after=sent_after, down=down)
            active = await rollouts_service.list_active_rollouts(db_session=db)
        free = {name: capacity - busy.get(name, 0) for name, capacity in eligible.items()}
        jobs: list[tuple[str, str, str]] = []
        for rollout in active:
            if max(free.values()) <= 0:
                break
            async with self._sessionmaker() as db:
                placed = await episodes_service.dispatch_queued(
                    db_session=db, rollout_id=rollout.id, free=free, sent_after=sent_after, down=down)
            jobs.extend((rollout.id, episode_id, node) for episode_id, node in placed)
        if jobs:
            await asyncio.to_thread(self._send, jobs)
        return len(jobs)

    def _send(self, jobs: list[tuple[str, str, str]]) -> None:
        for rollout_id, episode_id, node in jobs:
            self._celery.send_task(RUN_EPISODE, args=[rollout_id, episode_id], queue=node_queue(node))
            self.sent += 1
        logger.info("fleet scheduler: sent %d episode job(s)", len(jobs))
