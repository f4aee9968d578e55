"""Typed views of the gateway's JSON objects (unknown fields are kept, never rejected)."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any, Generic, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ForkyardModel",
    "Environment",
    "Task",
    "SessionState",
    "SessionInfo",
    "StepResult",
    "SandboxState",
    "Sandbox",
    "Page",
]

T = TypeVar("T")


class ForkyardModel(BaseModel):
    """Base of every SDK model: keeps fields a newer gateway adds."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, protected_namespaces=())


class SessionState(str, enum.Enum):
    """Lifecycle of a session on the gateway."""

    OPEN = "open"
    TERMINATED = "terminated"
    CLOSED = "closed"
    FAILED = "failed"


class SandboxState(str, enum.Enum):
    """Lifecycle of a sandbox: starting -> ready -> busy -> stopping -> gone (+ failed)."""

    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"
    STOPPING = "stopping"
    GONE = "gone"
    FAILED = "failed"


# A state the SDK does not know yet stays a plain string instead of failing validation.
_SessionStateField = Union[SessionState, str]
_SandboxStateField = Union[SandboxState, str]


class Environment(ForkyardModel):
    """An environment family at one version (e.g. "terminal")."""

    id: str
    name: str
    family: str
    version: str
    description: str | None = None
    created_at: datetime | None = None


class Task(ForkyardModel):
    """One task of an environment, identified by name and content hash."""

    id: str
    name: str
    environment: str
    content_hash: str
    instruction: str = ""
    metadata: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime | None = None


class SessionInfo(ForkyardModel):
    """The gateway's record of one session."""

    id: str
    task_id: str
    state: _SessionStateField = Field(union_mode="left_to_right")
    sandbox_id: str | None = None
    steps: int = 0
    reward: float | None = None
    created_at: datetime | None = None
    closed_at: datetime | None = None
    observation: str | None = None
    """Only set in the answer to session creation: the first observation."""
    tools: list[dict[str, Any]] | None = None
    """Only set in the answer to session creation: the tools the agent may call."""


class StepResult(ForkyardModel):
    """Gym-style outcome of one action."""

    observation: str
    reward: float | None = None
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = Field(default_factory=dict)

    @property
    def done(self) -> bool:
        """Return whether the episode ended (terminated or truncated)."""
        return self.terminated or self.truncated


class Sandbox(ForkyardModel):
    """One live sandbox on a node."""

    id: str
    node: str
    backend: str
    state: _SandboxStateField = Field(union_mode="left_to_right")
    task_id: str | None = None
    task_name: str | None = None
    session_id: str | None = None
    age_s: float | None = None
    created_at: datetime | None = None


class Page(ForkyardModel, Generic[T]):
    """One page of a list answer; `next` is the cursor of the following page."""

    items: list[T]
    next: str | None = None
