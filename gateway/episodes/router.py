"""``/v1/episodes`` routes: list, detail (messages and steps) and the training view."""

from __future__ import annotations

from fastapi import APIRouter, Query

from gateway.dependencies import DbSession
from gateway.episodes import service
from gateway.episodes.schemas import (
    EpisodeDetail,
    EpisodePage,
    EpisodeRead,
    EpisodeTraining,
    EpisodeTree,
    StepRead,
)
from gateway.pagination import DEFAULT_LIMIT, MAX_LIMIT
from workers.protocol import EpisodeStatus

router = APIRouter(prefix="/episodes", tags=["episodes"])


@router.get("", response_model=EpisodePage)
async def list_episodes(
    db_session: DbSession,
    rollout_id: str | None = None,
    status: EpisodeStatus | None = None,
    group_id: str | None = None,
    task_id: str | None = None,
    limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT),
    cursor: str | None = None,
):
    """List episodes, oldest first, optionally of one rollout, status, group or task."""
    rows, next_cursor = await service.list_episodes(
        db_session=db_session, rollout_id=rollout_id or None, status=status, group_id=group_id or None,
        task_id=task_id or None, limit=limit, cursor=cursor or None,
    )
    return EpisodePage(items=[EpisodeRead.model_validate(r) for r in rows], next=next_cursor)


@router.get("/{episode_id}", response_model=EpisodeDetail)
async def get_episode(episode_id: str, db_session: DbSession, tokens: bool = False):
    """Return an episode with its messages and steps (with each step's token arrays if ``tokens``).

    A branch of a trajectory tree lists its whole root-to-leaf path; ``episode_id`` on each
    step names the episode that ran it.
    """
    row = await service.get_episode(db_session=db_session, episode_id=episode_id)
    steps = await service.get_path_steps(db_session=db_session, episode=row)
    return EpisodeDetail(
        **EpisodeRead.model_validate(row).model_dump(),
        messages=list(row.messages or []), timings=dict(row.timings or {}),
        weight_versions=list(row.weight_versions or []), info=dict(row.info or {}),
        dead_letter_reason=row.dead_letter_reason,
        steps=[
            StepRead(episode_id=s.episode_id, index=s.index, parent_index=s.parent_index, text=s.text, action=s.action,
                     parse_error=s.parse_error, observation=s.observation, reward=s.reward,
                     finish_reason=s.finish_reason, weight_version=s.weight_version, timings=dict(s.timings or {}),
                     server=s.server, artifacts=list(s.artifacts or []), num_prompt_tokens=len(s.prompt_ids or []),
                     num_completion_tokens=len(s.completion_ids or []),
                     **({"prompt_ids": s.prompt_ids, "completion_ids": s.completion_ids, "logprobs": s.logprobs}
                        if tokens else {}))
            for s in steps
        ],
    )


@router.get("/{episode_id}/training", response_model=EpisodeTraining)
async def get_training(episode_id: str, db_session: DbSession):
    """Return the token-exact training view: input_ids, loss_mask, logprobs, reward, group_id."""
    return await service.get_training(db_session=db_session, episode_id=episode_id)


@router.get("/{episode_id}/tree", response_model=EpisodeTree)
async def get_tree(episode_id: str, db_session: DbSession):
    """Return the trajectory tree the episode belongs to: nodes (steps), edges, leaves with rewards."""
    return await service.get_tree(db_session=db_session, episode_id=episode_id)
