"""Request and response bodies of ``/v1/policies``."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field


class PolicyVersionSet(BaseModel):
    """Announce the weight version the trainer now serves."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0, le=2**62, description="The new weight version; never lower than the current one.")


class PolicyRead(BaseModel):
    """A policy's current weight version and pause switch."""

    model_config = ConfigDict(from_attributes=True)

    name: str
    version: int
    paused: bool
    updated_at: datetime
