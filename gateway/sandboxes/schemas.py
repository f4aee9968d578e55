"""Response bodies of ``/v1/sandboxes``."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel

from workers.protocol import SandboxStatus


class SandboxRead(BaseModel):
    """One live sandbox, with the session and task it serves when known."""

    id: str
    node: str
    backend: str
    state: SandboxStatus
    image: str
    task_id: str | None
    task_name: str | None
    session_id: str | None
    owner_kind: str | None = None
    """What the sandbox serves, from its owner label: ``session``, ``episode``, ``group`` (a lazy-fork
    group's shared sandbox), ``pool`` (idle in the node's warm pool), ``synth``, ``other``; null: none."""
    owner_id: str | None = None
    """The session, episode or group id (for those kinds)."""
    rollout_id: str | None = None
    """The rollout an episode's or a group's sandbox runs for."""
    age_s: float
    created_at: datetime


class SandboxPage(BaseModel):
    """The live sandboxes (one page; ``next`` is always null for now)."""

    items: list[SandboxRead]
    next: str | None = None
