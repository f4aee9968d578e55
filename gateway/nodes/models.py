"""The ``node`` table: one row per host that runs sandboxes (the embedded gateway is one)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Index, String, Text
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


class NodeCommand(Base):
    """An operator's command for one node (kill a sandbox, resize a pool, evict a cache entry).

    The console writes it; the node runs it at its next heartbeat and writes the outcome, so a
    command reaches a worker host the same way it reaches the embedded gateway.
    """

    __tablename__ = "node_command"
    __table_args__ = (Index("ix_node_command_node_state", "node", "state"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    node: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))
    """``kill_sandbox`` (``sandbox_id``), ``resize_pool`` (``key``, ``size``) or ``evict_cache`` (``entry``)."""
    args: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    """``pending``, ``done`` or ``failed``."""
    result: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    done_at: Mapped[datetime | None] = mapped_column(default=None)
