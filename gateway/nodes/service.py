"""Nodes: heartbeats in, states out, and the drain switch.

A node (a worker host; in the embedded mode, the gateway itself) writes a heartbeat every
``heartbeat_s`` seconds with its backend, capacity and load. It is ``down`` once
:data:`MISSED_HEARTBEATS` of its intervals (and at least :data:`MIN_DOWN_S`) pass without one,
``draining`` while an operator has it take no new work (what runs finishes), else ``up``.
"""

from __future__ import annotations

import logging
import math
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db import new_id, utcnow
from gateway.errors import NotFoundError
from gateway.nodes.drain import DrainFlag
from gateway.nodes.models import Node, NodeCommand
from gateway.nodes.schemas import NodeRead

logger = logging.getLogger(__name__)

#: Intervals without a heartbeat after which a node is down.
MISSED_HEARTBEATS = 2.5
#: Seconds without a heartbeat below which no node is down, whatever its interval: being found
#: down fails the node's sessions, and a short interval would otherwise turn a loaded host's
#: pause (a slow commit, a stalled loop) into lost work.
MIN_DOWN_S = 3.0


async def heartbeat(
    *, db_session: AsyncSession, name: str, backend: str, capacity: int, load: dict[str, Any], heartbeat_s: float,
    started: bool = False, address: str | None = None, channel_token: str | None = None,
) -> bool:
    """Record that ``name`` is alive now (``started``: it has just started; its start time is reset).

    Return whether it drains (as its row says, in the same statement).
    """
    now = utcnow()
    values: dict[str, Any] = {"backend": backend, "capacity": capacity, "load": load, "heartbeat_s": heartbeat_s,
                              "heartbeat_at": now, "address": address, "channel_token": channel_token}
    if started:
        values["started_at"] = now
    beat = update(Node).where(Node.name == name).values(**values).returning(Node.draining)
    draining = (await db_session.execute(beat)).scalar()
    if draining is None:  # no row yet
        db_session.add(Node(name=name, draining=False, **{"started_at": now, **values}))
        try:
            await db_session.commit()
            logger.info("node %s joined (%s backend, capacity %d)", name, backend, capacity)
            return False
        except IntegrityError:  # written concurrently: update it instead
            await db_session.rollback()
            draining = (await db_session.execute(beat)).scalar()
    await db_session.commit()
    return bool(draining)


def state_of(node: Node, now: datetime) -> str:
    """Return ``up``, ``down`` or ``draining`` for ``node`` at ``now``."""
    if now - node.heartbeat_at > timedelta(seconds=max(node.heartbeat_s * MISSED_HEARTBEATS, MIN_DOWN_S)):
        return "down"
    return "draining" if node.draining else "up"


def read(node: Node, now: datetime) -> NodeRead:
    """Return the node as the API shows it."""
    return NodeRead(name=node.name, state=state_of(node, now), backend=node.backend,  # type: ignore[arg-type]
                    capacity=node.capacity, load=dict(node.load or {}), heartbeat_at=node.heartbeat_at,
                    started_at=node.started_at, draining=node.draining, address=node.address)


async def list_nodes(*, db_session: AsyncSession) -> list[NodeRead]:
    """Return every node, by name."""
    now = utcnow()
    rows = (await db_session.scalars(select(Node).order_by(Node.name))).all()
    return [read(row, now) for row in rows]


async def queued_demand(*, db_session: AsyncSession, node: str) -> dict[str, int]:
    """Return, by task name, the queued episodes of live rollouts this node should expect.

    That is the episodes already sent to it, plus its share of those not sent anywhere yet
    (split evenly over the nodes up). A node's warm pool sizes its keys from it
    (:meth:`workers.pool.WarmPool.set_demand`).
    """
    from gateway.episodes.models import Episode
    from gateway.rollouts.models import Rollout, RolloutStatus
    from gateway.tasks.models import Task
    from workers.protocol import EpisodeStatus

    live = select(Rollout.id).where(Rollout.status.in_([RolloutStatus.QUEUED, RolloutStatus.RUNNING]))
    rows = (await db_session.execute(
        select(Task.name, Episode.node, func.count())
        .select_from(Episode).join(Task, Task.id == Episode.task_id)
        .where(Episode.rollout_id.in_(live), Episode.status == EpisodeStatus.QUEUED)
        .group_by(Task.name, Episode.node)
    )).all()
    up = sum(1 for n in await list_nodes(db_session=db_session) if n.state == "up") or 1
    demand: dict[str, int] = {}
    for task, sent_to, count in rows:
        if sent_to == node:
            demand[task] = demand.get(task, 0) + count
        elif sent_to is None:
            demand[task] = demand.get(task, 0) + math.ceil(count / up)
    await db_session.commit()
    return demand


async def get_node(*, db_session: AsyncSession, name: str) -> Node:
    """Return the node named ``name``; raise NotFoundError if none."""
    node = await db_session.get(Node, name)
    if node is None:
        raise NotFoundError(f"No node named {name!r} has sent a heartbeat.")
    return node


async def set_draining(
    *, db_session: AsyncSession, name: str, draining: bool, flag: DrainFlag | None = None,
) -> NodeRead:
    """Have ``name`` take no new work (``draining``) or take it again; idempotent.

    ``flag``: this process's node's drain flag, set at once when ``name`` is that node.
    """
    node = await get_node(db_session=db_session, name=name)
    node.draining = draining
    await db_session.commit()
    if flag is not None:
        flag.saw(name, draining)
    logger.info("node %s %s", name, "drains: no new work" if draining else "takes new work again")
    return read(node, utcnow())


async def is_draining(*, db_session: AsyncSession, name: str) -> bool:
    """Tell whether ``name`` is draining (False for a node never seen)."""
    return bool(await db_session.scalar(select(Node.draining).where(Node.name == name)))


#: Commands a node carries out (``WorkerRuntime.run_command``).
NODE_COMMANDS = frozenset({"kill_sandbox", "resize_pool", "evict_cache"})
#: Commands one beat runs at most (the rest wait for the next).
COMMANDS_PER_BEAT = 100


async def queue_command(*, db_session: AsyncSession, node: str, kind: str, args: dict[str, Any]) -> NodeCommand:
    """Queue ``kind`` for ``node``, which runs it at its next heartbeat; commit and return it."""
    if kind not in NODE_COMMANDS:
        raise ValueError(f"unknown node command {kind!r}")
    await get_node(db_session=db_session, name=node)
    row = NodeCommand(id=new_id("cmd"), node=node, kind=kind, args=args, state="pending", created_at=utcnow())
    db_session.add(row)
    await db_session.commit()
    return row


async def pending_commands(*, db_session: AsyncSession, node: str) -> list[NodeCommand]:
    """Return ``node``'s commands not yet run, oldest first."""
    return list((await db_session.scalars(
        select(NodeCommand).where(NodeCommand.node == node, NodeCommand.state == "pending")
        .order_by(NodeCommand.created_at, NodeCommand.id).limit(COMMANDS_PER_BEAT)
    )).all())


async def finish_command(*, db_session: AsyncSession, command_id: str, ok: bool, result: str) -> None:
    """Record a command's outcome."""
    await db_session.execute(update(NodeCommand).where(NodeCommand.id == command_id)
                             .values(state="done" if ok else "failed", result=result[:2000], done_at=utcnow()))
    await db_session.commit()
