"""The ``snapshot`` table."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import String
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db import Base, utcnow


class SnapshotRecord(Base):
    """A snapshot of a session: the backend snapshot, the env state and the history at that point.

    ``deleted_at`` marks it deleted for callers; ``freed_at`` says its backend storage is gone
    (at once when nothing holds it, else when the last holder lets go).
    """

    __tablename__ = "snapshot"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    node: Mapped[str] = mapped_column(String(255))
    backend: Mapped[str] = mapped_column(String(32))
    session_id: Mapped[str] = mapped_column(String(40), index=True)
    task_id: Mapped[str] = mapped_column(String(40), index=True)
    kind: Mapped[str] = mapped_column(String(16), default="manual")
    pinned: Mapped[bool] = mapped_column(default=False)
    state: Mapped[dict[str, Any]] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    deleted_at: Mapped[datetime | None] = mapped_column(default=None)
    freed_at: Mapped[datetime | None] = mapped_column(default=None)
