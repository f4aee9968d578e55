"""The ``episode`` and ``episode_step`` tables.

Token arrays (prompt ids, completion ids, logprobs) are JSON arrays: exact on SQLite and
PostgreSQL alike (a float32 logprob widened to a Python float prints and parses back to the
same value), and readable with plain SQL.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db import Base, utcnow
from gateway.rollouts.models import enum_column
from workers.protocol import EpisodeOutcome, EpisodeStatus, Termination

#: A 64-bit autoincrementing key (SQLite only autoincrements an INTEGER PRIMARY KEY).
BigIntKey = BigInteger().with_variant(Integer(), "sqlite")


class Episode(Base):
    """One attempt at one sample of one task in one rollout."""

    __tablename__ = "episode"
    __table_args__ = (
        Index("ix_episode_rollout_status", "rollout_id", "status"),
        Index("ix_episode_group_sample", "group_id", "sample_index"),
        UniqueConstraint("rollout_id", "seq", name="uq_episode_rollout_seq"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    rollout_id: Mapped[str] = mapped_column(ForeignKey("rollout.id"))
    group_id: Mapped[str] = mapped_column(ForeignKey("episode_group.id"))
    task_id: Mapped[str] = mapped_column(ForeignKey("task.id"))
    task_index: Mapped[int] = mapped_column(default=0)
    """Position of the task in the rollout's task list (dispatch order)."""
    sample_index: Mapped[int]
    attempt: Mapped[int] = mapped_column(default=1)
    status: Mapped[EpisodeStatus] = mapped_column(enum_column(EpisodeStatus))
    termination: Mapped[Termination | None] = mapped_column(enum_column(Termination), default=None)
    reward: Mapped[float | None] = mapped_column(default=None)
    outcome: Mapped[EpisodeOutcome | None] = mapped_column(enum_column(EpisodeOutcome), default=None)
    """Whose result the ended episode is (only ``reward`` is training data); None while active and for failures
    of no type (cancelled, refused before it ran)."""
    error: Mapped[str | None] = mapped_column(Text, default=None)
    messages: Mapped[list[Any]] = mapped_column(JSON, default=list)
    timings: Mapped[dict[str, Any]] = mapped_column(default=dict)
    weight_versions: Mapped[list[Any]] = mapped_column(JSON, default=list)
    info: Mapped[dict[str, Any]] = mapped_column(default=dict)
    num_turns: Mapped[int] = mapped_column(default=0)
    """Steps this episode ran itself (a branch's inherited prefix is not counted)."""
    parent_episode_id: Mapped[str | None] = mapped_column(String(40), default=None, index=True)
    """The episode this branch was forked from (None for a tree's trunk and for plain episodes)."""
    branch_turn: Mapped[int | None] = mapped_column(default=None)
    """The turn this branch was forked at: the parent's steps before it are this episode's prefix."""
    root_episode_id: Mapped[str | None] = mapped_column(String(40), default=None, index=True)
    """The trunk of this episode's trajectory tree (itself for a trunk; None outside branching rollouts)."""
    node: Mapped[str | None] = mapped_column(String(255), default=None)
    """Node running the episode (set when it starts; in the distributed mode, the node it was sent to)."""
    dispatched_at: Mapped[datetime | None] = mapped_column(default=None)
    """When a scheduler sent this queued episode to a node (distributed mode); None while unsent."""
    lease: Mapped[str | None] = mapped_column(String(40), default=None)
    """Fencing token of the attempt running the episode: every write of its runner must carry it."""
    seq: Mapped[int | None] = mapped_column(default=None)
    """Position in the rollout's delivery stream; None while not (or never) streamed."""
    dead_letter_reason: Mapped[str | None] = mapped_column(Text, default=None)
    """Why the episode will never be delivered (failed, stale, cancelled); None otherwise."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None, index=True)


class EpisodeStep(Base):
    """One LLM call of an episode and the action, observation and reward that followed it."""

    __tablename__ = "episode_step"
    __table_args__ = (UniqueConstraint("episode_id", "step_index", name="uq_episode_step_episode_index"),)

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True, autoincrement=True)
    episode_id: Mapped[str] = mapped_column(ForeignKey("episode.id"))
    index: Mapped[int] = mapped_column("step_index")
    parent_index: Mapped[int | None] = mapped_column(default=None)
    prompt_ids: Mapped[list[Any]] = mapped_column(JSON, default=list)
    """Tokens appended before this generation (the prompt, then observations); loss 0."""
    completion_ids: Mapped[list[Any]] = mapped_column(JSON, default=list)
    """Sampled tokens exactly as the server returned them; loss 1."""
    logprobs: Mapped[list[Any] | None] = mapped_column(JSON, default=None)
    """One per completion token; None if the server returned none."""
    weight_version: Mapped[int | None] = mapped_column(default=None)
    finish_reason: Mapped[str | None] = mapped_column(String(32), default=None)
    text: Mapped[str] = mapped_column(Text, default="")
    action: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    parse_error: Mapped[str | None] = mapped_column(Text, default=None)
    observation: Mapped[str] = mapped_column(Text, default="")
    reward: Mapped[float | None] = mapped_column(default=None)
    timings: Mapped[dict[str, Any]] = mapped_column(default=dict)
    server: Mapped[str | None] = mapped_column(String(500), default=None)
    artifacts: Mapped[list[Any] | None] = mapped_column(JSON, default=None)
    """Links to the files the step made (a screenshot), stored apart (:mod:`gateway.artifacts`)."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
