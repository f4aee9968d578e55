"""``/v1/rollouts`` routes: create, list, read, cancel, and the delivery stream (pull, ack, SSE, dead letters)."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from gateway.dependencies import CurrentSettings, DbSession
from gateway.episodes.schemas import EpisodeRead
from gateway.errors import BadRequestError, InvalidRequestError
from gateway.pagination import DEFAULT_LIMIT, MAX_LIMIT
from gateway.policies.service import check_inference_servers
from gateway.rollouts import delivery, service
from gateway.rollouts.executor import Executor
from gateway.rollouts.models import DeliveryInclude, Rollout, RolloutStatus
from gateway.rollouts.schemas import (
    CONSUMER_PATTERN,
    MAX_SEQ,
    AckRequest,
    AckResponse,
    DeadLetter,
    DeadLetterPage,
    GroupModeSpec,
    PullRequest,
    PullResponse,
    RolloutCreate,
    RolloutPage,
    RolloutProgress,
    RolloutRead,
)

router = APIRouter(prefix="/rollouts", tags=["rollouts"])


def _executor(request: Request) -> Executor | None:
    """Return the app's executor (``app.state.executor``), or None where none runs."""
    return getattr(request.app.state, "executor", None)


def _submit(request: Request, rollout_id: str) -> None:
    executor = _executor(request)
    if executor is not None:
        executor.submit(rollout_id)


async def _read_all(db_session: DbSession, rows: list[Rollout]) -> list[RolloutRead]:
    stats = await service.rollout_stats(db_session=db_session, rollouts=rows)
    return [
        RolloutRead(
            id=r.id, status=r.status, group_size=r.group_size, task_ids=list(r.task_ids or []), policy=r.policy,
            agent=r.agent, limits=r.limits, max_staleness=r.max_staleness, staleness_action=r.staleness_action,
            max_attempts=r.max_attempts, group_mode=GroupModeSpec(mode=r.group_mode, min_group_size=r.min_group_size),
            group_spare=r.group_spare, priority=r.priority, concurrency=r.concurrency, branching=r.branching,
            lazy_fork=r.lazy_fork, counts=stats[r.id].counts, progress=RolloutProgress(**stats[r.id].progress),
            failures=stats[r.id].failures, partial_groups=stats[r.id].partial_groups, created_at=r.created_at,
            started_at=r.started_at, finished_at=r.finished_at, error=r.error,
        )
        for r in rows
    ]


@router.post("", status_code=201, response_model=RolloutRead)
async def create_rollout(body: RolloutCreate, request: Request, db_session: DbSession, settings: CurrentSettings):
    """Create a rollout: group_size queued episodes for each task."""
    check_inference_servers([str(u) for u in body.policy.base_urls], allowed=settings.policy_hosts)
    row = await service.create_rollout(db_session=db_session, spec=body)
    _submit(request, row.id)
    return (await _read_all(db_session, [row]))[0]


@router.get("", response_model=RolloutPage)
async def list_rollouts(
    db_session: DbSession,
    status: RolloutStatus | None = None,
    limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT),
    cursor: str | None = None,
):
    """List rollouts, oldest first, optionally of one status."""
    rows, next_cursor = await service.list_rollouts(db_session=db_session, status=status, limit=limit,
                                                    cursor=cursor or None)
    return RolloutPage(items=await _read_all(db_session, rows), next=next_cursor)


@router.get("/{rollout_id}", response_model=RolloutRead)
async def get_rollout(rollout_id: str, db_session: DbSession):
    """Return a rollout with its episode counts and progress."""
    row = await service.get_rollout(db_session=db_session, rollout_id=rollout_id)
    return (await _read_all(db_session, [row]))[0]


@router.post("/{rollout_id}/cancel", response_model=RolloutRead)
async def cancel_rollout(rollout_id: str, request: Request, db_session: DbSession):
    """Cancel a rollout: queued episodes fail as cancelled, running ones are stopped."""
    row = await service.cancel_rollout(db_session=db_session, rollout_id=rollout_id)
    executor = _executor(request)
    if executor is not None:
        await executor.cancel(rollout_id)
    return (await _read_all(db_session, [row]))[0]


@router.delete("/{rollout_id}", status_code=204)
async def delete_rollout(rollout_id: str, db_session: DbSession) -> None:
    """Delete a finished (completed, cancelled or failed) rollout and everything it stored."""
    await service.delete_rollout(db_session=db_session, rollout_id=rollout_id)


@router.post("/{rollout_id}/pull", response_model=PullResponse)
async def pull(rollout_id: str, body: PullRequest, request: Request, db_session: DbSession):
    """Take episodes off the stream: expired leases first, then new entries; long-poll up to wait_s."""
    result = await delivery.pull_episodes(
        db_session=db_session, rollout_id=rollout_id, consumer=body.consumer, max_episodes=body.max_episodes,
        wait_s=body.wait_s, visibility_timeout_s=body.visibility_timeout_s, cursor=body.cursor,
        redeliver=body.redeliver, include_failed=DeliveryInclude.FAILED in body.include,
    )
    if result.reopened:  # stale entries were rerun: the rollout has queued episodes again
        _submit(request, rollout_id)
    return PullResponse(episodes=result.episodes, cursor=result.cursor, done=result.done)


@router.post("/{rollout_id}/ack", response_model=AckResponse)
async def ack(rollout_id: str, body: AckRequest, db_session: DbSession):
    """Acknowledge delivered episodes; they are never delivered to this consumer again."""
    acked = await delivery.ack_episodes(db_session=db_session, rollout_id=rollout_id, consumer=body.consumer,
                                        episode_ids=body.episode_ids)
    return AckResponse(acked=acked)


_SSE_DOC = {"responses": {200: {"description": "Server-sent events: `episodes` batches, then `end`.",
                                "content": {"text/event-stream": {"schema": {"type": "string"}}}}}}


@router.get("/{rollout_id}/stream", response_class=StreamingResponse, openapi_extra=_SSE_DOC)
async def stream(
    rollout_id: str,
    request: Request,
    db_session: DbSession,
    consumer: str = Query(min_length=1, max_length=200),
    batch_size: int = Query(16, ge=1, le=1024),
    visibility_timeout_s: float = Query(60.0, ge=0.0, le=43_200.0),
    cursor: int | None = Query(None, ge=0, le=MAX_SEQ, description="Last seq received; overrides Last-Event-ID."),
    redeliver: bool = Query(False, description="Redeliver every pending (unacked) episode at once."),
    include: Annotated[list[DeliveryInclude] | None, Query(
        description="failed: also deliver the failed episodes, masked (reward null, loss_mask all zeros, with outcome "
                    "and error).")] = None,
    last_event_id: str | None = Header(None),
):
    """Stream finished episodes as server-sent events (reconnect with Last-Event-ID or ?cursor=)."""
    if not re.match(CONSUMER_PATTERN, consumer):
        raise InvalidRequestError(f"Consumer name {consumer[:80]!r} is not valid; use letters, digits and ._:@-.")
    if cursor is None and last_event_id:
        try:
            cursor = int(last_event_id)
        except ValueError as exc:
            raise BadRequestError(f"Last-Event-ID {last_event_id[:40]!r} is not a stream position.") from exc
        if not 0 <= cursor <= MAX_SEQ:
            raise BadRequestError(f"Last-Event-ID {last_event_id[:40]!r} is not a stream position (0 to 2**62).")
    await service.get_rollout(db_session=db_session, rollout_id=rollout_id)
    await db_session.commit()
    events = delivery.stream_events(
        sessionmaker=request.app.state.sessionmaker, rollout_id=rollout_id, consumer=consumer,
        batch_size=batch_size, visibility_timeout_s=visibility_timeout_s, cursor=cursor, redeliver=redeliver,
        include_failed=DeliveryInclude.FAILED in (include or ()), is_disconnected=request.is_disconnected,
        on_reopen=lambda: _submit(request, rollout_id),
    )
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.get("/{rollout_id}/dead_letters", response_model=DeadLetterPage)
async def dead_letters(
    rollout_id: str,
    db_session: DbSession,
    limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT),
    cursor: str | None = None,
):
    """List the rollout's episodes that will never be delivered, with the reason."""
    rows, next_cursor = await service.list_dead_letters(db_session=db_session, rollout_id=rollout_id, limit=limit,
                                                        cursor=cursor or None)
    items = [DeadLetter(**EpisodeRead.model_validate(r).model_dump(), reason=r.dead_letter_reason or "")
             for r in rows]
    return DeadLetterPage(items=items, next=next_cursor)
