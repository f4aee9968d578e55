"""Request and response bodies of ``/v1/tasks``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.tasks.models import Task


class TaskSpec(BaseModel):
    """One task given inline: its name and its files as text."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    environment: str = "terminal"
    files: dict[str, str] = Field(
        description="Every file of the task by relative path (terminal: instruction.md, task.toml, tests/test.sh, ...)"
    )


class TaskImport(BaseModel):
    """A JSON import of one or more tasks."""

    model_config = ConfigDict(extra="forbid")

    tasks: list[TaskSpec] = Field(min_length=1, max_length=1000)


class TaskRead(BaseModel):
    """A task as the API shows it (without its files)."""

    id: str
    name: str
    environment: str
    family: str
    content_hash: str
    instruction: str
    metadata: dict[str, Any]
    created_at: datetime
    warnings: list[str] = Field(default_factory=list)
    """In an import's answer: what of the task's ``task.toml`` Forkyard does not use."""

    @classmethod
    def from_row(cls, row: Task) -> TaskRead:
        """Build the API view of a task row."""
        return cls(
            id=row.id, name=row.name, environment=row.environment.name, family=row.family,
            content_hash=row.content_hash,
            instruction=row.instruction, metadata=row.meta or {}, created_at=row.created_at,
        )


class TaskList(BaseModel):
    """The tasks one import created or found."""

    items: list[TaskRead]


class TaskPage(BaseModel):
    """One page of tasks."""

    items: list[TaskRead]
    next: str | None = None
