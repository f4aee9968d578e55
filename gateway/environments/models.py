"""The ``environment`` table."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import String, Text
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db import Base, utcnow


class Environment(Base):
    """A named environment of one family; its name is unique."""

    __tablename__ = "environment"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    family: Mapped[str] = mapped_column(String(32))
    """A family name of the workers' registry (:mod:`workers.envs.registry`), checked at creation."""
    version: Mapped[str] = mapped_column(String(64), default="1")
    description: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
