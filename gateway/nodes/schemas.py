"""Response bodies of ``/v1/nodes``."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel


class NodeRead(BaseModel):
    """A node as operators see it."""

    name: str
    state: Literal["up", "down", "draining"]
    """``down``: no heartbeat for 2.5 of its intervals (at least 3 s); ``draining``: takes no new work (and is up)."""
    backend: str
    capacity: int
    load: dict[str, Any]
    heartbeat_at: datetime
    started_at: datetime
    draining: bool
    address: str | None = None
    """``host:port`` of a worker node's session channel (the gateways reach its sandboxes there)."""


class NodePage(BaseModel):
    """Every node the database knows."""

    items: list[NodeRead]
