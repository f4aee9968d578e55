"""The ``policy`` table: the weight version a trainer announced and whether dispatch is paused."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import String
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db import Base, utcnow


class Policy(Base):
    """A named policy (the trainer's model) as the dispatcher and the staleness rule see it."""

    __tablename__ = "policy"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    version: Mapped[int] = mapped_column(default=0)
    """The latest weight version announced; 0 until the first announcement."""
    paused: Mapped[bool] = mapped_column(default=False)
    """While true, no new LLM call of this policy starts."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
