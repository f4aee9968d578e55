"""Snapshot sessions, fork snapshots into sessions, pin, delete and garbage-collect them.

A snapshot is held by the session it was taken from while that session is open, by every
open session forked from it and by its pin. When nothing holds it any more it is deleted
and its backend storage freed (:func:`collect_garbage` runs whenever a session ends, a pin
goes or a snapshot is deleted): pin a snapshot to keep it after its session closes.
DELETE marks it deleted at once; its storage goes when its open forks end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from gateway.db import RecordWriter, new_id, utcnow, write_records
from gateway.errors import ConflictError, NotFoundError, RateLimitedError
from gateway.nodes.drain import DrainFlag
from gateway.pagination import page_of, paginate
from gateway.sandboxes.models import Sandbox
from gateway.sessions import service as sessions_service
from gateway.sessions.gate import SessionFacts, StepGate
from gateway.sessions.models import EnvSession, SessionState, SessionStep
from gateway.snapshots.collection import (
    KnownSnapshot,
    backend_snapshot_id,
    collect_garbage,
    fork_holds,
    known_snapshots,
)
from gateway.snapshots.models import SnapshotRecord
from gateway.snapshots.schemas import ForkedSession, ForkedSessions, SnapshotRead
from gateway.tasks.models import Task
from gateway.tasks.service import load_task
from workers.errors import SessionNotFoundError
from workers.protocol import SESSION_SNAPSHOT_KEY, OpenedWire, SandboxStatus, SandboxWire

if TYPE_CHECKING:
    from workers.protocol import OpenedView, SandboxView, WorkerClient

logger = logging.getLogger(__name__)

_SESSION = EnvSession.__table__

KIND_MANUAL = "manual"


def snapshot_metadata(record: SnapshotRecord) -> dict[str, str]:
    """Return the backend snapshot's metadata (it says background processes are not captured)."""
    return dict(record.state["session"]["sandbox"].get("metadata") or {})


def snapshot_steps(record: SnapshotRecord) -> int:
    """Return how many steps the session had taken when it was snapshotted (a fork inherits them)."""
    return int(record.state.get("steps") or 0)


def snapshot_read(record: SnapshotRecord) -> SnapshotRead:
    """Return a snapshot's API form (REST's body; the gRPC channel's ``result_json``)."""
    return SnapshotRead(
        id=record.id, session_id=record.session_id, task_id=record.task_id, node=record.node,
        backend=record.backend, kind=record.kind, pinned=record.pinned, steps=snapshot_steps(record),
        created_at=record.created_at, metadata=snapshot_metadata(record),
    )


def forked_sessions(snapshot_id: str, forks: list[tuple[EnvSession, OpenedView]]) -> ForkedSessions:
    """Return the API form of the sessions a fork started (REST's body; the gRPC channel's ``result_json``)."""
    return ForkedSessions(items=[
        ForkedSession(
            id=row.id, task_id=row.task_id, state=row.state, observation=opened.observation, tools=opened.tools,
            sandbox_id=row.sandbox_id, created_at=row.created_at, snapshot_id=snapshot_id, steps=row.steps,
        )
        for row, opened in forks
    ])


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


# The source's columns a snapshot records and, when the session took it itself, its last
# step's observation: one statement (a fork's inherited last step needs one more per ancestor).
_STEP = SessionStep.__table__
_SOURCE = select(
    _SESSION.c.state, _SESSION.c.task_id, _SESSION.c.node, _SESSION.c.steps, _SESSION.c.parent_session_id,
    _SESSION.c.parent_steps,
    select(_STEP.c.observation)
    .where(_STEP.c.session_id == _SESSION.c.id, _STEP.c.seq == _SESSION.c.steps - 1)
    .scalar_subquery().label("observation"),
).where(_SESSION.c.id == bindparam("id"))


async def snapshot_session(
    *, db_session: AsyncSession, runtime: WorkerClient, session_id: str, gate: StepGate | None = None
) -> SnapshotRecord:
    """Snapshot an open session: its sandbox, its env state and how far its history goes.

    The step count and last observation recorded are those of the steps answered before
    the snapshot. With a ``gate`` that keeps the session's facts, nothing is read; else the
    session's step records are settled and read while the backend copies the sandbox.
    With a write-behind ``gate``, the row is written behind the answer in the session's
    order (readers of snapshot rows settle it first); without, before it.

    Raises:
        NotFoundError: no such session.
        ConflictError: the session is not open (code ``session_closed``).
    """
    # A session the runtime holds is open (it lets go only after the row left ``open``).
    facts = gate.facts(session_id) if gate is not None and runtime.has_session(session_id) else None
    snapping = asyncio.ensure_future(runtime.snapshot_session(
        session_id, metadata={"session_id": session_id, SESSION_SNAPSHOT_KEY: session_id}))
    if facts is None:
        facts = await _source_facts(db_session, runtime, session_id, snapping, gate)
        if gate is not None and runtime.sole_gateway and runtime.has_session(session_id):
            gate.know(session_id, dataclasses.replace(facts))
    try:
        snap = await snapping
    except SessionNotFoundError as exc:
        raise ConflictError(f"Session {session_id!r} is no longer live on its worker; it cannot be snapshotted.",
                            code="session_closed") from exc
    try:
        observation = facts.observation
        if observation is None:  # no step yet: a fork starts where the session did
            observation = await _instruction(db_session, facts.task_id)
        record = SnapshotRecord(
            id=new_id("snap"), node=facts.node, backend=snap.sandbox.backend, session_id=session_id,
            task_id=facts.task_id, kind=KIND_MANUAL, pinned=False, created_at=utcnow(),
            state={"session": snap.to_json(), "steps": facts.steps, "observation": observation},
        )  # fmt: skip
    except BaseException:  # unrecorded, nothing would ever free it
        await asyncio.shield(runtime.delete_snapshot(snap.id, node=facts.node))
        raise
    known_snapshots.put(record)
    if gate is not None and gate.writer is not None:
        gate.record(session_id, functools.partial(_insert_snapshot, gate.writer, runtime, record))
    else:
        await _insert_snapshot(db_session, runtime, record)
    logger.info("session %s: snapshot %s (backend %s)", session_id, record.id, snap.id)
    return record


_SNAPSHOT_INSERT = insert(SnapshotRecord.__table__)


async def _insert_snapshot(db: AsyncSession | RecordWriter, runtime: WorkerClient, record: SnapshotRecord) -> None:
    """Write a snapshot's row; if that fails, free its backend snapshot (nothing else ever would).

    ``db``: the request's session, or the gate's writer behind the answer (in its session's order).
    """
    values = {c.key: getattr(record, c.key) for c in SnapshotRecord.__table__.columns}
    try:
        await write_records(db, functools.partial(_execute, _SNAPSHOT_INSERT, values))
    except BaseException:
        known_snapshots.drop(record.id)
        await asyncio.shield(runtime.delete_snapshot(backend_snapshot_id(record), node=record.node))
        raise


def _execute(statement: Any, values: dict[str, Any], db: Session) -> None:
    db.execute(statement, values)


async def _source_facts(
    db_session: AsyncSession, runtime: WorkerClient, session_id: str, snapping: asyncio.Future,
    gate: StepGate | None,
) -> SessionFacts:
    """Read what a snapshot records of its source session while the backend copies; free the copy if it is not open."""
    try:
        if gate is not None:
            await gate.settle(session_id)  # its step count and last observation are read from the records
        source, observation = await _read_source(db_session, session_id)
    except BaseException:
        await _drop_snapshot(runtime, snapping)
        raise
    if source is None or source.state != SessionState.OPEN:
        await _drop_snapshot(runtime, snapping)
        if source is None:
            raise NotFoundError(f"Session {session_id!r} does not exist.")
        raise ConflictError(f"Session {session_id!r} is {source.state.value}; only an open session can be "
                            "snapshotted.", code="session_closed")
    return SessionFacts(task_id=source.task_id, node=source.node, steps=source.steps, observation=observation)


async def _read_source(db_session: AsyncSession, session_id: str) -> tuple[Any, str | None]:
    """Return the source session's columns a snapshot records (None: no such session) and its last observation."""
    source = (await db_session.execute(_SOURCE, {"id": session_id})).first()
    observation = None if source is None else source.observation
    if source is not None and observation is None and source.steps > 0:  # inherited: the fork took no step yet
        observation = await sessions_service.last_observation(
            db_session, session_id, steps=source.steps, parent_session_id=source.parent_session_id,
            parent_steps=source.parent_steps,
        )
    await db_session.commit()  # no transaction stays open while the backend copies the filesystem
    return source, observation


async def _drop_snapshot(runtime: WorkerClient, snapping: asyncio.Future) -> None:
    """Wait for a backend snapshot that will not be recorded and free it (its errors are moot); cancel-safe."""

    async def drop() -> None:
        await asyncio.wait([snapping])
        if not snapping.cancelled() and snapping.exception() is None:
            snap = snapping.result()
            await runtime.delete_snapshot(snap.id, node=snap.sandbox.node)

    await asyncio.shield(asyncio.ensure_future(drop()))


_DELETED_AT = select(SnapshotRecord.deleted_at).where(SnapshotRecord.id == bindparam("id"))


async def _live(db_session: AsyncSession, snapshot_id: str) -> bool:
    """Tell whether the snapshot's row is there and not deleted (one light read)."""
    row = (await db_session.execute(_DELETED_AT, {"id": snapshot_id})).first()
    return row is not None and row[0] is None




async def fork_snapshot(
    *, db_session: AsyncSession, runtime: WorkerClient, snapshot_id: str, n: int, node: str, max_open: int,
    gate: StepGate | None = None, drain: DrainFlag | None = None,
) -> list[tuple[EnvSession, OpenedView]]:
    """Start ``n`` sessions continuing from a snapshot; each inherits the history up to it.

    The restore starts first when this process knows the snapshot (:data:`known_snapshots`);
    once it is launched (see ``WorkerClient.fork_session``), its row is read (live? its node
    draining? under the node's limit?) and the forks' rows written while the backend
    restores their sandboxes. If a check fails or the snapshot turns out deleted
    meanwhile, the sandboxes are freed and the forks fail. No sandbox starts past the
    runtime's own count of open sessions.
    With a write-behind ``gate``, each fork's sandbox is recorded behind the answer, as
    a step is (whatever reads the fork settles it first). When, besides, the runtime is
    the sole gateway of its sessions, this process knows the snapshot (it drops the ones it
    deletes) and keeps its node's ``drain`` flag, nothing is read: the flag is checked before
    the restore starts, the runtime counts the open sessions, and the forks' rows are written
    behind the answer too, the snapshot held meanwhile by
    :data:`~gateway.snapshots.collection.fork_holds`.

    Raises:
        NotFoundError: no such snapshot (or it was deleted).
        RateLimitedError: the forks would exceed ``max_open`` open sessions on this node.
    """
    known = known_snapshots.get(snapshot_id)
    read = known is None
    if known is None:  # written by another process (or long ago): read it before anything starts
        if gate is not None:
            await gate.settle()  # a row being written is known, unless forgotten since (thousands later)
        known = known_snapshots.put(await get_snapshot(db_session=db_session, snapshot_id=snapshot_id))
    node = node or str(known.state["session"]["sandbox"].get("node") or "")  # "": where the snapshot is
    # No sandbox starts past the limit (the runtime's count; the database's is read beside the restore,
    # with the node's drain flag: a fork refused for either frees what it started).
    if runtime.session_count() + n > max_open:
        raise _too_many(n, max_open)
    task = None if runtime.loads_tasks else await load_task(db_session=db_session, task_id=known.task_id)
    steps = int(known.state.get("steps") or 0)
    # The history up to the snapshot stays the source session's rows: a fork costs the same
    # after 1 step or 1,000. Each row holds the snapshot (open, snapshot_id) once committed.
    rows = [
        EnvSession(id=new_id("sess"), task_id=known.task_id, state=SessionState.OPEN, node=node, steps=steps,
                   created_at=utcnow(), snapshot_id=snapshot_id, parent_session_id=known.session_id,
                   parent_steps=steps)
        for _ in range(n)
    ]
    ids = [r.id for r in rows]
    # Known and not deleted here since (no await between this check and the hold).
    behind = (not read and gate is not None and gate.writer is not None and runtime.sole_gateway
              and drain is not None and drain.node == node and known_snapshots.get(snapshot_id) is not None)
    if behind:
        assert drain is not None
        if drain.draining:  # nothing has started yet
            raise sessions_service.draining_error(node)
        fork_holds.begin(snapshot_id, n)
    launched = asyncio.get_running_loop().create_future()
    forking = asyncio.ensure_future(runtime.fork_session(
        runtime.snapshot_from_json(known.state["session"]), ids, task,
        labels={sessions_service.LABEL_TASK_ID: known.task_id},
        launched=lambda: launched.done() or launched.set_result(None),
    ))
    if behind:
        opened = await _fork_held(db_session, runtime, snapshot_id, rows, forking, node)
        observation = known.state.get("observation") or await _instruction(db_session, known.task_id)
        return await _answer_forks(db_session, runtime, snapshot_id, known, rows, opened, observation, gate,
                                   rows_behind=True)
    # The reads below wait until the restore has left this process (or ended): run beside its
    # first steps (the overlay, the runtime's spawn), they slowed them more than they took.
    await asyncio.wait([launched, forking], return_when=asyncio.FIRST_COMPLETED)
    failure: BaseException | None = None
    try:
        if not read and gate is not None:
            await gate.settle(known.session_id)  # its row, if written behind the snapshot's answer
        if not read and not await _live(db_session, snapshot_id):  # its columns only: the state is known
            raise NotFoundError(f"Snapshot {snapshot_id!r} does not exist.")
        draining, open_count = await sessions_service.admission(db_session=db_session, node=node)
        if draining:
            raise sessions_service.draining_error(node)
        if open_count + n > max_open:
            raise _too_many(n, max_open)
        db_session.add_all(rows)
        await db_session.commit()
        # Read after the rows are in: a collection that ran before them shows here, one after spares the snapshot.
        if not await _live(db_session, snapshot_id):
            failure = NotFoundError(f"Snapshot {snapshot_id!r} does not exist.")
        await db_session.commit()
    except BaseException:
        await asyncio.shield(_release_forks(runtime, forking, ids))
        raise
    if failure is None:
        try:
            opened = await forking
        except Exception as exc:
            logger.warning("fork of snapshot %s failed: %s", snapshot_id, exc)
            failure = exc
    else:
        await asyncio.shield(_release_forks(runtime, forking, ids))
    if failure is not None:
        error = ("the snapshot was deleted while the fork started" if isinstance(failure, NotFoundError)
                 else sessions_service._error_text(failure))
        for session_id in ids:
            await sessions_service._finish(db_session, session_id, SessionState.FAILED, error=error)
            await sessions_service._release(runtime, session_id)
        await collect_garbage(db_session=db_session, runtime=runtime, node=node)
        raise failure
    observation = known.state.get("observation") or await _instruction(db_session, known.task_id)
    return await _answer_forks(db_session, runtime, snapshot_id, known, rows, opened, observation, gate,
                                   rows_behind=False)


async def _fork_held(
    db_session: AsyncSession, runtime: WorkerClient, snapshot_id: str, rows: list[EnvSession],
    forking: asyncio.Future, node: str,
) -> list[OpenedView]:
    """Wait for the restore of the forks of a snapshot :data:`fork_holds` holds.

    Whatever fails lets go of the hold; a failed restore leaves its forks' rows, failed.
    """
    ids = [r.id for r in rows]
    try:
        opened = await forking
    except BaseException as exc:
        fork_holds.end(snapshot_id, len(rows))
        if not isinstance(exc, Exception):
            await asyncio.shield(_release_forks(runtime, forking, ids))
            raise
        logger.warning("fork of snapshot %s failed: %s", snapshot_id, exc)
        db_session.add_all(rows)
        await db_session.commit()
        for session_id in ids:
            await sessions_service._finish(db_session, session_id, SessionState.FAILED,
                                           error=sessions_service._error_text(exc))
            await sessions_service._release(runtime, session_id)
        await collect_garbage(db_session=db_session, runtime=runtime, node=node)
        raise
    return opened


async def _answer_forks(
    db_session: AsyncSession, runtime: WorkerClient, snapshot_id: str, known: KnownSnapshot,
    rows: list[EnvSession], opened: list[OpenedView], observation: str, gate: StepGate | None, *, rows_behind: bool,
) -> list[tuple[EnvSession, OpenedView]]:
    """Record the forks' sandboxes (and, ``rows_behind``, their rows) now or behind the answer; return the answer."""
    out: list[tuple[EnvSession, OpenedView]] = []
    for row, one in zip(rows, opened, strict=True):
        claim = functools.partial(_claim, runtime=runtime, session_id=row.id, sandbox=one.sandbox,
                                  task_id=known.task_id)
        if rows_behind:
            assert gate is not None and gate.writer is not None
            values = {k: v for k, v in vars(row).items() if not k.startswith("_")}
            gate.record(row.id, functools.partial(_write_fork, gate.writer, runtime, gate, snapshot_id,
                                                  known.session_id, values, claim))
        elif gate is not None and gate.writer is not None:  # like a step's record: behind the answer, in order
            gate.record(row.id, functools.partial(claim, gate.writer))
        else:
            await claim(db_session)
        if gate is not None and runtime.sole_gateway:
            gate.know(row.id, SessionFacts(task_id=known.task_id, node=row.node, steps=row.steps,
                                           observation=known.state.get("observation")))
        set_committed_value(row, "sandbox_id", one.sandbox.id)
        set_committed_value(row, "backend", one.sandbox.backend)
        out.append((row, OpenedWire(session_id=one.session_id, sandbox=SandboxWire.of(one.sandbox),
                                    observation=observation, tools=one.tools)))
    logger.info("snapshot %s forked into %s", snapshot_id, ", ".join(r.id for r in rows))
    return out


_FORK_INSERT = insert(_SESSION)


async def _write_fork(
    writer: RecordWriter, runtime: WorkerClient, gate: StepGate, snapshot_id: str, source_id: str,
    values: dict[str, Any], claim: Callable[..., Awaitable[None]],
) -> None:
    """Write a fork's row and its sandbox's behind the answer, then let go of the snapshot's hold.

    If that fails the fork goes (no row would ever close it): its steps answer 404.
    """
    try:
        await gate.settle(source_id)  # the snapshot's row first, if it is still being written: the fork names it
        await claim(writer, fork_row=values)
    except BaseException:
        gate.forget(values["id"])
        await asyncio.shield(sessions_service._release(runtime, values["id"]))
        raise
    finally:
        fork_holds.end(snapshot_id)


async def _claim(
    db: AsyncSession | RecordWriter, *, runtime: WorkerClient, session_id: str, sandbox: SandboxView, task_id: str,
    fork_row: dict[str, Any] | None = None,
) -> None:
    """Record a fork's sandbox on its row (written first, given ``fork_row``) and as a sandbox row.

    A fork closed meanwhile lets its sandbox go instead. ``db``: the request's session, or
    the gate's writer behind the answer.
    """
    work = functools.partial(_claim_records, fork_row=fork_row, session_id=session_id, sandbox=sandbox,
                             task_id=task_id)
    claimed = await write_records(db, work)
    if not claimed:
        logger.info("fork %s was closed while starting; its sandbox %s goes", session_id, sandbox.id)
        await sessions_service._release(runtime, session_id)


def _claim_records(
    db: Session, *, fork_row: dict[str, Any] | None, session_id: str, sandbox: SandboxView, task_id: str
) -> bool:
    """Write a fork's records (see :func:`_claim`); return False if the fork was closed meanwhile."""
    if fork_row is not None:
        db.execute(_FORK_INSERT, fork_row)
    # Conditional: a fork closed (DELETE) while its sandbox was being restored stays closed.
    claimed = db.execute(
        update(_SESSION).where(_SESSION.c.id == session_id, _SESSION.c.state == SessionState.OPEN)
        .values(sandbox_id=sandbox.id, backend=sandbox.backend)
    )
    if claimed.rowcount == 0:
        return False
    db.merge(Sandbox(
        id=sandbox.id, node=sandbox.node, backend=sandbox.backend, state=SandboxStatus(sandbox.state),
        session_id=session_id, task_id=task_id, created_at=datetime.fromtimestamp(sandbox.created_at, UTC),
        owner_kind="session", owner_id=session_id,
    ))
    return True


async def _instruction(db_session: AsyncSession, task_id: str) -> str:
    """Return a task's instruction (a session's first observation), from its row: nothing is decoded."""
    return (await db_session.scalar(select(Task.instruction).where(Task.id == task_id))) or ""


def _too_many(n: int, max_open: int) -> RateLimitedError:
    return RateLimitedError(
        f"Forking {n} session(s) would exceed this gateway node's limit of {max_open} open sessions."
    )


async def _release_forks(runtime: WorkerClient, forking: asyncio.Future, session_ids: list[str]) -> None:
    """Wait for a fork whose rows did not make it, then free whatever sandboxes it started."""
    await asyncio.wait([forking])
    if not forking.cancelled():
        forking.exception()  # retrieved: the rows' failure is the one to report
    for session_id in session_ids:
        await sessions_service._release(runtime, session_id)


async def set_pinned(
    *, db_session: AsyncSession, runtime: WorkerClient, snapshot_id: str, pinned: bool
) -> SnapshotRecord:
    """Pin (keep until unpinned) or unpin a snapshot."""
    # One conditional UPDATE: a pin racing a delete either lands on a live snapshot or is a 404.
    result = await db_session.execute(
        update(SnapshotRecord)
        .where(SnapshotRecord.id == snapshot_id, SnapshotRecord.deleted_at.is_(None))
        .values(pinned=pinned)
    )
    await db_session.commit()
    if result.rowcount == 0:
        raise NotFoundError(f"Snapshot {snapshot_id!r} does not exist.")
    record = await get_snapshot(db_session=db_session, snapshot_id=snapshot_id)
    await db_session.refresh(record)
    if not pinned:
        await collect_garbage(db_session=db_session, runtime=runtime, node=record.node)
    return record


async def delete_snapshot(*, db_session: AsyncSession, runtime: WorkerClient, snapshot_id: str) -> None:
    """Delete a snapshot: freed now if nothing holds it, else once its open forks end.

    Raises:
        NotFoundError: no such snapshot.
        ConflictError: it is pinned (code ``snapshot_pinned``).
    """
    known_snapshots.drop(snapshot_id)  # no fork of this process starts from it without reading its row
    # One conditional UPDATE: a delete racing a pin never marks a pinned snapshot deleted.
    result = await db_session.execute(
        update(SnapshotRecord)
        .where(SnapshotRecord.id == snapshot_id, SnapshotRecord.deleted_at.is_(None),
               SnapshotRecord.pinned.is_(False))
        .values(deleted_at=utcnow())
    )
    await db_session.commit()
    record = await db_session.get(SnapshotRecord, snapshot_id)
    if record is None:
        raise NotFoundError(f"Snapshot {snapshot_id!r} does not exist.")
    await db_session.refresh(record)
    if result.rowcount == 0 and record.deleted_at is None:
        raise ConflictError(f"Snapshot {snapshot_id!r} is pinned; unpin it before deleting it.",
                            code="snapshot_pinned")
    await collect_garbage(db_session=db_session, runtime=runtime, node=record.node)
