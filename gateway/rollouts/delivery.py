"""The durable delivery stream of a rollout: consumer groups, leases, acks, redelivery, SSE.

Everything lives in the database, so a gateway restart loses nothing.

- An episode enters its rollout's stream when its group is released
  (``episodes.service.release_group_if_ready``): it gets ``seq``, its position (1, 2, ...).
  The group's failed attempts with a failure outcome (infra, verifier_error, policy_error)
  enter it too, after its usable episodes, but only a delivery asking for them
  (``include_failed``) hands them out, masked (reward None, loss_mask all zeros); any other
  delivery passes over them as over a withdrawn entry. Either way they take a ``seq``, a
  lease and an ack like every entry, so ``done`` waits for them only where they were delivered.
- A consumer (group) is a name per rollout with ``last_delivered_seq``: every entry at or
  below it has been handed to that consumer once. A new consumer starts at 0 (everything).
- A delivery hands out (1) entries leased to this consumer whose lease expired
  (redelivery), oldest first, then (2) entries after ``last_delivered_seq``; each gets a
  lease of ``visibility_timeout_s`` (0 makes it redeliverable at once).
- An ack settles a pending lease for good: an acked entry is never delivered to that
  consumer again. Unknown, repeated or late (already settled) acks count 0.
- Staleness is checked again at delivery: an entry whose oldest turn lags the policy's
  current version by more than ``max_staleness`` is not delivered; it turns ``stale``
  and is rerun (the rerun is streamed on its own when it finishes) or dead-lettered per
  ``staleness_action``, and a pending lease on it is dropped.
- Reconnecting with a cursor (the last ``seq``/SSE ``id`` the client received): pending
  entries after it were lost on the wire and are redelivered at once; pending entries at
  or before it keep their lease (redelivered when it expires), unless ``redeliver`` asks
  for every pending entry at once.
- ``done``: the rollout has finished (completed, cancelled or failed, nothing queued or
  running), everything streamed was delivered to this consumer and it acked all of it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db import new_id, utcnow
from gateway.episodes.models import Episode
from gateway.episodes.service import (
    is_stale_now,
    lock_rollout,
    training_views,
    withdraw_stale,
)
from gateway.errors import NotFoundError, error_body
from gateway.logs import current_request_id
from gateway.policies.service import current_version
from gateway.rollouts.events import rollout_events
from gateway.rollouts.models import (
    ACTIVE_EPISODE_STATUSES,
    FINAL_ROLLOUT_STATUSES,
    USABLE_EPISODE_STATUSES,
    DeliveryConsumer,
    DeliveryLease,
    DeliveryState,
    EpisodeGroup,
    Rollout,
)
from workers.protocol import EpisodeStatus

logger = logging.getLogger(__name__)

#: How often a waiting pull or stream re-reads the database (other processes, expired leases).
POLL_INTERVAL_S = 1.0
#: How often an idle SSE stream sends a comment to keep proxies from closing it.
HEARTBEAT_S = 15.0
#: What an SSE client waits before reconnecting (the ``retry:`` field), in milliseconds.
RETRY_MS = 2000


@dataclass
class Delivery:
    """What one delivery handed to a consumer."""

    episodes: list[dict[str, Any]]
    """Training views plus ``seq``, ``rollout_id``, ``task_id``, ``sample_index``, ``attempt``, ``delivery_count``,
    ``group_partial`` and ``group_reason``."""
    cursor: int
    """The consumer's ``last_delivered_seq`` after this delivery."""
    done: bool
    reopened: bool = False
    """A stale entry was rerun, so the rollout has queued episodes again (the dispatcher must run them)."""


async def _rollout(db_session: AsyncSession, rollout_id: str) -> Rollout:
    rollout = await db_session.get(Rollout, rollout_id, populate_existing=True)
    if rollout is None:
        raise NotFoundError(f"Rollout {rollout_id!r} does not exist.")
    return rollout


async def get_consumer(*, db_session: AsyncSession, rollout_id: str, name: str) -> DeliveryConsumer:
    """Return the consumer ``name`` of a rollout, creating it (at position 0) if new; commits a creation."""
    stmt = select(DeliveryConsumer).where(DeliveryConsumer.rollout_id == rollout_id, DeliveryConsumer.name == name)
    consumer = (await db_session.scalars(stmt.execution_options(populate_existing=True))).first()
    if consumer is not None:
        return consumer
    await _rollout(db_session, rollout_id)
    now = utcnow()
    consumer = DeliveryConsumer(id=new_id("cons"), rollout_id=rollout_id, name=name, last_delivered_seq=0,
                                created_at=now, updated_at=now)
    db_session.add(consumer)
    try:
        await db_session.commit()
    except IntegrityError:
        await db_session.rollback()  # created concurrently
        consumer = (await db_session.scalars(stmt.execution_options(populate_existing=True))).one()
    else:
        logger.info("rollout %s: new consumer %s", rollout_id, name)
    return consumer


async def _lock_consumer(db_session: AsyncSession, consumer_id: str) -> DeliveryConsumer:
    await db_session.execute(
        update(DeliveryConsumer).where(DeliveryConsumer.id == consumer_id).values(updated_at=utcnow()))
    consumer = await db_session.get(DeliveryConsumer, consumer_id, populate_existing=True)
    assert consumer is not None
    return consumer


async def rewind(
    *, db_session: AsyncSession, rollout_id: str, consumer: str, cursor: int | None = None, redeliver: bool = False
) -> int:
    """Make pending entries redeliverable at once: those after ``cursor``, or all with ``redeliver``.

    Returns how many leases were expired.
    """
    if cursor is None and not redeliver:
        return 0
    row = await get_consumer(db_session=db_session, rollout_id=rollout_id, name=consumer)
    await _lock_consumer(db_session, row.id)
    stmt = update(DeliveryLease).where(DeliveryLease.consumer_id == row.id,
                                       DeliveryLease.state == DeliveryState.PENDING)
    if not redeliver:
        stmt = stmt.where(DeliveryLease.seq > cursor)
    result = await db_session.execute(stmt.values(lease_expires_at=utcnow()))
    await db_session.commit()
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


async def deliver(
    *, db_session: AsyncSession, rollout_id: str, consumer: str, max_episodes: int, visibility_timeout_s: float,
    include_failed: bool = False,
) -> Delivery:
    """Hand up to ``max_episodes`` entries to ``consumer`` now (no waiting), leased for ``visibility_timeout_s``.

    ``include_failed``: hand out the failed entries too (masked), instead of passing over them.
    """
    row = await get_consumer(db_session=db_session, rollout_id=rollout_id, name=consumer)
    if not await _has_work(db_session, rollout_id, row):
        # Idle polls stay read-only: no write lock unless there is something to hand out.
        return Delivery(episodes=[], cursor=row.last_delivered_seq, done=await _is_done(db_session, rollout_id, row))
    cons = await _lock_consumer(db_session, row.id)
    rollout = await _rollout(db_session, rollout_id)
    now = utcnow()
    expires = now + timedelta(seconds=visibility_timeout_s)
    version: int | None = None
    locked = False
    reopened = False
    out: list[tuple[Episode, DeliveryLease]] = []

    async def fresh(episode: Episode) -> bool:
        """Return whether ``episode`` may be delivered; withdraw it if it went stale."""
        nonlocal version, locked, rollout, reopened
        if episode.status == EpisodeStatus.FAILED:  # only failed entries carry a seq: never training data
            return include_failed
        if episode.status not in USABLE_EPISODE_STATUSES:
            return False
        if rollout.max_staleness is None:
            return True
        if version is None:
            version = await current_version(db_session=db_session, name=rollout.policy_name)
        if not is_stale_now(rollout, episode, version):
            return True
        if not locked:
            rollout = await lock_rollout(db_session, rollout_id)
            locked = True
        await db_session.refresh(episode)
        if episode.status in USABLE_EPISODE_STATUSES:
            reopened |= await withdraw_stale(db_session=db_session, rollout=rollout, episode=episode,
                                             version=version, now=now)
        return False

    expired = (await db_session.scalars(
        select(DeliveryLease)
        .where(DeliveryLease.consumer_id == cons.id, DeliveryLease.state == DeliveryState.PENDING,
               DeliveryLease.lease_expires_at <= now)
        .order_by(DeliveryLease.seq).limit(max_episodes)
    )).all()
    for lease in expired:
        episode = await db_session.get(Episode, lease.episode_id, populate_existing=True)
        assert episode is not None
        if not await fresh(episode):
            lease.state = DeliveryState.DROPPED
            continue
        lease.delivery_count += 1
        lease.lease_expires_at = expires
        lease.last_delivered_at = now
        out.append((episode, lease))
    while len(out) < max_episodes:
        batch = (await db_session.scalars(
            select(Episode)
            .where(Episode.rollout_id == rollout_id, Episode.seq > cons.last_delivered_seq)
            .order_by(Episode.seq).limit(max_episodes - len(out))
            .execution_options(populate_existing=True)
        )).all()
        if not batch:
            break
        for episode in batch:
            assert episode.seq is not None
            cons.last_delivered_seq = episode.seq
            if not await fresh(episode):
                continue
            lease = DeliveryLease(
                consumer_id=cons.id, episode_id=episode.id, rollout_id=rollout_id, seq=episode.seq,
                state=DeliveryState.PENDING, delivery_count=1, lease_expires_at=expires, first_delivered_at=now,
                last_delivered_at=now,
            )
            db_session.add(lease)
            out.append((episode, lease))
    await db_session.commit()
    if locked:
        rollout_events.notify(rollout_id)
    views = await training_views(db_session=db_session, episodes=[e for e, _ in out])
    group_ids = list({e.group_id for e, _ in out})
    groups = {g.id: g for g in (await db_session.scalars(
        select(EpisodeGroup).where(EpisodeGroup.id.in_(group_ids)))).all()} if group_ids else {}
    episodes = []
    for episode, lease in out:
        view = views[episode.id]
        group = groups[episode.group_id]
        view.update(seq=lease.seq, rollout_id=episode.rollout_id, task_id=episode.task_id,
                    sample_index=episode.sample_index, attempt=episode.attempt,
                    delivery_count=lease.delivery_count, group_partial=group.partial,
                    group_reason=group.partial_reason)
        episodes.append(view)
    if out:
        logger.debug("rollout %s: delivered %d episode(s) to %s (cursor %d)", rollout_id, len(out), consumer,
                     cons.last_delivered_seq)
    done = not out and await _is_done(db_session, rollout_id, cons)
    return Delivery(episodes=episodes, cursor=cons.last_delivered_seq, done=done, reopened=reopened)


async def _has_work(db_session: AsyncSession, rollout_id: str, consumer: DeliveryConsumer) -> bool:
    expired = await db_session.scalar(select(DeliveryLease.episode_id).where(
        DeliveryLease.consumer_id == consumer.id, DeliveryLease.state == DeliveryState.PENDING,
        DeliveryLease.lease_expires_at <= utcnow()).limit(1))
    if expired is not None:
        return True
    ahead = await db_session.scalar(select(Episode.id).where(
        Episode.rollout_id == rollout_id, Episode.seq > consumer.last_delivered_seq).limit(1))
    return ahead is not None


async def _is_done(db_session: AsyncSession, rollout_id: str, consumer: DeliveryConsumer) -> bool:
    rollout = await _rollout(db_session, rollout_id)
    if rollout.status not in FINAL_ROLLOUT_STATUSES:
        return False
    active = await db_session.scalar(select(func.count()).select_from(Episode).where(
        Episode.rollout_id == rollout_id, Episode.status.in_(list(ACTIVE_EPISODE_STATUSES))))
    if active:
        return False
    pending = await db_session.scalar(select(func.count()).select_from(DeliveryLease).where(
        DeliveryLease.consumer_id == consumer.id, DeliveryLease.state == DeliveryState.PENDING))
    if pending:
        return False
    ahead = await db_session.scalar(select(func.count()).select_from(Episode).where(
        Episode.rollout_id == rollout_id, Episode.seq > consumer.last_delivered_seq))
    return not ahead


async def pull_episodes(
    *, db_session: AsyncSession, rollout_id: str, consumer: str, max_episodes: int = 16, wait_s: float = 0.0,
    visibility_timeout_s: float = 60.0, cursor: int | None = None, redeliver: bool = False,
    include_failed: bool = False,
) -> Delivery:
    """Deliver up to ``max_episodes`` entries to ``consumer``, long-polling up to ``wait_s`` for the first one.

    Returns as soon as something is delivered, the consumer is done, or ``wait_s`` passes.
    ``cursor``/``redeliver`` first make lost pending entries redeliverable (see :func:`rewind`);
    ``include_failed`` delivers failed entries too, masked (see :func:`deliver`).

    Raises:
        NotFoundError: no such rollout.
    """
    await _rollout(db_session, rollout_id)
    await db_session.commit()
    await rewind(db_session=db_session, rollout_id=rollout_id, consumer=consumer, cursor=cursor, redeliver=redeliver)
    deadline = time.monotonic() + wait_s
    reopened = False
    while True:
        event = rollout_events.event(rollout_id)  # before reading, so no wake-up is missed
        delivery = await deliver(db_session=db_session, rollout_id=rollout_id, consumer=consumer,
                                 max_episodes=max_episodes, visibility_timeout_s=visibility_timeout_s,
                                 include_failed=include_failed)
        await db_session.commit()
        reopened |= delivery.reopened
        left = deadline - time.monotonic()
        if delivery.episodes or delivery.done or left <= 0:
            delivery.reopened = reopened
            return delivery
        await rollout_events.wait(event, min(left, POLL_INTERVAL_S))


async def ack_episodes(*, db_session: AsyncSession, rollout_id: str, consumer: str, episode_ids: list[str]) -> int:
    """Acknowledge delivered entries for ``consumer``; return how many pending leases this settled."""
    await _rollout(db_session, rollout_id)
    row = await get_consumer(db_session=db_session, rollout_id=rollout_id, name=consumer)
    await _lock_consumer(db_session, row.id)
    now = utcnow()
    acked = 0
    unique = list(dict.fromkeys(episode_ids))
    for start in range(0, len(unique), 1000):
        result = await db_session.execute(
            update(DeliveryLease)
            .where(DeliveryLease.consumer_id == row.id, DeliveryLease.state == DeliveryState.PENDING,
                   DeliveryLease.episode_id.in_(unique[start:start + 1000]))
            .values(state=DeliveryState.ACKED, acked_at=now)
        )
        acked += int(result.rowcount or 0)  # type: ignore[attr-defined]
    await db_session.commit()
    if acked:
        rollout_events.notify(rollout_id)  # a stream waiting to say "end" may be done now
    return acked


def format_event(*, data: Any, event: str | None = None, event_id: int | None = None) -> str:
    """Return one server-sent event (data is JSON-encoded on one line)."""
    lines = []
    if event_id is not None:
        lines.append(f"id: {event_id}")
    if event is not None:
        lines.append(f"event: {event}")
    lines.append("data: " + json.dumps(data, separators=(",", ":")))
    return "\n".join(lines) + "\n\n"


async def stream_events(
    *, sessionmaker: async_sessionmaker[AsyncSession], rollout_id: str, consumer: str, batch_size: int,
    visibility_timeout_s: float, cursor: int | None = None, redeliver: bool = False, include_failed: bool = False,
    is_disconnected: Callable[[], Awaitable[bool]] | None = None, on_reopen: Callable[[], None] | None = None,
) -> AsyncIterator[str]:
    """Yield the rollout's stream for ``consumer`` as server-sent events until it is done.

    Events: ``episodes`` (``id:`` = the consumer's cursor after the batch, ``data:`` a JSON
    list of delivered episodes), ``end`` (``data: {"cursor": n}``) once done, ``error`` if
    the stream breaks, and a ``: heartbeat`` comment every :data:`HEARTBEAT_S` seconds while idle. Each batch is
    leased like a pull; a batch lost with the connection is redelivered when its lease
    expires, or at once on a reconnect whose cursor (Last-Event-ID) is before it.
    ``on_reopen`` is called when a stale entry's rerun reopened the rollout; ``include_failed``
    delivers failed entries too, masked (see :func:`deliver`).
    """
    async with sessionmaker() as db_session:
        await rewind(db_session=db_session, rollout_id=rollout_id, consumer=consumer, cursor=cursor,
                     redeliver=redeliver)
    yield f"retry: {RETRY_MS}\n: connected\n\n"
    last_sent = time.monotonic()
    while True:
        if is_disconnected is not None and await is_disconnected():
            logger.info("rollout %s: stream of consumer %s closed by the client", rollout_id, consumer)
            return
        event = rollout_events.event(rollout_id)
        try:
            async with sessionmaker() as db_session:
                delivery = await deliver(db_session=db_session, rollout_id=rollout_id, consumer=consumer,
                                         max_episodes=batch_size, visibility_timeout_s=visibility_timeout_s,
                                         include_failed=include_failed)
        except Exception:
            # Headers are sent: the error becomes an event, and the client reconnects with its cursor.
            logger.exception("rollout %s: stream of consumer %s failed", rollout_id, consumer)
            message = "The stream failed; reconnect with the last event id."
            yield format_event(data=error_body("internal_error", message, current_request_id() or ""), event="error")
            return
        if delivery.reopened and on_reopen is not None:
            on_reopen()
        if delivery.episodes:
            yield format_event(data=delivery.episodes, event="episodes", event_id=delivery.cursor)
            last_sent = time.monotonic()
            continue
        if delivery.done:
            yield format_event(data={"cursor": delivery.cursor}, event="end", event_id=delivery.cursor)
            return
        idle = time.monotonic() - last_sent
        if idle >= HEARTBEAT_S:
            yield ": heartbeat\n\n"
            last_sent = time.monotonic()
            idle = 0.0
        await rollout_events.wait(event, min(POLL_INTERVAL_S, HEARTBEAT_S - idle))
