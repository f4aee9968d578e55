"""Open, step, close and recover sessions; the runtime does the work, the DB keeps the record.

No database transaction stays open while the runtime works (a step can take minutes).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from sqlalchemy import bindparam, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from gateway.artifacts.service import store_artifacts
from gateway.db import new_id, utcnow, write_records
from gateway.errors import ConflictError, NotFoundError, RateLimitedError
from gateway.nodes.models import Node
from gateway.pagination import page_of, paginate
from gateway.sandboxes.models import Sandbox
from gateway.sessions.gate import SessionFacts, StepGate
from gateway.sessions.models import EnvSession, SessionState, SessionStep
from gateway.snapshots.collection import collect_garbage, live_backend_snapshot_ids
from gateway.tasks.models import Task
from gateway.tasks.service import get_task, load_task
from workers.errors import SandboxLostError, SessionClosedError, SessionNotFoundError
from workers.protocol import SandboxStatus, StepWire

if TYPE_CHECKING:
    from workers.protocol import OpenedView, StepView, WorkerClient

logger = logging.getLogger(__name__)

_SESSION = EnvSession.__table__

#: Label holding the id of the task a sandbox runs (the runtime sets LABEL_OWNER = session id
#: and "forkyard.task" = task name).
LABEL_TASK_ID = "forkyard.task_id"
#: Longest error text kept on a session row.
MAX_ERROR_CHARS = 2000


def environment_version(task: Task) -> str:
    """Return ``name@version`` of the task's environment (it keys the workers' setup cache)."""
    return f"{task.environment.name}@{task.environment.version}"


def _error_text(exc: BaseException | str) -> str:
    text = exc if isinstance(exc, str) else (str(exc) or type(exc).__name__)
    return text[:MAX_ERROR_CHARS]


async def get_session(*, db_session: AsyncSession, session_id: str) -> EnvSession:
    """Return the session with this id; raise NotFoundError if there is none."""
    row = await db_session.get(EnvSession, session_id)
    if row is None:
        raise NotFoundError(f"Session {session_id!r} does not exist.")
    return row


async def list_sessions(
    *, db_session: AsyncSession, state: SessionState | None = None, task_id: str | None = None,
    limit: int, cursor: str | None = None,
) -> tuple[list[EnvSession], str | None]:
    """Return one page of sessions, oldest first, optionally of one state or task."""
    stmt = select(EnvSession)
    if state is not None:
        stmt = stmt.where(EnvSession.state == state)
    if task_id is not None:
        stmt = stmt.where(EnvSession.task_id == task_id)
    stmt = paginate(stmt, created_at=EnvSession.created_at, id_=EnvSession.id, cursor=cursor, limit=limit)
    rows = list((await db_session.scalars(stmt)).all())
    return page_of(rows, limit=limit)


#: Most sessions a history is followed through (forks of forks); a bound on the walk.
MAX_FORK_DEPTH = 100_000


async def history_segments(db_session: AsyncSession, session_id: str) -> tuple[int, list[tuple[str, int, int]]]:
    """Return a session's step count and where its steps are: ``(session, first seq, end seq)``, oldest first.

    A fork's first ``parent_steps`` steps are its parent's (up to that point), and so on up.

    Raises:
        NotFoundError: no such session.
    """
    columns = (EnvSession.steps, EnvSession.parent_session_id, EnvSession.parent_steps)
    found = (await db_session.execute(select(*columns).where(EnvSession.id == session_id))).first()
    if found is None:
        raise NotFoundError(f"Session {session_id!r} does not exist.")
    total, parent, start = found
    segments = [(session_id, start if parent else 0, total)]
    for _ in range(MAX_FORK_DEPTH):
        if parent is None or start <= 0:
            break
        end = start
        up = (await db_session.execute(select(*columns).where(EnvSession.id == parent))).first()
        if up is None:  # cannot happen (rows are never deleted); the history starts here
            break
        _, grand, start = up
        segments.append((parent, start if grand else 0, end))
        parent = grand
    return total, segments[::-1]


async def list_steps(
    *, db_session: AsyncSession, session_id: str, start: int = 0, limit: int
) -> tuple[list[SessionStep], int, int | None]:
    """Return one page of a session's steps from ``seq`` ``start``, its step count, and the next start (or None)."""
    total, segments = await history_segments(db_session, session_id)
    end = min(total, start + limit)
    rows: list[SessionStep] = []
    for owner, lo, hi in segments:
        lo, hi = max(lo, start), min(hi, end)
        if lo >= hi:
            continue
        stmt = (select(SessionStep).where(SessionStep.session_id == owner, SessionStep.seq >= lo, SessionStep.seq < hi)
                .order_by(SessionStep.seq))
        rows.extend((await db_session.scalars(stmt)).all())
    return rows, total, end if end < total else None


_LINEAGE = select(_SESSION.c.parent_session_id, _SESSION.c.parent_steps).where(_SESSION.c.id == bindparam("id"))
_OBSERVATION = select(SessionStep.__table__.c.observation).where(
    SessionStep.__table__.c.session_id == bindparam("id"), SessionStep.__table__.c.seq == bindparam("seq"))


async def last_observation(
    db_session: AsyncSession, session_id: str, *, steps: int, parent_session_id: str | None, parent_steps: int
) -> str | None:
    """Return the observation of a session's latest step (its own or inherited), or None before any.

    Takes the session's own ``steps``/``parent_*`` columns (the caller has read them): a
    session with steps of its own costs one query, a fork without any one more per ancestor.
    """
    if steps <= 0:
        return None
    seq, owner, parent, start = steps - 1, session_id, parent_session_id, parent_steps
    for _ in range(MAX_FORK_DEPTH):
        if parent is None or seq >= start:
            break
        up = (await db_session.execute(_LINEAGE, {"id": parent})).first()
        if up is None:
            break
        owner, (parent, start) = parent, up
    return (await db_session.execute(_OBSERVATION, {"id": owner, "seq": seq})).scalar()


async def admission(*, db_session: AsyncSession, node: str) -> tuple[bool, int]:
    """Return whether ``node`` is draining and how many sessions are open on it, in one read."""
    draining = select(Node.draining).where(Node.name == node).scalar_subquery()
    open_count = select(func.count()).select_from(EnvSession).where(
        EnvSession.node == node, EnvSession.state == SessionState.OPEN
    ).scalar_subquery()
    row = (await db_session.execute(select(draining, open_count))).one()
    return bool(row[0]), int(row[1] or 0)


def draining_error(node: str) -> ConflictError:
    """Return the error that refuses new work on a draining ``node``."""
    return ConflictError(f"Node {node!r} is draining: it takes no new sessions until an operator undrains it.",
                         code="node_draining")


async def open_session(
    *, db_session: AsyncSession, runtime: WorkerClient, task_id: str, node: str, max_open: int,
    gate: StepGate | None = None,
) -> tuple[EnvSession, OpenedView]:
    """Open a session on a task: record it, have the runtime start its sandbox, record the sandbox.

    With a ``gate`` and a runtime that is the :attr:`~workers.protocol.WorkerClient.sole_gateway`,
    the gate keeps the session's facts (its snapshots then read nothing).

    Raises:
        NotFoundError: no such task.
        RateLimitedError: ``max_open`` sessions are already open on this node.
    """
    task = await get_task(db_session=db_session, task_id=task_id)
    draining, open_count = await admission(db_session=db_session, node=node)
    if draining:
        raise draining_error(node)
    if open_count >= max_open:
        raise RateLimitedError(
            f"This gateway node already runs {max_open} open sessions (its limit); close one and retry."
        )
    # The row exists (state open) before any sandbox does, so a restart's reaper keeps its sandbox.
    row = EnvSession(id=new_id("sess"), task_id=task.id, state=SessionState.OPEN, node=node, steps=0,
                     created_at=utcnow())
    db_session.add(row)
    await db_session.commit()
    try:
        env_task = None if runtime.loads_tasks else await load_task(db_session=db_session, task_id=task.id)
        opened = await runtime.open_session(
            row.id, env_task, labels={LABEL_TASK_ID: task.id}, env_version=environment_version(task)
        )
    except Exception as exc:
        logger.warning("session %s on task %s failed to open: %s", row.id, task.id, exc)
        await _finish(db_session, row.id, SessionState.FAILED, error=_error_text(exc))
        try:
            await runtime.close_session(row.id)
        except Exception:
            logger.exception("session %s: closing after a failed open also failed", row.id)
        raise
    sandbox = opened.sandbox
    row.sandbox_id = sandbox.id
    row.backend = sandbox.backend
    await db_session.merge(Sandbox(  # merge: a sandbox claimed from the warm pool may have a row already
        id=sandbox.id, node=sandbox.node, backend=sandbox.backend, state=SandboxStatus(sandbox.state),
        session_id=row.id, task_id=task.id, created_at=datetime.fromtimestamp(sandbox.created_at, UTC), owner_kind="session",
        owner_id=row.id,
    ))
    await db_session.commit()
    if gate is not None and runtime.sole_gateway:
        gate.know(row.id, SessionFacts(task_id=task.id, node=node, steps=0, observation=None))
    logger.info("session %s opened on task %s in sandbox %s (%s)", row.id, task.id, sandbox.id, sandbox.backend)
    return row, opened


async def step_session(
    *, db_session: AsyncSession, runtime: WorkerClient, session_id: str, tool: str, arguments: dict,
    gate: StepGate | None = None,
) -> StepView:
    """Apply one action; a terminated or truncated result ends the session and frees its sandbox.

    Raises:
        NotFoundError: no such session.
        ConflictError: the session is not open or was closed meanwhile (code ``session_closed``),
            or another step of it is running (``session_busy``).
        ActionError: unknown tool or bad arguments; the session stays open.
    """
    gate = gate or StepGate()
    with gate.stepping(session_id):
        try:
            return await _step_once(db_session, runtime, session_id, tool, arguments, gate)
        except ConflictError:
            raise
        except Exception as exc:
            if not gate.is_closing(session_id):
                raise
            raise ConflictError(f"Session {session_id!r} was closed while this step ran.",
                                code="session_closed") from exc


# A step's statements, built once (Core, not ORM: the ORM's per-statement work was most of a step's cost).
_STEP_READ = select(_SESSION.c.state).where(_SESSION.c.id == bindparam("id"))
_STEP_INSERT = insert(SessionStep.__table__)
# Every step that ran is counted, even one a close overtook (the close waits for its record).
_STEP_COUNT = (
    update(_SESSION).where(_SESSION.c.id == bindparam("sid"))
    .values(steps=_SESSION.c.steps + 1).returning(_SESSION.c.steps, _SESSION.c.node)
)


def _record_step(db: Session, step: dict) -> str | None:
    """Write one step's row and count it (one short transaction, whatever the history's length); return the node.

    Synchronous: :func:`~gateway.db.write_records` runs it in the gate's writer behind the
    answer, or in the request's session before it.
    """
    counted = db.execute(_STEP_COUNT, {"sid": step["session_id"]}).first()
    if counted is None:
        logger.warning("session %s is gone; its step was not recorded", step["session_id"])
        return None
    count, node = counted
    db.execute(_STEP_INSERT, {**step, "seq": count - 1})
    return node


async def _step_once(
    db_session: AsyncSession, runtime: WorkerClient, session_id: str, tool: str, arguments: dict, gate: StepGate
) -> StepView:
    # A session the runtime holds is open (it is released only after its row left ``open``,
    # and ends only inside a step, which the gate serializes): no read before the step.
    if not runtime.has_session(session_id):
        await gate.settle(session_id)  # a fork's row may still be being written
        found = (await db_session.execute(_STEP_READ, {"id": session_id})).first()
        await db_session.commit()  # end the read transaction before a step that may take minutes
        if found is None:
            raise NotFoundError(f"Session {session_id!r} does not exist.")
        if found.state != SessionState.OPEN:
            raise ConflictError(f"Session {session_id!r} is {found.state.value} and takes no more steps.",
                                code="session_closed")
    try:
        result = await runtime.step(session_id, tool, arguments)
    except SessionClosedError:
        if gate.is_closing(session_id):
            raise  # the close ends the session as closed; step_session answers session_closed
        await gate.settle(session_id)  # a fork's row may still be being written
        await _finish(db_session, session_id, SessionState.CLOSED, error="the worker had already ended the session")
        gate.forget(session_id)
        await _release(runtime, session_id)
        raise
    except SessionNotFoundError as exc:
        if gate.is_closing(session_id):
            raise
        await gate.settle(session_id)  # a fork's row may still be being written
        await _finish(db_session, session_id, SessionState.FAILED,
                      error="the worker does not know the session (it restarted or lost the sandbox)")
        gate.forget(session_id)
        await _release(runtime, session_id)
        raise ConflictError(
            f"Session {session_id!r} is no longer live on its worker (it restarted or lost the sandbox); "
            "it is marked failed.", code="session_closed",
        ) from exc
    except SandboxLostError as exc:
        if gate.is_closing(session_id):
            raise
        await gate.settle(session_id)  # a fork's row may still be being written
        await _finish(db_session, session_id, SessionState.FAILED, error=_error_text(exc))
        gate.forget(session_id)
        await _release(runtime, session_id)
        raise
    if result.reward is not None and not math.isfinite(result.reward):
        logger.warning("session %s: non-finite reward %r reported; answering null", session_id, result.reward)
        result = StepWire.of(result).model_copy(update={"reward": None})
    if result.artifacts:  # stored apart; the step links them
        links = await store_artifacts(db_session=db_session, files=result.artifacts)
        result = StepWire.of(result).model_copy(update={"info": {**result.info, "artifacts": links}, "artifacts": {}})
    step = {
        "session_id": session_id, "tool": tool, "arguments": arguments, "observation": result.observation,
        "reward": result.reward, "terminated": result.terminated, "truncated": result.truncated,
        "created_at": utcnow(),
    }
    ended = result.terminated or result.truncated
    if ended:
        gate.forget(session_id)
    else:
        gate.stepped(session_id, result.observation)
    if gate.writer is not None and not ended:
        gate.record(session_id, functools.partial(gate.writer.run, functools.partial(_record_step, step=step)))
        return result
    await gate.settle(session_id)  # the earlier steps' records first, then this one's, then the end
    node = await write_records(db_session, functools.partial(_record_step, step=step))
    if ended:
        await _finish(db_session, session_id, SessionState.TERMINATED, reward=result.reward)
        await _release(runtime, session_id)
        if node is not None:
            await _collect_snapshots(db_session, runtime, node)
        logger.info("session %s ended with reward %s (truncated=%s)", session_id, result.reward, result.truncated)
    return result


async def close_session(
    *, db_session: AsyncSession, runtime: WorkerClient, session_id: str, gate: StepGate | None = None
) -> EnvSession:
    """Close a session and destroy its sandbox; closing an ended session again is a no-op."""
    gate = gate or StepGate()
    await gate.settle(session_id)  # a fork's row may still be being written
    row = await get_session(db_session=db_session, session_id=session_id)
    await db_session.commit()
    with gate.closing(session_id):
        gate.forget(session_id)
        await runtime.close_session(session_id)
        await gate.settle(session_id)
        await _finish(db_session, session_id, SessionState.CLOSED)
    await _collect_snapshots(db_session, runtime, row.node)
    await db_session.refresh(row)
    return row


async def close_node_sessions(*, db_session: AsyncSession, runtime: WorkerClient, node: str, reason: str) -> int:
    """Close every session still open on ``node`` (at shutdown); return how many."""
    ids = await _open_session_ids(db_session, node)
    for session_id in ids:
        try:
            await runtime.close_session(session_id)
        except Exception:
            logger.exception("session %s: closing at shutdown failed", session_id)
        await _finish(db_session, session_id, SessionState.CLOSED, error=reason)
    await _collect_snapshots(db_session, runtime, node)
    return len(ids)


async def recover_node(*, db_session: AsyncSession, runtime: WorkerClient, node: str) -> None:
    """Reap every sandbox of ``node`` and fail its sessions still open (at startup, after a crash).

    A new runtime holds no environment state (shell channels, agent clocks), so a session
    open before the restart cannot be resumed: it ends ``failed`` with the reason, and its
    sandbox is destroyed rather than leaked.
    """
    open_ids = await _open_session_ids(db_session, node)
    await db_session.commit()
    reaped = await runtime.reap(keep_owner_ids=set())
    if reaped:
        logger.info("reaped %d orphan sandbox(es) on node %s: %s", len(reaped), node, ", ".join(reaped))
    keep = await live_backend_snapshot_ids(db_session=db_session, node=node)
    await db_session.commit()
    await runtime.sweep_transient_snapshots(keep_session_snapshots=keep)
    for session_id in open_ids:
        await _finish(db_session, session_id, SessionState.FAILED,
                      error="the gateway restarted while the session was open; its sandbox was reaped")
    if open_ids:
        logger.warning("marked %d session(s) failed after a restart: %s", len(open_ids), ", ".join(open_ids))
    await db_session.execute(
        update(Sandbox)
        .where(Sandbox.node == node, Sandbox.gone_at.is_(None))
        .values(state=SandboxStatus.GONE, gone_at=utcnow())
    )
    await db_session.commit()
    await _collect_snapshots(db_session, runtime, node)


async def fail_node_sessions(*, db_session: AsyncSession, node: str, error: str) -> int:
    """End every session still open on ``node`` as ``failed`` with ``error`` (a node found down); return how many."""
    open_ids = await _open_session_ids(db_session, node)
    await db_session.commit()
    for session_id in open_ids:
        await _finish(db_session, session_id, SessionState.FAILED, error=error)
    if open_ids:
        logger.warning("node %s: marked %d open session(s) failed: %s", node, len(open_ids), error)
    return len(open_ids)


async def _open_session_ids(db_session: AsyncSession, node: str) -> list[str]:
    stmt = select(EnvSession.id).where(EnvSession.node == node, EnvSession.state == SessionState.OPEN)
    return list((await db_session.scalars(stmt)).all())


async def _finish(
    db_session: AsyncSession, session_id: str, state: SessionState, *,
    error: str | None = None, reward: float | None = None,
) -> None:
    """Move an open session to ``state`` and mark its sandboxes gone (no-op if it is not open)."""
    now = utcnow()
    values: dict = {"state": state, "closed_at": now}
    if error is not None:
        values["error"] = error
    if reward is not None:
        values["reward"] = reward
    await db_session.execute(
        update(EnvSession).where(EnvSession.id == session_id, EnvSession.state == SessionState.OPEN).values(**values)
    )
    await _mark_sandboxes_gone(db_session, [session_id], now)
    await db_session.commit()


async def _mark_sandboxes_gone(db_session: AsyncSession, session_ids: Iterable[str], now: datetime) -> None:
    await db_session.execute(
        update(Sandbox)
        .where(Sandbox.session_id.in_(list(session_ids)), Sandbox.gone_at.is_(None))
        .values(state=SandboxStatus.GONE, gone_at=now)
    )


async def _collect_snapshots(db_session: AsyncSession, runtime: WorkerClient, node: str) -> None:
    """Free deleted snapshots an ended session was the last holder of, logging rather than raising."""
    try:
        await collect_garbage(db_session=db_session, runtime=runtime, node=node)
    except Exception:
        logger.exception("collecting snapshots on node %s failed", node)


async def _release(runtime: WorkerClient, session_id: str) -> None:
    """Have the runtime close the session (destroying its sandbox), logging rather than raising."""
    try:
        await runtime.close_session(session_id)
    except Exception:
        logger.exception("session %s: closing in the runtime failed", session_id)
