"""Snapshot sessions, fork snapshots into sessions, pin, delete and garbage-collect them.

A snapshot is held by its pin and by every open session forked from it. DELETE marks it
deleted; its backend storage is freed at once when nothing holds it, else when the last
holder lets go (:func:`collect_garbage` runs whenever a session ends or a pin goes).
Closing the session a snapshot was taken from does not touch the snapshot.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import exists, select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db import new_id, utcnow
from gateway.errors import ConflictError, NotFoundError, RateLimitedError
from gateway.pagination import page_of, paginate
from gateway.sandboxes.models import Sandbox
from gateway.sessions import service as sessions_service
from gateway.sessions.models import EnvSession, SessionState
from gateway.snapshots.models import SnapshotRecord
from gateway.tasks.service import get_task, load_terminal_task
from workers.errors import SessionNotFoundError

if TYPE_CHECKING:
    from workers.runtime import SessionOpened, WorkerRuntime

logger = logging.getLogger(__name__)

KIND_MANUAL = "manual"


def backend_snapshot_id(record: SnapshotRecord) -> str:
    """Return the id of the backend snapshot behind a record."""
    return record.state["session"]["sandbox"]["id"]


def snapshot_metadata(record: SnapshotRecord) -> dict[str, str]:
    """Return the backend snapshot's metadata (it says background processes are not captured)."""
    return dict(record.state["session"]["sandbox"].get("metadata") or {})


def snapshot_history(record: SnapshotRecord) -> list[dict[str, Any]]:
    """Return the session's steps up to the snapshot."""
    return list(record.state.get("history") or [])


async def get_snapshot(*, db_session: AsyncSession, snapshot_id: str) -> SnapshotRecord:
    """Return the live (not deleted) snapshot with this id; raise NotFoundError otherwise."""
    row = await db_session.get(SnapshotRecord, snapshot_id)
    if row is None or row.deleted_at is not None:
        raise NotFoundError(f"Snapshot {snapshot_id!r} does not exist.")
    return row


async def list_snapshots(
    *, db_session: AsyncSession, session_id: str | None = None, limit: int, cursor: str | None = None
) -> tuple[list[SnapshotRecord], str | None]:
    """Return one page of live snapshots, oldest first, optionally of one source session."""
    stmt = select(SnapshotRecord).where(SnapshotRecord.deleted_at.is_(None))
    if session_id is not None:
        stmt = stmt.where(SnapshotRecord.session_id == session_id)
    stmt = paginate(stmt, created_at=SnapshotRecord.created_at, id_=SnapshotRecord.id, cursor=cursor, limit=limit)
    rows = list((await db_session.scalars(stmt)).all())
    return page_of(rows, limit=limit)


async def snapshot_session(
    *, db_session: AsyncSession, runtime: WorkerRuntime, session_id: str
) -> SnapshotRecord:
    """Snapshot an open session: its sandbox, its env state and its history so far.

    Raises:
        NotFoundError: no such session.
        ConflictError: the session is not open (code ``session_closed``).
    """
    row = await sessions_service.get_session(db_session=db_session, session_id=session_id)
    if row.state != SessionState.OPEN:
        raise ConflictError(f"Session {session_id!r} is {row.state.value}; only an open session can be snapshotted.",
                            code="session_closed")
    task = await get_task(db_session=db_session, task_id=row.task_id)
    await db_session.commit()  # no transaction stays open while the backend copies the filesystem
    try:
        snap = await runtime.snapshot_session(session_id, metadata={"session_id": session_id})
    except SessionNotFoundError as exc:
        raise ConflictError(f"Session {session_id!r} is no longer live on its worker; it cannot be snapshotted.",
                            code="session_closed") from exc
    await db_session.refresh(row)
    history = list(row.history or [])
    observation = history[-1]["observation"] if history else task.instruction
    record = SnapshotRecord(
        id=new_id("snap"), node=row.node, backend=snap.sandbox.backend, session_id=row.id, task_id=row.task_id,
        kind=KIND_MANUAL, pinned=False, created_at=utcnow(),
        state={"session": snap.to_json(), "history": history, "observation": observation},
    )
    db_session.add(record)
    await db_session.commit()
    logger.info("session %s: snapshot %s (backend %s)", session_id, record.id, snap.id)
    return record


async def fork_snapshot(
    *, db_session: AsyncSession, runtime: WorkerRuntime, snapshot_id: str, n: int, node: str, max_open: int
) -> tuple[SnapshotRecord, list[tuple[EnvSession, SessionOpened]]]:
    """Start ``n`` sessions continuing from a snapshot; each starts with its history.

    Raises:
        NotFoundError: no such snapshot (or it was deleted).
        RateLimitedError: the forks would exceed ``max_open`` open sessions on this node.
    """
    from workers.runtime import SessionSnapshot

    record = await get_snapshot(db_session=db_session, snapshot_id=snapshot_id)
    task = await get_task(db_session=db_session, task_id=record.task_id)
    if await sessions_service.count_open_sessions(db_session=db_session, node=node) + n > max_open:
        raise RateLimitedError(
            f"Forking {n} session(s) would exceed this gateway node's limit of {max_open} open sessions."
        )
    history = snapshot_history(record)
    # The rows exist (open, holding the snapshot) before any sandbox does.
    rows = [
        EnvSession(id=new_id("sess"), task_id=task.id, state=SessionState.OPEN, node=node, steps=len(history),
                   created_at=utcnow(), history=history, snapshot_id=record.id)
        for _ in range(n)
    ]
    db_session.add_all(rows)
    await db_session.commit()
    ids = [r.id for r in rows]
    try:
        terminal_task = await load_terminal_task(task)
        opened = await runtime.fork_session(
            SessionSnapshot.from_json(record.state["session"]), ids, terminal_task,
            labels={sessions_service.LABEL_TASK_ID: task.id},
        )
    except Exception as exc:
        logger.warning("fork of snapshot %s failed: %s", record.id, exc)
        for session_id in ids:
            await sessions_service._finish(db_session, session_id, SessionState.FAILED,
                                           error=sessions_service._error_text(exc))
            await sessions_service._release(runtime, session_id)
        await collect_garbage(db_session=db_session, runtime=runtime, node=node)
        raise
    observation = record.state.get("observation") or task.instruction
    out = []
    for row, one in zip(rows, opened, strict=True):
        sandbox = one.sandbox
        row.sandbox_id = sandbox.id
        row.backend = sandbox.backend
        db_session.add(Sandbox(
            id=sandbox.id, node=sandbox.node, backend=sandbox.backend, state=sandbox.state, session_id=row.id,
            task_id=task.id, created_at=datetime.fromtimestamp(sandbox.created_at, UTC),
        ))
        out.append((row, type(one)(one.session_id, sandbox, observation, one.tools)))
    await db_session.commit()
    logger.info("snapshot %s forked into %s", record.id, ", ".join(ids))
    return record, out


async def set_pinned(
    *, db_session: AsyncSession, runtime: WorkerRuntime, snapshot_id: str, pinned: bool
) -> SnapshotRecord:
    """Pin (keep until unpinned) or unpin a snapshot."""
    record = await get_snapshot(db_session=db_session, snapshot_id=snapshot_id)
    record.pinned = pinned
    await db_session.commit()
    if not pinned:
        await collect_garbage(db_session=db_session, runtime=runtime, node=record.node)
    return record


async def delete_snapshot(*, db_session: AsyncSession, runtime: WorkerRuntime, snapshot_id: str) -> None:
    """Delete a snapshot: freed now if nothing holds it, else once its open forks end.

    Raises:
        NotFoundError: no such snapshot.
        ConflictError: it is pinned (code ``snapshot_pinned``).
    """
    record = await db_session.get(SnapshotRecord, snapshot_id)
    if record is None:
        raise NotFoundError(f"Snapshot {snapshot_id!r} does not exist.")
    if record.deleted_at is not None:
        return
    if record.pinned:
        raise ConflictError(f"Snapshot {snapshot_id!r} is pinned; unpin it before deleting it.",
                            code="snapshot_pinned")
    record.deleted_at = utcnow()
    await db_session.commit()
    await collect_garbage(db_session=db_session, runtime=runtime, node=record.node)


async def collect_garbage(*, db_session: AsyncSession, runtime: WorkerRuntime, node: str) -> list[str]:
    """Free the backend storage of deleted snapshots of ``node`` that nothing holds; return their ids."""
    held = exists().where(EnvSession.snapshot_id == SnapshotRecord.id, EnvSession.state == SessionState.OPEN)
    stmt = select(SnapshotRecord).where(
        SnapshotRecord.node == node, SnapshotRecord.deleted_at.is_not(None), SnapshotRecord.freed_at.is_(None),
        SnapshotRecord.pinned.is_(False), ~held,
    )
    doomed = list((await db_session.scalars(stmt)).all())
    if not doomed:
        return []
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
                await runtime.delete_snapshot(ref)
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
