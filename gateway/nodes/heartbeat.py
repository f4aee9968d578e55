"""This process's node heartbeat: alive, what it runs, and whether an operator has it drain."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db import utcnow
from gateway.nodes import recovery, service
from gateway.nodes.drain import DrainFlag
from gateway.sandboxes.service import record_sandboxes

logger = logging.getLogger(__name__)


class Heartbeat:
    """Write this node's heartbeat every ``interval_s`` until closed; keep its :class:`DrainFlag`.

    With ``sandboxes`` (the runtime's listing), every beat also brings the node's sandbox rows
    in line with what is live (:func:`gateway.sandboxes.service.record_sandboxes`).
    """

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
        channel_token: str | None = None,
        sandboxes: Callable[[], Awaitable[Sequence[Any]]] | None = None,
        made_after: Callable[[int], tuple[Sequence[Any], int]] | None = None,
        demand: Callable[[Mapping[str, int]], None] | None = None,
        commands: Callable[[str, Mapping[str, Any]], Awaitable[str]] | None = None,
        drain: DrainFlag | None = None,
    ) -> None:
        """``made_after``: the sandboxes the node made after a mark, gone or not, and the next mark
        (the backend's ledger); those made and destroyed between two listings get a row too, gone.
        ``demand``: called each beat with the episodes queued for this node by task name
        (:func:`gateway.nodes.service.queued_demand`); the node's warm pool sizes from it.
        ``commands``: runs an operator's command queued for this node (the console's kill,
        resize and evict); each beat runs those pending and records their outcome.
        ``drain``: set from the node's row at each beat."""
        self.drain = drain
        self._commands = commands
        self.address = address
        self._channel_token = channel_token
        self._demand = demand
        self._sandboxes = sandboxes
        self._made_after = made_after
        self._made_mark = 0
        """The ledger's mark at the last listing that was recorded."""
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
        """Write one heartbeat now and read back the node's drain flag into :attr:`drain`."""
        async with self._sessionmaker() as db:
            draining = await service.heartbeat(
                db_session=db, name=self.node, backend=self._backend, capacity=self._capacity, load=self._load(),
                heartbeat_s=self.interval_s, started=started, address=self.address,
                channel_token=self._channel_token)
        if self.drain is not None:
            self.drain.saw(self.node, draining)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.beat()
                async with self._sessionmaker() as db:
                    await recovery.settle_down_nodes(db_session=db, exclude=self.node)
            except Exception:  # a database hiccup must not end the heartbeats for good
                logger.warning("node %s: heartbeat (or settling the nodes found down) failed", self.node, exc_info=True)
            if self._sandboxes is not None:
                try:
                    await self.record_sandboxes()
                except Exception:
                    logger.warning("node %s: recording its sandboxes failed", self.node, exc_info=True)
            if self._commands is not None:
                try:
                    await self.run_commands()
                except Exception:
                    logger.warning("node %s: running the queued commands failed", self.node, exc_info=True)
            if self._demand is not None:
                try:
                    await self.read_demand()
                except Exception:
                    logger.warning("node %s: reading the queued demand failed", self.node, exc_info=True)

    async def run_commands(self) -> int:
        """Run the commands queued for this node now, oldest first, recording each outcome; return how many ran."""
        assert self._commands is not None
        async with self._sessionmaker() as db:
            pending = [(c.id, c.kind, dict(c.args)) for c in await service.pending_commands(db_session=db,
                                                                                             node=self.node)]
        for command_id, kind, args in pending:
            try:
                result, ok = await self._commands(kind, args), True
            except Exception as exc:
                result, ok = f"{type(exc).__name__}: {exc}", False
            logger.info("node %s: command %s %s: %s", self.node, kind, "done" if ok else "failed", result)
            async with self._sessionmaker() as db:
                await service.finish_command(db_session=db, command_id=command_id, ok=ok, result=result)
        return len(pending)

    async def read_demand(self) -> dict[str, int]:
        """Read the episodes queued for this node by task now, hand them to ``demand`` and return them."""
        assert self._demand is not None
        async with self._sessionmaker() as db:
            queued = await service.queued_demand(db_session=db, node=self.node)
        self._demand(queued)
        return queued

    async def record_sandboxes(self) -> int:
        """Write this node's sandbox rows from its live listing now; return how many changed."""
        assert self._sandboxes is not None
        listed_at = utcnow()
        # The ledger's mark is read before the listing: what is made in between is read twice (no harm).
        made, mark = self._made_after(self._made_mark) if self._made_after is not None else ((), 0)
        live = await self._sandboxes()
        async with self._sessionmaker() as db:
            changed = await record_sandboxes(db_session=db, node=self.node, live=live, made=made,
                                             listed_at=listed_at)
        self._made_mark = mark
        return changed

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
