"""Snapshot routes: ``POST /v1/sessions/{id}/snapshot`` and ``/v1/snapshots``."""

from __future__ import annotations

from fastapi import APIRouter, Query, Response

from gateway.dependencies import CurrentSettings, DbSession, Drain, ForkNode, Gate, Runtime
from gateway.pagination import DEFAULT_LIMIT, MAX_LIMIT
from gateway.snapshots import service
from gateway.snapshots.schemas import ForkedSessions, SnapshotFork, SnapshotPage, SnapshotRead

router = APIRouter(tags=["snapshots"])


@router.post("/sessions/{session_id}/snapshot", status_code=201, response_model=SnapshotRead)
async def snapshot_session(session_id: str, db_session: DbSession, runtime: Runtime, gate: Gate):
    """Snapshot an open session (filesystem, shell cwd and exports, history); not its background processes."""
    record = await service.snapshot_session(db_session=db_session, runtime=runtime, session_id=session_id, gate=gate)
    return service.snapshot_read(record)


@router.post("/snapshots/{snapshot_id}/fork", status_code=201, response_model=ForkedSessions)
async def fork_snapshot(
    snapshot_id: str, body: SnapshotFork, db_session: DbSession, runtime: Runtime, settings: CurrentSettings,
    gate: Gate, node: ForkNode, drain: Drain,
):
    """Start ``n`` sessions continuing from the snapshot; each inherits the steps up to it (``GET .../steps``)."""
    forks = await service.fork_snapshot(
        db_session=db_session, runtime=runtime, snapshot_id=snapshot_id, n=body.n, node=node,
        max_open=settings.sessions.max_open, gate=gate, drain=drain,
    )
    return service.forked_sessions(snapshot_id, forks)


@router.get("/snapshots", response_model=SnapshotPage)
async def list_snapshots(
    db_session: DbSession,
    gate: Gate,
    session_id: str | None = None,
    limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT),
    cursor: str | None = None,
):
    """List live snapshots, oldest first, optionally of one source session."""
    await gate.settle()  # snapshot rows are written behind their answers
    rows, next_cursor = await service.list_snapshots(
        db_session=db_session, session_id=session_id or None, limit=limit, cursor=cursor
    )
    return SnapshotPage(items=[service.snapshot_read(r) for r in rows], next=next_cursor)


@router.get("/snapshots/{snapshot_id}", response_model=SnapshotRead)
async def get_snapshot(snapshot_id: str, db_session: DbSession, gate: Gate):
    """Return one snapshot."""
    await gate.settle()
    return service.snapshot_read(await service.get_snapshot(db_session=db_session, snapshot_id=snapshot_id))


@router.delete("/snapshots/{snapshot_id}", status_code=204, response_class=Response)
async def delete_snapshot(snapshot_id: str, db_session: DbSession, runtime: Runtime, gate: Gate):
    """Delete a snapshot (409 if pinned); its storage goes once no open fork holds it."""
    await gate.settle()
    await service.delete_snapshot(db_session=db_session, runtime=runtime, snapshot_id=snapshot_id)
    return Response(status_code=204)


@router.post("/snapshots/{snapshot_id}/pin", response_model=SnapshotRead)
async def pin_snapshot(snapshot_id: str, db_session: DbSession, runtime: Runtime, gate: Gate):
    """Pin a snapshot: it cannot be deleted, and outlives its session and forks, until unpinned."""
    await gate.settle()
    record = await service.set_pinned(db_session=db_session, runtime=runtime, snapshot_id=snapshot_id, pinned=True)
    return service.snapshot_read(record)


@router.post("/snapshots/{snapshot_id}/unpin", response_model=SnapshotRead)
async def unpin_snapshot(snapshot_id: str, db_session: DbSession, runtime: Runtime, gate: Gate):
    """Unpin a snapshot; one that nothing else holds (open source session or fork) is deleted."""
    await gate.settle()
    record = await service.set_pinned(db_session=db_session, runtime=runtime, snapshot_id=snapshot_id, pinned=False)
    return service.snapshot_read(record)
