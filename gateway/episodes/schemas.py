"""Response bodies of ``/v1/episodes``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

from gateway.rollouts.models import EpisodeStatus, Termination


class EpisodeRead(BaseModel):
    """An episode's outcome, without its steps."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    rollout_id: str
    task_id: str
    group_id: str
    task_index: int
    sample_index: int
    attempt: int
    status: EpisodeStatus
    termination: Termination | None
    reward: float | None
    error: str | None
    num_turns: int
    seq: int | None
    """Position in the rollout's delivery stream, if the episode entered it."""
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class EpisodePage(BaseModel):
    """One page of episodes."""

    items: list[EpisodeRead]
    next: str | None = None


class StepRead(BaseModel):
    """One LLM call and what followed it (token arrays are in the training view)."""

    model_config = ConfigDict(from_attributes=True)

    index: int
    parent_index: int | None
    text: str
    action: dict[str, Any] | None
    parse_error: str | None
    observation: str
    reward: float | None
    finish_reason: str | None
    weight_version: int | None
    timings: dict[str, Any]
    server: str | None
    num_prompt_tokens: int
    num_completion_tokens: int
    prompt_ids: list[int] | None = None
    """Tokens appended before this call (template, observation); only with ``?tokens=true``."""
    completion_ids: list[int] | None = None
    """Sampled tokens exactly as the server returned them; only with ``?tokens=true``."""
    logprobs: list[float | None] | None = None
    """One per sampled token; only with ``?tokens=true``."""


class EpisodeDetail(EpisodeRead):
    """An episode with its messages and steps."""

    messages: list[dict[str, Any]]
    steps: list[StepRead]
    timings: dict[str, Any]
    weight_versions: list[int]
    info: dict[str, Any]
    dead_letter_reason: str | None


class EpisodeTraining(BaseModel):
    """The token-exact training view of an episode.

    ``input_ids`` is every token in order; ``loss_mask`` is 1 exactly on sampled tokens;
    ``logprobs`` holds one value per sampled token (``len(logprobs) == sum(loss_mask)``).
    """

    episode_id: str
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float | None]
    reward: float | None
    group_id: str
    weight_versions: list[int]
    termination: Termination | None
    status: EpisodeStatus
