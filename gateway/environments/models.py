"""The ``environment`` table."""

from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import Enum, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db import Base, utcnow


class EnvironmentFamily(str, enum.Enum):
    """Environment families the workers implement."""

    TERMINAL = "terminal"


class Environment(Base):
    """A named environment of one family; its name is unique."""

    __tablename__ = "environment"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    family: Mapped[EnvironmentFamily] = mapped_column(
        Enum(EnvironmentFamily, native_enum=False, length=32, values_callable=lambda e: [m.value for m in e])
    )
    version: Mapped[str] = mapped_column(String(64), default="1")
    description: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
