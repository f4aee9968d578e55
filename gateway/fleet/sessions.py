"""Sessions in the distributed mode: the gateways reach the node that owns a session's sandbox.

A worker node serves the node channel (:mod:`gateway.fleet.channel`: protobuf frames over
one TCP connection per gateway) and writes its address with its heartbeat; a gateway keeps
one persistent connection per node. :class:`FleetRuntime` stands where the embedded mode's
``WorkerRuntime`` stands for the sessions API: it places a new session on the up,
undrained node with the fewest open sessions per slot, and routes every later call by the
session's node (read once from the database, then cached), so a session opened through
one gateway is stepped and closed through any other.

Arguments and results are JSON; errors cross as the worker error's wire form
(:meth:`workers.errors.WorkerError.to_wire`) and are raised again on the gateway by code.
A session's snapshots stay on its node, and its forks start there. The node's side is
:class:`gateway.fleet.worker.NodeCalls`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.fleet.channel import NodeClient, NodeUnreachable
from gateway.nodes import service as nodes_service
from gateway.nodes.models import Node
from gateway.sessions.models import EnvSession, SessionState
from gateway.sessions.service import LABEL_TASK_ID
from workers.errors import SandboxBackendError, SessionNotFoundError, WorkerError
from workers.protocol import OpenedWire, SandboxWire, SnapshotWire, StepWire

logger = logging.getLogger(__name__)


class FleetRuntime:
    """The sessions API's runtime on a distributed-mode gateway: every session lives on a worker node.

    A :class:`workers.protocol.WorkerClient`; what it returns are the wire types of
    :mod:`workers.protocol`, as the node encoded them.
    """

    backend_name = "fleet"
    loads_tasks = True
    """The node loads a session's task by its id (the gateway decodes nothing)."""
    sole_gateway = False
    """Any gateway may step a session it routes: it keeps nothing of a session's progress."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker
        self._clients: dict[str, NodeClient] = {}
        self._where: dict[str, str] = {}

    async def place_session(self, db_session: AsyncSession) -> str:
        """Return the node a new session goes to: up, not draining, reachable, fewest open sessions per slot.

        Raises:
            SandboxBackendError: no node can take it.
        """
        nodes = [n for n in await nodes_service.list_nodes(db_session=db_session) if n.state == "up" and n.address]
        if not nodes:
            raise SandboxBackendError("no worker node is up to take a session (start one with `forkyard worker`)")
        rows = (await db_session.execute(
            select(EnvSession.node).where(EnvSession.state == SessionState.OPEN))).scalars().all()
        await db_session.commit()
        open_by_node: dict[str, int] = {}
        for node in rows:
            open_by_node[node] = open_by_node.get(node, 0) + 1
        return min(nodes, key=lambda n: (open_by_node.get(n.name, 0) / max(1, n.capacity), n.name)).name

    async def _client(self, node: str, *, fresh: bool = False) -> NodeClient:
        client = self._clients.get(node)
        if client is not None and not fresh:
            return client
        async with self._sessionmaker() as db:
            found = (await db.execute(select(Node.address, Node.channel_token).where(Node.name == node))).first()
        address, token = found if found is not None else (None, None)
        if not address or not token:
            raise SandboxBackendError(f"node {node} has no session channel (is it a `forkyard worker`?)")
        if client is not None and (client.address, client.token) == (address, token):
            return client
        if client is not None:
            await client.aclose()
        self._clients[node] = client = NodeClient(node, address, token=token)
        return client

    async def _node_of(self, session_id: str) -> str:
        node = self._where.get(session_id)
        if node is None:
            async with self._sessionmaker() as db:
                node = await db.scalar(select(EnvSession.node).where(EnvSession.id == session_id))
            if node is None:
                raise SessionNotFoundError(f"no session {session_id}")
            self._where[session_id] = node
        return node

    async def _call(self, node: str, method: str, **args: Any) -> Any:
        try:
            return await (await self._client(node)).call(method, **args)
        except NodeUnreachable:
            # The node may have restarted, on another port or with a new token: read both again,
            # once (the call did not run; one that broke off after sending is not run twice).
            return await (await self._client(node, fresh=True)).call(method, **args)

    async def _session_call(self, session_id: str, method: str, **args: Any) -> Any:
        return await self._call(await self._node_of(session_id), method, session_id=session_id, **args)

    # ------------------------------------------------------------------ the runtime's session calls

    async def open_session(self, session_id: str, task: Any, *, labels: dict[str, str] | None = None,
                           env_version: str = "") -> OpenedWire:
        """Open the session on the node its row names (the node loads the task itself, by id)."""
        labels = dict(labels or {})
        data = await self._session_call(session_id, "open_session", task_id=labels.get(LABEL_TASK_ID, ""),
                                        labels=labels)
        return OpenedWire.model_validate(data)

    def has_session(self, session_id: str) -> bool:
        """Tell whether this gateway has routed the session and not closed it (its state is then not read
        before a step; one closed through another gateway answers ``session_closed`` from its node)."""
        return session_id in self._where

    def session_count(self) -> int:
        return 0

    async def step(self, session_id: str, tool: str, arguments: dict[str, Any]) -> StepWire:
        return StepWire.model_validate(await self._session_call(session_id, "step", tool=tool, arguments=arguments))

    async def close_session(self, session_id: str) -> None:
        try:
            await self._session_call(session_id, "close_session")
        except SessionNotFoundError:
            pass
        finally:
            self._where.pop(session_id, None)

    async def list_sandboxes(self) -> list[SandboxWire]:
        """Return the sandboxes of every live node, asked at once; a node that fails to answer is left out."""

        async def one(name: str) -> list[SandboxWire]:
            try:
                return [SandboxWire.model_validate(s) for s in await self._call(name, "list_sandboxes")]
            except WorkerError as exc:
                logger.warning("listing the sandboxes of node %s failed: %s", name, exc)
                return []

        listed = await asyncio.gather(*(one(name) for name in await self._live_nodes()))
        return [sandbox for found in listed for sandbox in found]

    async def reap(self, keep_owner_ids: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
        return []  # each node reaps its own at start

    async def sweep_transient_snapshots(self, keep_session_snapshots: set[str] | None = None) -> list[str]:
        return []

    async def snapshot_session(self, session_id: str, *, metadata: Mapping[str, str] | None = None
                               ) -> SnapshotWire:
        """Snapshot a session on its node (the snapshot stays there: its forks start there too)."""
        data = await self._session_call(session_id, "snapshot_session", metadata=dict(metadata or {}))
        return SnapshotWire(data)

    def snapshot_from_json(self, data: Mapping[str, Any]) -> SnapshotWire:
        return SnapshotWire(data)

    async def fork_session(self, snapshot: SnapshotWire, new_session_ids: list[str], task: Any, *,
                           labels: Mapping[str, str] | None = None,
                           launched: Callable[[], None] | None = None) -> list[OpenedWire]:
        """Start the forks on the node holding the snapshot (``launched`` at once: the node does the work)."""
        data = snapshot.to_json()
        node = snapshot.sandbox.node
        labels = dict(labels or {})
        for session_id in new_session_ids:
            self._where[session_id] = node
        if launched is not None:
            launched()
        opened = await self._call(node, "fork_session", snapshot=data, session_ids=new_session_ids,
                                  task_id=labels.get(LABEL_TASK_ID, ""), labels=labels)
        return [OpenedWire.model_validate(o) for o in opened]

    async def delete_snapshot(self, snapshot_id: str, *, node: str | None = None) -> None:
        """Free a snapshot on ``node``, which holds it; without a node, on every live node (deleting is idempotent).

        Raises:
            WorkerError: ``node``'s answer (a node unreachable raises SandboxBackendError; the
                caller retries at its next collection).
        """
        if node:
            await self._call(node, "delete_snapshot", snapshot_id=snapshot_id)
            return

        async def one(name: str) -> None:
            try:
                await self._call(name, "delete_snapshot", snapshot_id=snapshot_id)
            except WorkerError as exc:
                logger.warning("node %s: deleting snapshot %s failed: %s", name, snapshot_id, exc)

        await asyncio.gather(*(one(name) for name in await self._live_nodes()))

    async def _live_nodes(self) -> list[str]:
        """Return the nodes not down that have a session channel."""
        async with self._sessionmaker() as db:
            nodes = await nodes_service.list_nodes(db_session=db)
        return [n.name for n in nodes if n.state != "down" and n.address]

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()
