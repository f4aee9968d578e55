"""``/v1/sessions`` routes: open, step, read, list, close."""

from __future__ import annotations

from fastapi import APIRouter, Query, Response

from gateway.dependencies import CurrentSettings, DbSession, Gate, Runtime, SessionNode
from gateway.pagination import DEFAULT_LIMIT, MAX_LIMIT
from gateway.sessions import service
from gateway.sessions.models import SessionState
from gateway.sessions.schemas import (
    Action,
    SessionCreate,
    SessionCreated,
    SessionPage,
    SessionRead,
    SessionStep,
    StepPage,
    StepRead,
    StepRecord,
)

router = APIRouter(prefix="/sessions", tags=["sessions"])


@router.post("", status_code=201, response_model=SessionCreated)
async def open_session(
    body: SessionCreate, db_session: DbSession, runtime: Runtime, settings: CurrentSettings, node: SessionNode,
    gate: Gate,
):
    """Open a session on a task; answers its first observation and tools."""
    row, opened = await service.open_session(
        db_session=db_session, runtime=runtime, task_id=body.task_id, node=node,
        max_open=settings.sessions.max_open, gate=gate,
    )
    return SessionCreated(
        id=row.id, task_id=row.task_id, state=row.state, observation=opened.observation, tools=opened.tools,
        sandbox_id=row.sandbox_id, created_at=row.created_at,
    )


@router.post("/{session_id}/step", response_model=StepRead)
async def step_session(
    session_id: str, body: SessionStep, db_session: DbSession, runtime: Runtime, gate: Gate
):
    """Apply one action (a tool call) and answer the observation, reward and end flags.

    One step at a time: a step sent while another of the session runs gets 409 ``session_busy``.
    """
    result = await service.step_session(
        db_session=db_session, runtime=runtime, session_id=session_id,
        tool=body.action.tool, arguments=body.action.arguments, gate=gate,
    )
    return StepRead(observation=result.observation, reward=result.reward, terminated=result.terminated,
                    truncated=result.truncated, info=result.info)


@router.get("", response_model=SessionPage)
async def list_sessions(
    db_session: DbSession,
    gate: Gate,
    state: SessionState | None = None,
    task_id: str | None = None,
    limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT),
    cursor: str | None = None,
):
    """List sessions, oldest first, optionally of one state or task."""
    await gate.settle()
    rows, next_cursor = await service.list_sessions(
        db_session=db_session, state=state, task_id=task_id or None, limit=limit, cursor=cursor
    )
    return SessionPage(items=[SessionRead.model_validate(r) for r in rows], next=next_cursor)


@router.get("/{session_id}", response_model=SessionRead)
async def get_session(session_id: str, db_session: DbSession, gate: Gate):
    """Return the gateway's record of one session (its steps: ``GET /v1/sessions/{id}/steps``)."""
    await gate.settle(session_id)
    return await service.get_session(db_session=db_session, session_id=session_id)


@router.get("/{session_id}/steps", response_model=StepPage)
async def list_steps(
    session_id: str,
    db_session: DbSession,
    gate: Gate,
    limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT),
    cursor: str | None = Query(None, pattern=r"^[0-9]{1,18}$", description="A page's ``next``: the seq to start at."),
):
    """Page a session's steps, oldest first: a fork's inherited steps, then its own."""
    await gate.settle()  # a fork's inherited steps are another session's
    rows, total, following = await service.list_steps(
        db_session=db_session, session_id=session_id, start=int(cursor or 0), limit=limit
    )
    items = [
        StepRecord(seq=r.seq, session_id=r.session_id, action=Action(tool=r.tool, arguments=r.arguments),
                   observation=r.observation, reward=r.reward, terminated=r.terminated, truncated=r.truncated,
                   created_at=r.created_at)
        for r in rows
    ]  # fmt: skip
    return StepPage(items=items, steps=total, next=None if following is None else str(following))


@router.delete("/{session_id}", status_code=204, response_class=Response)
async def close_session(session_id: str, db_session: DbSession, runtime: Runtime, gate: Gate):
    """Close the session and destroy its sandbox (idempotent); a step it interrupts answers 409 ``session_closed``."""
    await service.close_session(db_session=db_session, runtime=runtime, session_id=session_id, gate=gate)
    return Response(status_code=204)
