"""The ``sandbox`` table: every sandbox a node ran, what it served, and when it went away.

A session's row is written when the session opens. Every other sandbox (an episode's, a
lazy-fork group's, one idle in the warm pool) gets its row from the node's heartbeat, which
also marks the rows of sandboxes no longer live as gone (:func:`gateway.sandboxes.service.record_sandboxes`).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Enum, ForeignKey, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db import Base, utcnow
from workers.protocol import SandboxStatus


class Sandbox(Base):
    """One sandbox of a node; ``id`` is the backend's sandbox id."""

    __tablename__ = "sandbox"
    __table_args__ = (Index("ix_sandbox_node_gone_at", "node", "gone_at"),)

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    node: Mapped[str] = mapped_column(String(255))
    backend: Mapped[str] = mapped_column(String(32))
    state: Mapped[SandboxStatus] = mapped_column(
        Enum(SandboxStatus, native_enum=False, length=16, values_callable=lambda e: [m.value for m in e]),
        index=True,
    )
    session_id: Mapped[str | None] = mapped_column(ForeignKey("session.id"), index=True, default=None)
    task_id: Mapped[str | None] = mapped_column(ForeignKey("task.id"), default=None)
    owner_kind: Mapped[str | None] = mapped_column(String(16), default=None)
    """``session``, ``episode``, ``group``, ``pool``, ``synth`` or ``other`` (:func:`workers.protocol.owner_kind`)."""
    owner_id: Mapped[str | None] = mapped_column(String(64), default=None)
    rollout_id: Mapped[str | None] = mapped_column(String(64), default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    gone_at: Mapped[datetime | None] = mapped_column(default=None)
