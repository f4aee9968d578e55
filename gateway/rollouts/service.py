"""Create, read, list, cancel and fail rollouts; count their episodes; list their dead letters."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db import new_id, utcnow
from gateway.environments.service import get_environment_by_name
from gateway.episodes.models import Episode, EpisodeStep
from gateway.episodes.service import lock_rollout, settle_cancelled
from gateway.errors import ConflictError, InvalidRequestError, NotFoundError
from gateway.logs import register_secret
from gateway.pagination import page_of, paginate
from gateway.policies.service import ensure_policy
from gateway.rollouts.events import rollout_events
from gateway.rollouts.models import (
    ACTIVE_EPISODE_STATUSES,
    FAILURE_OUTCOMES,
    DeliveryConsumer,
    DeliveryLease,
    DeliveryState,
    EpisodeGroup,
    EpisodeStatus,
    Rollout,
    RolloutStatus,
)
from gateway.rollouts.schemas import (
    MAX_EPISODES_PER_ROLLOUT,
    RolloutCreate,
    TaskSelection,
)
from gateway.tasks.models import Task

logger = logging.getLogger(__name__)

#: Ids per IN (...) clause (SQLite and PostgreSQL both cap bound parameters).
CHUNK = 1000
#: Episode rows per bulk INSERT.
INSERT_BATCH = 2000


def _names(values: Sequence[str], *, limit: int = 10) -> str:
    shown = ", ".join(repr(v) for v in values[:limit])
    return shown + (f" and {len(values) - limit} more" if len(values) > limit else "")


async def _resolve_tasks(db_session: AsyncSession, selection: TaskSelection) -> list[tuple[str, str]]:
    """Return (task id, task name) for each selected task, in request order."""
    if selection.ids is not None:
        ids = selection.ids
        seen: set[str] = set()
        duplicates = [i for i in ids if i in seen or seen.add(i)]  # type: ignore[func-returns-value]
        if duplicates:
            raise InvalidRequestError(
                f"tasks lists {_names(sorted(set(duplicates)))} more than once; raise group_size for more samples "
                "of one task.")
        found: dict[str, str] = {}
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start:start + CHUNK]
            for task_id, name in (await db_session.execute(
                    select(Task.id, Task.name).where(Task.id.in_(chunk)))).all():
                found[task_id] = name
        missing = [i for i in ids if i not in found]
        if missing:
            raise InvalidRequestError(f"Unknown task id(s): {_names(missing)}; import them with POST /v1/tasks.",
                                      code="unknown_tasks")
        return [(i, found[i]) for i in ids]
    assert selection.environment is not None
    env = await get_environment_by_name(db_session=db_session, name=selection.environment)
    if env is None:
        raise InvalidRequestError(f"Environment {selection.environment!r} does not exist.", code="unknown_environment")
    newest: dict[str, tuple[Any, str]] = {}
    stmt = select(Task.id, Task.name, Task.created_at).where(Task.environment_id == env.id)
    names = selection.names
    if names is not None:
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise InvalidRequestError(f"tasks.names lists {_names(dup)} more than once; raise group_size for more "
                                      "samples of one task.")
        rows: list[Any] = []
        for start in range(0, len(names), CHUNK):
            rows.extend((await db_session.execute(stmt.where(Task.name.in_(names[start:start + CHUNK])))).all())
    else:
        rows = list((await db_session.execute(stmt)).all())
    for task_id, name, created_at in rows:
        if name not in newest or (created_at, task_id) > newest[name][0]:
            newest[name] = ((created_at, task_id), task_id)
    if names is None:
        if not newest:
            raise InvalidRequestError(f"Environment {selection.environment!r} has no tasks; import some first.",
                                      code="unknown_tasks")
        names = sorted(newest)
    missing = [n for n in names if n not in newest]
    if missing:
        raise InvalidRequestError(
            f"Environment {selection.environment!r} has no task named {_names(missing)}.", code="unknown_tasks")
    return [(newest[n][1], n) for n in names]


async def create_rollout(*, db_session: AsyncSession, spec: RolloutCreate) -> Rollout:
    """Create a rollout and its episodes: one group per task, ``group_size + group_spare`` queued episodes each.

    Raises:
        InvalidRequestError: a task id or name is unknown or repeated (code ``unknown_tasks``
            names them), or the rollout asks for too many episodes.
    """
    tasks = await _resolve_tasks(db_session, spec.tasks)
    samples = spec.group_size + spec.group_spare
    total = len(tasks) * samples
    per_tree = spec.branching.tree_episodes if spec.branching is not None else 1
    if total * per_tree > MAX_EPISODES_PER_ROLLOUT:
        trees = f" x up to {per_tree} per tree" if spec.branching is not None else ""
        spare = f" + group_spare {spec.group_spare}" if spec.group_spare else ""
        raise InvalidRequestError(f"The rollout asks for {total * per_tree} episodes ({len(tasks)} tasks x "
                                  f"group_size {spec.group_size}{spare}{trees}); the limit is "
                                  f"{MAX_EPISODES_PER_ROLLOUT}.")
    await ensure_policy(db_session=db_session, name=spec.policy.name)
    register_secret(spec.policy.secret_api_key())
    now = utcnow()
    rollout = Rollout(
        id=new_id("ro"), status=RolloutStatus.QUEUED, policy_name=spec.policy.name, group_size=spec.group_size,
        task_ids=[task_id for task_id, _ in tasks], policy=spec.policy.to_dict(),
        policy_api_key=spec.policy.secret_api_key(),
        agent=spec.agent.model_dump(mode="json"), limits=spec.limits.model_dump(mode="json"),
        max_staleness=spec.max_staleness, staleness_action=spec.staleness_action, max_attempts=spec.max_attempts,
        group_mode=spec.group_mode.mode, min_group_size=spec.group_mode.min_group_size,
        group_spare=spec.group_spare, priority=spec.priority,
        concurrency=spec.concurrency, last_seq=0, created_at=now, updated_at=now,
        branching=spec.branching.stored() if spec.branching is not None else None,
        lazy_fork=spec.lazy_fork,
    )
    db_session.add(rollout)
    groups: list[dict[str, Any]] = []
    episodes: list[dict[str, Any]] = []
    branching = spec.branching is not None
    for task_index, (task_id, _) in enumerate(tasks):
        group_id = ""
        for sample_index in range(samples):
            if not group_id or branching:  # a branching rollout's group is one tree (one sample)
                group_id = new_id("grp")
                groups.append({"id": group_id, "rollout_id": rollout.id, "task_id": task_id, "created_at": now,
                               "updated_at": now, "released_at": None})
            episode_id = new_id("ep")
            episodes.append({
                "id": episode_id, "rollout_id": rollout.id, "group_id": group_id, "task_id": task_id,
                "task_index": task_index, "sample_index": sample_index, "attempt": 1, "status": EpisodeStatus.QUEUED,
                "messages": [], "timings": {}, "weight_versions": [], "info": {}, "num_turns": 0,
                "created_at": now, "root_episode_id": episode_id if branching else None,
            })
    await db_session.flush()
    for start in range(0, len(groups), INSERT_BATCH):
        await db_session.execute(insert(EpisodeGroup), groups[start:start + INSERT_BATCH])
    for start in range(0, len(episodes), INSERT_BATCH):
        await db_session.execute(insert(Episode), episodes[start:start + INSERT_BATCH])
    await db_session.commit()
    logger.info("rollout %s created: %d task(s) x %d = %d episode(s), policy %s (%s)", rollout.id, len(tasks),
                samples, total, spec.policy.name, spec.policy.api)
    return rollout


async def get_rollout(*, db_session: AsyncSession, rollout_id: str) -> Rollout:
    """Return the rollout with this id; raise NotFoundError if there is none."""
    row = await db_session.get(Rollout, rollout_id, populate_existing=True)
    if row is None:
        raise NotFoundError(f"Rollout {rollout_id!r} does not exist.")
    return row


async def list_rollouts(
    *, db_session: AsyncSession, status: RolloutStatus | None = None, limit: int, cursor: str | None = None
) -> tuple[list[Rollout], str | None]:
    """Return one page of rollouts, oldest first, optionally of one status."""
    stmt = select(Rollout)
    if status is not None:
        stmt = stmt.where(Rollout.status == status)
    stmt = paginate(stmt, created_at=Rollout.created_at, id_=Rollout.id, cursor=cursor, limit=limit)
    rows = list((await db_session.scalars(stmt)).all())
    return page_of(rows, limit=limit)


async def list_active_rollouts(*, db_session: AsyncSession) -> list[Rollout]:
    """Return the queued and running rollouts, highest priority first, then oldest (dispatch order)."""
    stmt = (select(Rollout).where(Rollout.status.in_([RolloutStatus.QUEUED, RolloutStatus.RUNNING]))
            .order_by(Rollout.priority.desc(), Rollout.created_at, Rollout.id))
    return list((await db_session.scalars(stmt)).all())


@dataclass(frozen=True)
class RolloutStats:
    """What a rollout's episodes and groups add up to (see :class:`~gateway.rollouts.schemas.RolloutRead`)."""

    counts: dict[str, int]
    """Episode rows by status."""
    progress: dict[str, int]
    """Samples in total, finished, streamed and delivered."""
    failures: dict[str, int]
    """Failed episode rows by failure outcome."""
    partial_groups: int
    """Groups released short of usable samples."""


async def rollout_stats(*, db_session: AsyncSession, rollouts: Sequence[Rollout]) -> dict[str, RolloutStats]:
    """Return the stats of each rollout by id: episode counts, progress, failures by outcome, partial groups."""
    ids = [r.id for r in rollouts]
    counts: dict[str, dict[str, int]] = {i: {} for i in ids}
    failures: dict[str, dict[str, int]] = {i: {} for i in ids}
    active_samples: dict[str, int] = dict.fromkeys(ids, 0)
    streamed: dict[str, int] = dict.fromkeys(ids, 0)
    delivered: dict[str, int] = dict.fromkeys(ids, 0)
    partial: dict[str, int] = dict.fromkeys(ids, 0)
    training = Episode.status != EpisodeStatus.FAILED  # failed episodes are streamed only to those asking, masked
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start:start + CHUNK]
        for rollout_id, status, n in (await db_session.execute(
                select(Episode.rollout_id, Episode.status, func.count())
                .where(Episode.rollout_id.in_(chunk)).group_by(Episode.rollout_id, Episode.status))).all():
            counts[rollout_id][EpisodeStatus(status).value] = int(n)
        for rollout_id, outcome, n in (await db_session.execute(
                select(Episode.rollout_id, Episode.outcome, func.count())
                .where(Episode.rollout_id.in_(chunk), Episode.status == EpisodeStatus.FAILED,
                       Episode.outcome.in_(list(FAILURE_OUTCOMES)))
                .group_by(Episode.rollout_id, Episode.outcome))).all():
            failures[rollout_id][outcome.value] = int(n)
        # A sample (a tree in a branching rollout) is unfinished while any of its episodes is queued or running.
        samples = (select(Episode.rollout_id, Episode.group_id, Episode.sample_index)
                   .where(Episode.rollout_id.in_(chunk), Episode.status.in_(list(ACTIVE_EPISODE_STATUSES)))
                   .distinct().subquery())
        for rollout_id, n in (await db_session.execute(
                select(samples.c.rollout_id, func.count()).group_by(samples.c.rollout_id))).all():
            active_samples[rollout_id] = int(n)
        for rollout_id, n in (await db_session.execute(
                select(Episode.rollout_id, func.count())
                .where(Episode.rollout_id.in_(chunk), Episode.seq.is_not(None), training)
                .group_by(Episode.rollout_id))).all():
            streamed[rollout_id] = int(n)
        for rollout_id, n in (await db_session.execute(
                select(DeliveryLease.rollout_id, func.count(func.distinct(DeliveryLease.episode_id)))
                .join(Episode, Episode.id == DeliveryLease.episode_id)
                .where(DeliveryLease.rollout_id.in_(chunk), DeliveryLease.state == DeliveryState.ACKED, training)
                .group_by(DeliveryLease.rollout_id))).all():
            delivered[rollout_id] = int(n)
        for rollout_id, n in (await db_session.execute(
                select(EpisodeGroup.rollout_id, func.count())
                .where(EpisodeGroup.rollout_id.in_(chunk), EpisodeGroup.partial.is_(True))
                .group_by(EpisodeGroup.rollout_id))).all():
            partial[rollout_id] = int(n)
    stats: dict[str, RolloutStats] = {}
    for rollout in rollouts:
        total = len(rollout.task_ids or []) * (rollout.group_size + rollout.group_spare)
        progress = {"total": total, "finished": total - active_samples[rollout.id], "streamed": streamed[rollout.id],
                    "delivered": delivered[rollout.id]}
        stats[rollout.id] = RolloutStats(counts=counts[rollout.id], progress=progress, failures=failures[rollout.id],
                                         partial_groups=partial[rollout.id])
    return stats


async def _stop(
    db_session: AsyncSession, rollout_id: str, status: RolloutStatus, reason: str, error: str | None
) -> Rollout:
    rollout = await lock_rollout(db_session, rollout_id)
    if rollout.status == status:
        await db_session.rollback()
        return await get_rollout(db_session=db_session, rollout_id=rollout_id)
    if rollout.status in (RolloutStatus.COMPLETED, RolloutStatus.CANCELLED, RolloutStatus.FAILED):
        current = rollout.status.value
        await db_session.rollback()
        raise ConflictError(f"Rollout {rollout_id!r} is already {current}.", code="rollout_finished")
    now = utcnow()
    rollout.status = status
    rollout.finished_at = now
    rollout.error = error
    failed = await settle_cancelled(db_session=db_session, rollout=rollout, status=status, reason=reason, now=now)
    await db_session.commit()
    rollout_events.notify(rollout_id)
    logger.info("rollout %s %s: %d queued episode(s) will not run", rollout_id, status.value, failed)
    return rollout


async def cancel_rollout(*, db_session: AsyncSession, rollout_id: str) -> Rollout:
    """Cancel a rollout: its queued episodes fail (termination ``cancelled``), no new one starts.

    Running episodes are stopped by the dispatcher and finished as usual; groups that end
    are still released, so nothing already done is lost. Cancelling twice is a no-op.

    Raises:
        NotFoundError: no such rollout.
        ConflictError: the rollout already completed or failed (code ``rollout_finished``).
    """
    return await _stop(db_session, rollout_id, RolloutStatus.CANCELLED, "the rollout was cancelled", None)


async def fail_rollout(*, db_session: AsyncSession, rollout_id: str, error: str) -> Rollout:
    """Fail a rollout the dispatcher cannot run (``error`` says why); its queued episodes fail with it."""
    return await _stop(db_session, rollout_id, RolloutStatus.FAILED, f"the rollout failed: {error}", error)


async def delete_rollout(*, db_session: AsyncSession, rollout_id: str) -> None:
    """Delete a finished rollout with its episodes, steps, groups and delivery state.

    The snapshots its trajectory trees took are already gone (a tree frees them when its
    last branch ends), so nothing on the sandbox side outlives it.

    Raises:
        NotFoundError: no such rollout.
        ConflictError: the rollout is still queued or running (code ``rollout_active``); cancel it first.
    """
    rollout = await lock_rollout(db_session, rollout_id)
    if rollout.status not in (RolloutStatus.COMPLETED, RolloutStatus.CANCELLED, RolloutStatus.FAILED):
        status = rollout.status.value
        await db_session.rollback()
        raise ConflictError(f"Rollout {rollout_id!r} is {status}; cancel it before deleting it.",
                            code="rollout_active")
    episodes = select(Episode.id).where(Episode.rollout_id == rollout_id).scalar_subquery()
    await db_session.execute(delete(DeliveryLease).where(DeliveryLease.rollout_id == rollout_id))
    await db_session.execute(delete(DeliveryConsumer).where(DeliveryConsumer.rollout_id == rollout_id))
    await db_session.execute(delete(EpisodeStep).where(EpisodeStep.episode_id.in_(episodes)))
    await db_session.execute(delete(Episode).where(Episode.rollout_id == rollout_id))
    await db_session.execute(delete(EpisodeGroup).where(EpisodeGroup.rollout_id == rollout_id))
    await db_session.execute(delete(Rollout).where(Rollout.id == rollout_id))
    await db_session.commit()
    logger.info("rollout %s deleted", rollout_id)


async def list_dead_letters(
    *, db_session: AsyncSession, rollout_id: str, limit: int, cursor: str | None = None
) -> tuple[list[Episode], str | None]:
    """Return one page of a rollout's dead letters: failed or stale episodes that will never be delivered."""
    await get_rollout(db_session=db_session, rollout_id=rollout_id)
    stmt = select(Episode).where(Episode.rollout_id == rollout_id, Episode.dead_letter_reason.is_not(None))
    stmt = paginate(stmt, created_at=Episode.created_at, id_=Episode.id, cursor=cursor, limit=limit)
    rows = list((await db_session.scalars(stmt)).all())
    return page_of(rows, limit=limit)
