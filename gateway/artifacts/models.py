"""The artifact table: content-addressed files steps made, kept out of observations and token streams."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import LargeBinary, String
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db import Base, utcnow


class Artifact(Base):
    """One stored file; its id is derived from its bytes, so the same file is stored once."""

    __tablename__ = "artifact"

    id: Mapped[str] = mapped_column(String(48), primary_key=True)
    media_type: Mapped[str] = mapped_column(String(100))
    size: Mapped[int] = mapped_column()
    data: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
