"""Request and response bodies of ``/v1/sessions``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.sessions.models import SessionState


class SessionCreate(BaseModel):
    """Open a session on a task."""

    model_config = ConfigDict(extra="forbid")

    task_id: str = Field(min_length=1, max_length=64)


class SessionCreated(BaseModel):
    """A new session: its first observation and the tools the agent may call."""

    id: str
    task_id: str
    state: SessionState
    observation: str
    tools: list[dict[str, Any]]
    sandbox_id: str | None
    created_at: datetime


class Action(BaseModel):
    """One tool call."""

    model_config = ConfigDict(extra="forbid")

    tool: str = Field(min_length=1, max_length=200, description="Name of one of the session's tools.")
    arguments: dict[str, Any] = Field(default_factory=dict, description="The tool's arguments.")


class SessionStep(BaseModel):
    """The body of a step."""

    model_config = ConfigDict(extra="forbid")

    action: Action


class StepRead(BaseModel):
    """Gym-style outcome of one action."""

    observation: str
    reward: float | None
    terminated: bool
    truncated: bool
    info: dict[str, Any]


class SessionRead(BaseModel):
    """The gateway's record of one session."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    task_id: str
    state: SessionState
    sandbox_id: str | None
    steps: int
    reward: float | None
    created_at: datetime
    closed_at: datetime | None
    node: str
    error: str | None
    snapshot_id: str | None = None
    """The snapshot this session was forked from, if any."""


class SessionPage(BaseModel):
    """One page of sessions."""

    items: list[SessionRead]
    next: str | None = None


class StepRecord(BaseModel):
    """One step of a session's history: the action and what it answered."""

    model_config = ConfigDict(from_attributes=True)

    seq: int
    """Position in the whole history (a fork's inherited steps come first)."""
    session_id: str
    """The session that ran it (a fork's parent, for inherited steps)."""
    action: Action
    observation: str
    reward: float | None
    terminated: bool
    truncated: bool
    created_at: datetime


class StepPage(BaseModel):
    """One page of a session's steps, oldest first."""

    items: list[StepRecord]
    steps: int
    """The session's step count (inherited steps included)."""
    next: str | None = None
