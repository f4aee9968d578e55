"""The ``rollout``, ``episode_group``, ``delivery_consumer`` and ``delivery_lease`` tables and their enums."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Enum,
    ForeignKey,
    Index,
    String,
    Text,
    UniqueConstraint,
    false,
    true,
)
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db import Base, utcnow
from workers.protocol import EpisodeOutcome, EpisodeStatus


class RolloutStatus(str, enum.Enum):
    """Lifecycle of a rollout: queued -> running -> completed | cancelled | failed."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"


#: Episode states that end an attempt.
FINAL_EPISODE_STATUSES = frozenset({EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED, EpisodeStatus.FAILED,
                                    EpisodeStatus.STALE})
#: Episode states whose data a trainer can use.
USABLE_EPISODE_STATUSES = frozenset({EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED})
#: Episode states of an attempt not yet over.
ACTIVE_EPISODE_STATUSES = frozenset({EpisodeStatus.QUEUED, EpisodeStatus.RUNNING})
#: Rollout states in which no new episode starts.
FINAL_ROLLOUT_STATUSES = frozenset({RolloutStatus.COMPLETED, RolloutStatus.CANCELLED, RolloutStatus.FAILED})
#: Outcomes of failed episodes that are nobody's verdict on the agent: retried while attempts remain, and
#: streamed (masked) to consumers that ask for failed episodes.
FAILURE_OUTCOMES = frozenset({EpisodeOutcome.INFRA, EpisodeOutcome.VERIFIER_ERROR, EpisodeOutcome.POLICY_ERROR})


class GroupMode(str, enum.Enum):
    """When a group of samples enters the delivery stream."""

    COMPLETE = "complete"
    """When every sample of the group has finished."""
    EARLY = "early"
    """As soon as ``min_group_size`` usable samples exist (or every sample has finished)."""


class StalenessAction(str, enum.Enum):
    """What happens to an episode found too far behind the policy."""

    RERUN = "rerun"
    DEAD_LETTER = "dead_letter"


class DeliveryInclude(str, enum.Enum):
    """What a consumer asks to receive besides training data (``include=`` on pull and stream)."""

    FAILED = "failed"
    """Failed episodes with a typed outcome (infra, verifier_error, policy_error), masked: reward None and
    loss_mask all zeros, with their ``outcome`` and ``error``."""


class DeliveryState(str, enum.Enum):
    """State of one episode delivered to one consumer."""

    PENDING = "pending"
    """Leased, not acknowledged: redelivered once the lease expires."""
    ACKED = "acked"
    """Acknowledged: never delivered to this consumer again."""
    DROPPED = "dropped"
    """Withdrawn at redelivery (the episode went stale)."""


def enum_column(enum_cls: type[enum.Enum], length: int = 16) -> Enum:
    """Return the non-native (VARCHAR) enum type every status column uses."""
    return Enum(enum_cls, native_enum=False, length=length, values_callable=lambda e: [m.value for m in e])


class Rollout(Base):
    """A trainer's request: tasks x group_size episodes with one policy, agent and delivery settings."""

    __tablename__ = "rollout"
    __table_args__ = (Index("ix_rollout_status_priority", "status", "priority"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    status: Mapped[RolloutStatus] = mapped_column(enum_column(RolloutStatus))
    policy_name: Mapped[str] = mapped_column(String(200), index=True)
    group_size: Mapped[int]
    task_ids: Mapped[list[Any]] = mapped_column(JSON, default=list)
    """Task ids in request order; one group per task."""
    policy: Mapped[dict[str, Any]] = mapped_column(default=dict)
    """The policy spec less its API key (what GET returns)."""
    policy_api_key: Mapped[str | None] = mapped_column(Text, default=None)
    """The inference servers' bearer token: a secret, read only to call them; no response carries it."""
    agent: Mapped[dict[str, Any]] = mapped_column(default=dict)
    limits: Mapped[dict[str, Any]] = mapped_column(default=dict)
    max_staleness: Mapped[int | None] = mapped_column(default=None)
    staleness_action: Mapped[StalenessAction] = mapped_column(enum_column(StalenessAction))
    max_attempts: Mapped[int] = mapped_column(default=2)
    group_mode: Mapped[GroupMode] = mapped_column(enum_column(GroupMode))
    min_group_size: Mapped[int | None] = mapped_column(default=None)
    group_spare: Mapped[int] = mapped_column(default=0, server_default="0")
    """Extra samples each group runs: the first ``group_size`` usable ones win, the rest are not streamed."""
    priority: Mapped[int] = mapped_column(default=0)
    concurrency: Mapped[int] = mapped_column(default=8)
    branching: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    """The ``branching`` section (trajectory trees); None for plain groups."""
    lazy_fork: Mapped[bool] = mapped_column(default=True, server_default=true())
    """Share one sandbox per group while the samples' actions agree (tasks with deterministic tools)."""
    last_seq: Mapped[int] = mapped_column(default=0)
    """Highest delivery-stream position handed out in this rollout."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)


class EpisodeGroup(Base):
    """All samples of one task in one rollout; released into the delivery stream as a unit.

    In a branching rollout a group is one trajectory tree (one task sample): its episodes
    are the tree's leaves.
    """

    __tablename__ = "episode_group"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    rollout_id: Mapped[str] = mapped_column(ForeignKey("rollout.id"), index=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("task.id"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    released_at: Mapped[datetime | None] = mapped_column(default=None)
    partial: Mapped[bool] = mapped_column(default=False, server_default=false())
    """Released with fewer usable samples than asked for (``group_size``; ``min_group_size`` in early mode)."""
    partial_reason: Mapped[str | None] = mapped_column(Text, default=None)
    """Why a partial group is short: how many samples failed for good, and each one's outcome and error."""


class DeliveryConsumer(Base):
    """One consumer group reading one rollout's stream: how far it has read."""

    __tablename__ = "delivery_consumer"
    __table_args__ = (UniqueConstraint("rollout_id", "name", name="uq_delivery_consumer_rollout_name"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    rollout_id: Mapped[str] = mapped_column(ForeignKey("rollout.id"))
    name: Mapped[str] = mapped_column(String(200))
    last_delivered_seq: Mapped[int] = mapped_column(default=0)
    """Every stream entry at or below this position has been handed to this consumer once."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class DeliveryLease(Base):
    """One stream entry handed to one consumer: pending until acked, redelivered when its lease expires."""

    __tablename__ = "delivery_lease"
    __table_args__ = (
        Index("ix_delivery_lease_consumer_state_expiry", "consumer_id", "state", "lease_expires_at"),
        Index("ix_delivery_lease_rollout_state", "rollout_id", "state"),
    )

    consumer_id: Mapped[str] = mapped_column(ForeignKey("delivery_consumer.id"), primary_key=True)
    episode_id: Mapped[str] = mapped_column(ForeignKey("episode.id"), primary_key=True)
    rollout_id: Mapped[str] = mapped_column(ForeignKey("rollout.id"))
    seq: Mapped[int]
    state: Mapped[DeliveryState] = mapped_column(enum_column(DeliveryState))
    delivery_count: Mapped[int] = mapped_column(default=1)
    lease_expires_at: Mapped[datetime]
    first_delivered_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_delivered_at: Mapped[datetime] = mapped_column(default=utcnow)
    acked_at: Mapped[datetime | None] = mapped_column(default=None)
