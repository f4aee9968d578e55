"""The ``api_key`` table: only a SHA-256 hash of each key is stored."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import String
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db import Base, utcnow


class ApiKey(Base):
    """One API key, known by its hash and a short displayable prefix."""

    __tablename__ = "api_key"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    prefix: Mapped[str] = mapped_column(String(16))
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)
    scope: Mapped[str] = mapped_column(String(16), default="trainer", server_default="trainer")
    """``trainer`` (the ``/v1`` API) or ``admin`` (the API and the console at ``/admin``)."""
