"""Response bodies of ``/v1/sandboxes``."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel

from sandboxes.base import SandboxState


class SandboxRead(BaseModel):
    """One live sandbox, with the session and task it serves when known."""

    id: str
    node: str
    backend: str
    state: SandboxState
    image: str
    task_id: str | None
    task_name: str | None
    session_id: str | None
    age_s: float
    created_at: datetime


class SandboxPage(BaseModel):
    """The live sandboxes (one page; ``next`` is always null for now)."""

    items: list[SandboxRead]
    next: str | None = None
