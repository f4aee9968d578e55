"""The ``session`` table and the session lifecycle enum."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Enum, ForeignKey, Index, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db import Base, utcnow


class SessionState(str, enum.Enum):
    """Lifecycle of a session: open -> terminated (episode ended) | closed (by the caller) | failed."""

    OPEN = "open"
    TERMINATED = "terminated"
    CLOSED = "closed"
    FAILED = "failed"


class EnvSession(Base):
    """One session on a task: which node and sandbox serve it, its steps and reward."""

    __tablename__ = "session"
    __table_args__ = (Index("ix_session_node_state", "node", "state"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("task.id"), index=True)
    state: Mapped[SessionState] = mapped_column(
        Enum(SessionState, native_enum=False, length=16, values_callable=lambda e: [m.value for m in e])
    )
    node: Mapped[str] = mapped_column(String(255))
    sandbox_id: Mapped[str | None] = mapped_column(String(128), default=None)
    backend: Mapped[str | None] = mapped_column(String(32), default=None)
    steps: Mapped[int] = mapped_column(default=0)
    reward: Mapped[float | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    closed_at: Mapped[datetime | None] = mapped_column(default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    snapshot_id: Mapped[str | None] = mapped_column(String(40), default=None, index=True)
    """The snapshot this session was forked from; an open fork holds it."""
    parent_session_id: Mapped[str | None] = mapped_column(String(40), default=None)
    """A fork's source session: its first ``parent_steps`` steps are that session's (and so on up)."""
    parent_steps: Mapped[int] = mapped_column(default=0, server_default="0")


class SessionStep(Base):
    """One step of a session: the action and what it answered, a row each (a step is one insert).

    ``seq`` counts from the start of the whole history: a fork's own first step is
    ``seq == parent_steps``; the ones before it are read from its parent session.
    """

    __tablename__ = "session_step"

    session_id: Mapped[str] = mapped_column(ForeignKey("session.id"), primary_key=True)
    seq: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    tool: Mapped[str] = mapped_column(String(200))
    arguments: Mapped[dict[str, Any]] = mapped_column(JSON)
    observation: Mapped[str] = mapped_column(Text)
    reward: Mapped[float | None] = mapped_column(default=None)
    terminated: Mapped[bool] = mapped_column(default=False)
    truncated: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
