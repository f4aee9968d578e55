"""Request and response bodies of ``/v1/environments``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"


class EnvironmentCreate(BaseModel):
    """A new environment."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, description="Unique name (letters, digits, `.`, `_`, `-`).")
    family: str = Field(
        default="terminal", pattern=r"^[a-z][a-z0-9_]{0,31}$",
        description="The environment family (`terminal`, or one a worker package registers); unknown ones are a 422.",
    )
    version: str = Field(default="1", min_length=1, max_length=64)
    description: str = Field(default="", max_length=10_000)


class EnvironmentRead(BaseModel):
    """An environment as the API shows it."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    family: str
    version: str
    description: str
    created_at: datetime
    tools: list[dict[str, Any]] = Field(
        default_factory=list, description="The tools an agent sees in this family, as OpenAI function definitions.")


class EnvironmentPage(BaseModel):
    """One page of environments."""

    items: list[EnvironmentRead]
    next: str | None = None
