"""This process's node heartbeat: alive, what it runs, and whether an operator has it drain."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.nodes import service

logger = logging.getLogger(__name__)


class Heartbeat:
    """Write this node's heartbeat every ``interval_s`` until closed; keep its drain flag for the executor."""

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        *,
        node: str,
        backend: str,
        capacity: int,
        load: Callable[[], dict[str, Any]],
        interval_s: float,
        address: str | None = None,
    ) -> None:
        self.address = address
        self._sessionmaker = sessionmaker
        self.node = node
        self._backend = backend
        self._capacity = capacity
        self._load = load
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Write the first heartbeat (the node's start), then keep beating in the background."""
        await self.beat(started=True)
        self._task = asyncio.create_task(self._run(), name=f"heartbeat {self.node}")

    async def beat(self, *, started: bool = False) -> None:
        async with self._sessionmaker() as db:
            await service.heartbeat(db_session=db, name=self.node, backend=self._backend, capacity=self._capacity,
                                    load=self._load(), heartbeat_s=self.interval_s, started=started,
                                    address=self.address)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.beat()
                async with self._sessionmaker() as db:
                    await service.settle_down_nodes(db_session=db, exclude=self.node)
            except Exception:  # a database hiccup must not end the heartbeats for good
                logger.warning("node %s: heartbeat (or settling the nodes found down) failed", self.node, exc_info=True)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
