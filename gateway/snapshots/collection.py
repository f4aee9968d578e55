"""Freeing the snapshots nothing holds any more: run when a session ends, a snapshot is deleted, a node starts.

It stands apart from :mod:`gateway.snapshots.service`, which forks sessions and so builds on
the sessions service: the sessions service calls this module when a session ends, and no
cycle ties the two services together.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sqlalchemy import exists, or_, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from gateway.db import utcnow
from gateway.sessions.models import EnvSession, SessionState
from gateway.snapshots.models import SnapshotRecord

if TYPE_CHECKING:
    from workers.protocol import WorkerClient

logger = logging.getLogger(__name__)


def backend_snapshot_id(record: SnapshotRecord) -> str:
    """Return the id of the backend snapshot behind a record."""
    return record.state["session"]["sandbox"]["id"]


async def live_backend_snapshot_ids(*, db_session: AsyncSession, node: str) -> set[str]:
    """Return the backend snapshots the not yet freed snapshot rows of ``node`` reference."""
    rows = await db_session.scalars(
        select(SnapshotRecord).where(SnapshotRecord.node == node, SnapshotRecord.freed_at.is_(None)))
    return {backend_snapshot_id(r) for r in rows}


async def collect_garbage(*, db_session: AsyncSession, runtime: WorkerClient, node: str) -> list[str]:
    """Delete the snapshots of ``node`` that nothing holds and free their backend storage; return their ids.

    Holders: an open fork, the pin, and (unless the snapshot was deleted) its open source session.
    """
    fork = aliased(EnvSession)
    source = aliased(EnvSession)
    forked_open = exists().where(fork.snapshot_id == SnapshotRecord.id, fork.state == SessionState.OPEN)
    source_open = exists().where(source.id == SnapshotRecord.session_id, source.state == SessionState.OPEN)
    stmt = select(SnapshotRecord).where(
        SnapshotRecord.node == node, SnapshotRecord.freed_at.is_(None), SnapshotRecord.pinned.is_(False),
        ~forked_open, or_(SnapshotRecord.deleted_at.is_not(None), ~source_open),
    )
    doomed = list((await db_session.scalars(stmt)).all())
    if not doomed:
        return []
    now = utcnow()
    for record in doomed:
        if record.deleted_at is None:  # its session ended with nothing else holding it
            record.deleted_at = now
    live = select(SnapshotRecord).where(SnapshotRecord.node == node, SnapshotRecord.freed_at.is_(None))
    live_rows = list((await db_session.scalars(live)).all())
    await db_session.commit()
    doomed_ids = {r.id for r in doomed}
    still_used = {backend_snapshot_id(r) for r in live_rows if r.id not in doomed_ids}
    freed = []
    for record in doomed:
        ref = backend_snapshot_id(record)
        if ref not in still_used:  # content-addressed: another record may share the backend snapshot
            try:
                await runtime.delete_snapshot(ref, node=node)
            except Exception:
                logger.exception("snapshot %s: freeing backend snapshot %s failed; will retry", record.id, ref)
                continue
            still_used.add(ref)  # freed once is enough
        record.freed_at = utcnow()
        freed.append(record.id)
    await db_session.commit()
    if freed:
        logger.info("freed %d snapshot(s): %s", len(freed), ", ".join(freed))
    return freed
