"""Request and response bodies of the snapshot routes."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from gateway.sessions.schemas import SessionCreated

#: Most sessions one fork may start.
MAX_FORK = 64


class SnapshotRead(BaseModel):
    """One snapshot of a session."""

    id: str
    session_id: str
    task_id: str
    node: str
    backend: str
    kind: str
    pinned: bool
    steps: int = Field(description="How many steps the session had taken at the snapshot.")
    created_at: datetime
    metadata: dict[str, str] = Field(description="What the snapshot holds; background_processes: not captured.")


class SnapshotPage(BaseModel):
    """One page of snapshots."""

    items: list[SnapshotRead]
    next: str | None = None


class SnapshotFork(BaseModel):
    """Fork a snapshot into ``n`` new sessions."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(1, ge=1, le=MAX_FORK)


class ForkedSession(SessionCreated):
    """A session continuing from a snapshot, with the steps taken up to the fork point."""

    snapshot_id: str
    steps: int
    """Steps inherited from the snapshot's session; ``GET /v1/sessions/{id}/steps`` pages them."""


class ForkedSessions(BaseModel):
    """The sessions a fork started."""

    items: list[ForkedSession]
