"""The ``sandbox`` table: which sandbox served which session, and when it went away."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Enum, ForeignKey, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db import Base, utcnow
from sandboxes.base import SandboxState


class Sandbox(Base):
    """One sandbox a session ran in; ``id`` is the backend's sandbox id."""

    __tablename__ = "sandbox"
    __table_args__ = (Index("ix_sandbox_node_gone_at", "node", "gone_at"),)

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    node: Mapped[str] = mapped_column(String(255))
    backend: Mapped[str] = mapped_column(String(32))
    state: Mapped[SandboxState] = mapped_column(
        Enum(SandboxState, native_enum=False, length=16, values_callable=lambda e: [m.value for m in e])
    )
    session_id: Mapped[str | None] = mapped_column(ForeignKey("session.id"), index=True, default=None)
    task_id: Mapped[str | None] = mapped_column(ForeignKey("task.id"), default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    gone_at: Mapped[datetime | None] = mapped_column(default=None)
