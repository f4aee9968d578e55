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
    history: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, default=None)
    """Each step's action and outcome, oldest first (a fork starts with its snapshot's)."""
    snapshot_id: Mapped[str | None] = mapped_column(String(40), default=None, index=True)
    """The snapshot this session was forked from; an open fork holds it."""
