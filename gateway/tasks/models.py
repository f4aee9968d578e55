"""The ``task`` table: one content-hashed task, its archive stored in the row."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ForeignKey, Index, LargeBinary, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column, relationship

from gateway.db import Base, utcnow
from gateway.environments.models import Environment


class Task(Base):
    """One task of an environment; (environment, name, content hash) is unique."""

    __tablename__ = "task"
    __table_args__ = (
        UniqueConstraint("environment_id", "name", "content_hash", name="uq_task_environment_name_hash"),
        Index("ix_task_environment_id_name", "environment_id", "name"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    environment_id: Mapped[str] = mapped_column(ForeignKey("environment.id"))
    family: Mapped[str] = mapped_column(String(32))
    """The environment's family, which decodes ``archive`` (:mod:`workers.envs.registry`)."""
    content_hash: Mapped[str] = mapped_column(String(64))
    instruction: Mapped[str] = mapped_column(Text)
    # "metadata" is reserved on declarative classes, so the attribute has another name.
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", default=dict)
    archive: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)
    """The task as its family's ``encode_task`` bytes (read only to decode it: ``tasks.service.load_task``)."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)

    environment: Mapped[Environment] = relationship(lazy="joined")
