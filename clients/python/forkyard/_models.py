"""Typed views of the gateway's JSON objects (unknown fields are kept, never rejected)."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Annotated, Any, Generic, TypeVar, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

__all__ = [
    "Snapshot",
    "ForkyardModel",
    "Environment",
    "Task",
    "SessionState",
    "SessionInfo",
    "StepResult",
    "SandboxState",
    "Sandbox",
    "Page",
    "RolloutStatus",
    "RolloutProgress",
    "Rollout",
    "Policy",
    "EpisodeStatus",
    "EpisodeOutcome",
    "Episode",
    "EpisodeInfo",
    "EpisodeStep",
    "EpisodeDetail",
    "DeadLetter",
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
    tools: list[dict[str, Any]] = Field(default_factory=list)
    """The tools the family gives an agent, as OpenAI function definitions."""


class Task(ForkyardModel):
    """One task of an environment, identified by name and content hash."""

    id: str
    name: str
    environment: str
    family: str = "terminal"
    content_hash: str
    instruction: str = ""
    metadata: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime | None = None
    warnings: list[str] = Field(default_factory=list)
    """Only in an import's answer: the task.toml keys Forkyard does not use."""


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
    snapshot_id: str | None = None
    """The snapshot this session was forked from, if any."""


class Snapshot(ForkyardModel):
    """A snapshot of a session: fork it into new sessions continuing from that point."""

    id: str
    session_id: str
    task_id: str
    node: str | None = None
    backend: str | None = None
    kind: str = "manual"
    pinned: bool = False
    steps: int = 0
    created_at: datetime | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


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


class SessionStepRecord(ForkyardModel):
    """One step of a session's history: the action and what it answered."""

    seq: int
    """Position in the whole history; a fork's inherited steps come first."""
    session_id: str
    """The session that ran it (a fork's ancestor, for inherited steps)."""
    action: dict[str, Any]
    """``{"tool": ..., "arguments": {...}}``."""
    observation: str
    reward: float | None = None
    terminated: bool = False
    truncated: bool = False
    created_at: datetime | None = None


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


# -- rollouts -------------------------------------------------------------------


class RolloutStatus(str, enum.Enum):
    """Lifecycle of a rollout: queued -> running -> completed | cancelled | failed."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"


ROLLOUT_FINAL_STATUSES = frozenset({RolloutStatus.COMPLETED, RolloutStatus.CANCELLED, RolloutStatus.FAILED})


class EpisodeStatus(str, enum.Enum):
    """Lifecycle of an episode: queued -> running -> completed | truncated | failed | stale."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    FAILED = "failed"
    STALE = "stale"


class EpisodeOutcome(str, enum.Enum):
    """Whose result an ended episode is: only ``reward`` is training data; the others are retried, never a 0."""

    REWARD = "reward"
    VERIFIER_ERROR = "verifier_error"
    POLICY_ERROR = "policy_error"
    INFRA = "infra"


_RolloutStatusField = Union[RolloutStatus, str]
_EpisodeStatusField = Union[EpisodeStatus, str]
_EpisodeOutcomeField = Union[EpisodeOutcome, str]


def _id_text(value: Any) -> Any:
    # Ids are strings in the API; a numeric one is accepted rather than failing validation.
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


_IdField = Annotated[str, BeforeValidator(_id_text)]


class RolloutProgress(ForkyardModel):
    """How far a rollout is, in samples: in total, finished, streamed, and delivered to consumers."""

    total: int = 0
    """Samples asked for: tasks x (group_size + group_spare)."""
    finished: int = 0
    """Samples whose last attempt has ended."""
    streamed: int = 0
    """Episodes that entered the delivery stream as training data."""
    delivered: int = 0
    """Streamed training episodes acknowledged by at least one consumer."""


class Rollout(ForkyardModel):
    """A trainer's request for episodes: tasks x group_size samples under one policy."""

    id: str
    status: _RolloutStatusField = Field(union_mode="left_to_right")
    group_size: int
    task_ids: list[str] = Field(default_factory=list)
    policy: dict[str, Any] = Field(default_factory=dict)
    agent: dict[str, Any] = Field(default_factory=dict)
    limits: dict[str, Any] = Field(default_factory=dict)
    max_staleness: int | None = None
    staleness_action: str | None = None
    max_attempts: int | None = None
    group_mode: dict[str, Any] = Field(default_factory=dict)
    group_spare: int = 0
    """Extra samples each group runs; the first group_size usable ones are delivered."""
    priority: int = 0
    concurrency: int | None = None
    counts: dict[str, int] = Field(default_factory=dict)
    """Number of episode rows (every attempt) per EpisodeStatus value."""
    progress: RolloutProgress = Field(default_factory=RolloutProgress)
    failures: dict[str, int] = Field(default_factory=dict)
    """Failed episode rows (every attempt) per failure outcome: infra, verifier_error, policy_error."""
    partial_groups: int = 0
    """Groups delivered with fewer usable samples than asked for (their episodes say ``group_partial``)."""
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    error: str | None = None

    @property
    def done(self) -> bool:
        """Return whether the rollout reached a final status (completed, cancelled or failed)."""
        return self.status in ROLLOUT_FINAL_STATUSES


class Node(ForkyardModel):
    """A host that owns sandboxes: ``state`` is ``up``, ``down`` (heartbeats missed) or ``draining``."""

    name: str
    state: str
    backend: str
    capacity: int = 0
    load: dict[str, Any] = Field(default_factory=dict)
    heartbeat_at: datetime | None = None
    started_at: datetime | None = None
    draining: bool = False


class NodeList(ForkyardModel):
    """The body of ``GET /v1/nodes``."""

    items: list[Node]


class Policy(ForkyardModel):
    """A named policy's current weight version and whether dispatch to it is paused."""

    name: str
    version: int
    paused: bool = False
    updated_at: datetime | None = None


class Episode(ForkyardModel):
    """The training view of one episode: token ids, loss mask, sampled-token logprobs, reward.

    ``logprobs`` has one value per sampled token, i.e. per position where ``loss_mask`` is 1,
    in order (None where the inference server returned none). ``seq`` is the episode's
    position in its rollout's delivery stream; it and the fields after it are set on
    delivered episodes (pull, stream).

    A failed episode (delivered only to ``include_failed=True``) is masked: ``loss_mask`` all
    zeros, no ``logprobs``, ``reward`` None; ``outcome`` and ``error`` say what failed.
    ``group_partial`` says the episode's group was delivered short of usable samples, and
    ``group_reason`` why.
    """

    episode_id: _IdField
    input_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float | None] | None = None
    reward: float | None = None
    outcome: _EpisodeOutcomeField | None = Field(default=None, union_mode="left_to_right")
    """``reward`` for training data; ``infra``, ``verifier_error`` or ``policy_error`` for a masked failure."""
    error: str | None = None
    """What ended a failed episode."""
    group_id: _IdField | None = None
    weight_versions: list[int] = Field(default_factory=list)
    termination: str | None = None
    status: _EpisodeStatusField | None = Field(default=None, union_mode="left_to_right")
    seq: int | None = None
    rollout_id: _IdField | None = None
    task_id: _IdField | None = None
    sample_index: int | None = None
    attempt: int | None = None
    delivery_count: int | None = None
    """How many times this episode has been delivered to this consumer (more than 1: a redelivery)."""
    parent_episode_id: _IdField | None = None
    """Branching rollouts: the episode this leaf was forked from."""
    branch_turn: int | None = None
    """Branching rollouts: the turn it was forked at."""
    shared_prefix_len: int = 0
    """Branching rollouts: leading tokens shared with another leaf of the tree (count them once)."""
    segments: list[dict[str, Any]] = Field(default_factory=list)
    """Branching rollouts: ``input_ids[start:end]`` ran on ``episode_id`` and ``shared_by`` leaves share it."""
    group_partial: bool = False
    """The episode's group was delivered with fewer usable samples than it asked for."""
    group_reason: str | None = None
    """Why a partial group is short: how many samples failed for good, with each one's outcome and error."""

    @property
    def id(self) -> str:
        """The episode's id (same as episode_id)."""
        return self.episode_id

    @property
    def masked(self) -> bool:
        """Whether this is a failed episode delivered for inspection only (never train on it)."""
        return self.outcome not in (None, EpisodeOutcome.REWARD)


class EpisodeInfo(ForkyardModel):
    """The gateway's summary of one episode, as listed."""

    id: _IdField
    rollout_id: _IdField | None = None
    task_id: _IdField | None = None
    group_id: _IdField | None = None
    task_index: int | None = None
    sample_index: int | None = None
    attempt: int = 1
    status: _EpisodeStatusField = Field(union_mode="left_to_right")
    termination: str | None = None
    reward: float | None = None
    outcome: _EpisodeOutcomeField | None = Field(default=None, union_mode="left_to_right")
    """Whose result the ended episode is (see EpisodeOutcome); None while it runs and for failures of no outcome."""
    error: str | None = None
    num_turns: int | None = None
    seq: int | None = None
    """Position in the rollout's delivery stream, if the episode entered it."""
    parent_episode_id: _IdField | None = None
    branch_turn: int | None = None
    root_episode_id: _IdField | None = None
    """Branching rollouts: the trunk of the episode's trajectory tree."""
    node: str | None = None
    """The node that ran it (in the distributed mode, for a queued episode: the node it was sent to)."""
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None


class EpisodeStep(ForkyardModel):
    """One turn of an episode: the model's output, the action it took, what it saw back."""

    episode_id: _IdField | None = None
    """The episode that ran the step (an ancestor, for a branch's inherited prefix)."""
    index: int | None = None
    parent_index: int | None = None
    text: str | None = None
    action: dict[str, Any] | None = None
    parse_error: str | None = None
    observation: str | None = None
    reward: float | None = None
    finish_reason: str | None = None
    weight_version: int | None = None
    timings: dict[str, Any] = Field(default_factory=dict)
    server: str | None = None
    artifacts: list[dict[str, Any]] = Field(default_factory=list)
    """Files the step made (a screenshot): name, id, url, media_type, bytes; fetch with ``artifacts.get(id)``."""
    num_prompt_tokens: int | None = None
    num_completion_tokens: int | None = None
    prompt_ids: list[int] | None = None
    """Tokens appended before this call; only from ``episodes.get(id, tokens=True)``."""
    completion_ids: list[int] | None = None
    """Sampled tokens exactly as the server returned them; only with ``tokens=True``."""
    logprobs: list[float | None] | None = None
    """One per sampled token; only with ``tokens=True``."""


class EpisodeDetail(EpisodeInfo):
    """One episode in full: its messages, steps, timings and weight versions."""

    messages: list[dict[str, Any]] = Field(default_factory=list)
    steps: list[EpisodeStep] = Field(default_factory=list)
    timings: dict[str, Any] = Field(default_factory=dict)
    weight_versions: list[int] = Field(default_factory=list)
    info: dict[str, Any] = Field(default_factory=dict)
    dead_letter_reason: str | None = None


class EpisodeTree(ForkyardModel):
    """A trajectory tree: step nodes ("root" is the state after reset), edges, leaves with rewards."""

    root_episode_id: _IdField
    rollout_id: _IdField | None = None
    task_id: _IdField | None = None
    group_id: _IdField | None = None
    nodes: list[dict[str, Any]] = Field(default_factory=list)
    edges: list[dict[str, Any]] = Field(default_factory=list)
    leaves: list[dict[str, Any]] = Field(default_factory=list)
    branch_points: list[dict[str, Any]] = Field(default_factory=list)

    def render_text(self) -> str:
        """Return the tree as indented text, one line per step."""
        from .trees import render_tree_text

        return render_tree_text(self.model_dump(mode="json"))

    def render_svg(self, *, title: str | None = None) -> str:
        """Return the tree as an SVG picture."""
        from .trees import render_tree_svg

        return render_tree_svg(self.model_dump(mode="json"), title=title)


class DeadLetter(EpisodeInfo):
    """A failed or stale episode that will not be delivered, with the reason."""

    reason: str | None = None
