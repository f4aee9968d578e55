"""Response bodies of ``/v1/episodes``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

from workers.protocol import EpisodeOutcome, EpisodeStatus, Termination


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
    outcome: EpisodeOutcome | None = None
    """Whose result the ended episode is: ``reward`` (the agent's, training data), or ``verifier_error``,
    ``policy_error``, ``infra`` (retried, never a 0); None while it runs and for failures of no outcome."""
    error: str | None
    num_turns: int
    """Steps the episode ran itself (a branch's inherited prefix is not counted)."""
    seq: int | None
    """Position in the rollout's delivery stream, if the episode entered it."""
    parent_episode_id: str | None = None
    """In a trajectory tree: the episode this branch was forked from."""
    branch_turn: int | None = None
    """In a trajectory tree: the turn this branch was forked at."""
    root_episode_id: str | None = None
    """In a trajectory tree: its trunk (GET /v1/episodes/{id}/tree shows the whole tree)."""
    node: str | None = None
    """The node that ran (or runs) it; for a queued episode in the distributed mode, the node it was sent to."""
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

    episode_id: str
    """The episode that ran the step (an ancestor for a branch's inherited prefix)."""
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
    artifacts: list[dict[str, Any]] = []
    """Files the step made (a screenshot): ``{"name", "id", "url", "media_type", "bytes"}``, served by
    ``GET /v1/artifacts/{id}``; never part of the observation or the tokens."""
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


class TrainingSegment(BaseModel):
    """A run of steps on a leaf's path that one episode ran and the same leaves share."""

    episode_id: str
    first_turn: int
    last_turn: int
    start: int
    end: int
    shared_by: int


class EpisodeTraining(BaseModel):
    """The token-exact training view of an episode.

    ``input_ids`` is every token in order; ``loss_mask`` is 1 exactly on sampled tokens;
    ``logprobs`` holds one value per sampled token (``len(logprobs) == sum(loss_mask)``).
    A failed episode's view is masked: ``loss_mask`` all zeros, no ``logprobs``, ``reward`` None,
    with its ``outcome`` and ``error``.
    """

    episode_id: str
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float | None]
    reward: float | None
    outcome: EpisodeOutcome | None = None
    """``reward`` for training data; ``infra``, ``verifier_error`` or ``policy_error`` for a masked failure."""
    error: str | None = None
    """What ended a failed episode."""
    group_id: str
    weight_versions: list[int]
    termination: Termination | None
    status: EpisodeStatus
    parent_episode_id: str | None = None
    branch_turn: int | None = None
    shared_prefix_len: int = 0
    """Leading tokens shared with at least one other leaf of the tree (0 outside trees)."""
    segments: list[TrainingSegment] = []
    """Trees only: ``input_ids[start:end]`` ran on ``episode_id`` (turns first..last), shared by ``shared_by`` leaves."""


class TreeNode(BaseModel):
    """One step of a trajectory tree ("root" is the state right after reset)."""

    id: str
    episode_id: str | None = None
    turn: int | None = None
    tool: str | None = None
    summary: str = ""
    observation: str = ""
    reward: float | None = None
    parse_error: bool = False


class TreeEdge(BaseModel):
    """A parent step and the step that followed it."""

    parent: str
    child: str


class TreeLeaf(BaseModel):
    """One episode of the tree and the node its path ends at."""

    episode_id: str
    node: str
    reward: float | None
    status: EpisodeStatus
    termination: Termination | None
    parent_episode_id: str | None
    branch_turn: int | None


class TreeBranchPoint(BaseModel):
    """A node where the tree forks."""

    node: str
    children: int


class EpisodeTree(BaseModel):
    """A whole trajectory tree: step nodes, edges, leaves (episodes, with rewards) and branch points."""

    root_episode_id: str
    rollout_id: str
    task_id: str
    group_id: str
    nodes: list[TreeNode]
    edges: list[TreeEdge]
    leaves: list[TreeLeaf]
    branch_points: list[TreeBranchPoint]
