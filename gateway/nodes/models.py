"""The ``node`` table: one row per host that runs sandboxes (the embedded gateway is one)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, String
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db import Base, utcnow


class Node(Base):
    """A host's last heartbeat: what it runs on, how much it may run and runs now, whether it drains."""

    __tablename__ = "node"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    backend: Mapped[str] = mapped_column(String(32))
    capacity: Mapped[int] = mapped_column(default=0)
    """Episodes and sessions it takes at once (0: no limit given)."""
    load: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    """What it runs now, by stage: ``{"sessions": n, "episodes": n}``."""
    heartbeat_s: Mapped[float] = mapped_column(default=5.0)
    """The interval it promised heartbeats at (down after 2.5 missed, and at least 3 s)."""
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    draining: Mapped[bool] = mapped_column(default=False)
    address: Mapped[str | None] = mapped_column(String(255), default=None)
    """``host:port`` of its node channel for the sessions of its sandboxes (worker nodes; None embedded)."""
    channel_token: Mapped[str | None] = mapped_column(String(64), default=None)
    """The secret a gateway presents first on that channel (a new one at each start; never shown by the API)."""
