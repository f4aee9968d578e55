"""Handing on the work of nodes found down: their episodes requeued, their sessions failed.

It stands apart from :mod:`gateway.nodes.service` (heartbeats and states), which the sessions
and episodes services read: this module writes through those services, so keeping it
there would tie them in a cycle.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db import utcnow
from gateway.episodes import service as episodes_service
from gateway.nodes.models import Node
from gateway.nodes.service import state_of
from gateway.sessions import service as sessions_service


async def settle_down_nodes(*, db_session: AsyncSession, exclude: str) -> list[str]:
    """Hand on the work of every node found down (but ``exclude``, the caller's own node).

    Its running episodes fail as interrupted and get a new attempt where attempts remain
    (another node runs it), and its open sessions end ``failed`` with the reason: their
    sandboxes went with their host. Idempotent and safe from several gateways at once;
    returns the names of the down nodes that had work. A node that comes back finds its
    episodes taken: what it finishes late is ignored (the episode is no longer running).
    """
    now = utcnow()
    rows = (await db_session.scalars(select(Node).where(Node.name != exclude))).all()
    down = [(n.name, n.heartbeat_at) for n in rows if state_of(n, now) == "down"]
    await db_session.commit()
    settled = []
    for name, last in down:
        why = f"node {name} is down (no heartbeat since {last:%Y-%m-%d %H:%M:%S} UTC)"
        episodes = await episodes_service.requeue_interrupted(db_session=db_session, node=name, error=why)
        sessions = await sessions_service.fail_node_sessions(db_session=db_session, node=name, error=why)
        if episodes or sessions:
            settled.append(name)
    return settled
