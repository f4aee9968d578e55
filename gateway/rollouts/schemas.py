"""Request and response bodies of ``/v1/rollouts`` (rollouts and their delivery stream)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from gateway.episodes.schemas import EpisodeRead, EpisodeTraining
from gateway.rollouts.models import DeliveryInclude, GroupMode, RolloutStatus, StalenessAction
from workers.protocol import (
    AgentSpec,
    BranchingSpec,
    LimitsSpec,
    PolicySpec,
)

#: Most episodes (tasks x group_size) one rollout may ask for.
MAX_EPISODES_PER_ROLLOUT = 100_000
#: Largest stream position or weight-version gap a request may name (the database stores 64-bit integers).
MAX_SEQ = 2**62
#: What a consumer (group) name may hold.
CONSUMER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,199}$"


class TaskSelection(BaseModel):
    """The tasks of a rollout: by id, or by environment (and optionally names, newest version of each)."""

    model_config = ConfigDict(extra="forbid")

    ids: list[str] | None = Field(default=None, min_length=1, max_length=MAX_EPISODES_PER_ROLLOUT)
    environment: str | None = Field(default=None, min_length=1, max_length=200)
    names: list[str] | None = Field(default=None, min_length=1, max_length=MAX_EPISODES_PER_ROLLOUT)

    @model_validator(mode="after")
    def _one_way(self) -> TaskSelection:
        if self.ids is not None and (self.environment is not None or self.names is not None):
            raise ValueError("give either ids, or an environment (with optional names), not both")
        if self.ids is None and self.environment is None:
            raise ValueError("give ids, or an environment (with optional names)")
        return self


class GroupModeSpec(BaseModel):
    """When a group enters the delivery stream."""

    model_config = ConfigDict(extra="forbid")

    mode: GroupMode = GroupMode.COMPLETE
    min_group_size: int | None = Field(default=None, ge=1, le=1024)


class RolloutCreate(BaseModel):
    """Ask for ``group_size`` episodes of each task with one policy."""

    model_config = ConfigDict(extra="forbid")

    tasks: TaskSelection
    group_size: int = Field(ge=1, le=1024)
    policy: PolicySpec
    agent: AgentSpec = Field(default_factory=AgentSpec)
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    max_staleness: int | None = Field(default=None, ge=0, le=MAX_SEQ,
                                      description="Most versions an episode's oldest turn may lag the policy.")
    staleness_action: StalenessAction = StalenessAction.DEAD_LETTER
    max_attempts: int = Field(default=2, ge=1, le=20, description="Attempts per sample: a stale rerun, or a "
                              "failure that is not the agent's (infra, verifier_error, policy_error) on a fresh "
                              "sandbox.")
    group_mode: GroupModeSpec = Field(default_factory=GroupModeSpec)
    group_spare: int = Field(
        default=0, ge=0, le=1024, description="Extra samples per group: each group runs group_size + group_spare "
        "samples and the first group_size usable ones to finish are delivered; then its queued samples are "
        "cancelled and the results of those still running are kept but not streamed. A group is partial only if "
        "fewer than group_size usable ones remain after every attempt. Not with branching.")
    priority: int = Field(default=0, ge=-1000, le=1000)
    concurrency: int = Field(default=8, ge=1, le=4096)
    branching: BranchingSpec | None = Field(
        default=None, description="Run each sample as a trajectory tree; each group is then one tree.")
    lazy_fork: bool = Field(
        default=True, description="For tasks that declare deterministic tools: the samples of a group share one "
        "sandbox while their actions agree, forking it where they diverge.")

    @field_validator("tasks", mode="before")
    @classmethod
    def _bare_list(cls, value: Any) -> Any:
        return {"ids": value} if isinstance(value, list) else value

    @model_validator(mode="after")
    def _groups(self) -> RolloutCreate:
        mode = self.group_mode
        if mode.mode == GroupMode.EARLY:
            if mode.min_group_size is None:
                raise ValueError("group_mode.min_group_size is required when group_mode.mode is early")
            if mode.min_group_size > self.group_size:
                raise ValueError(f"group_mode.min_group_size ({mode.min_group_size}) is larger than group_size "
                                 f"({self.group_size})")
        elif mode.min_group_size is not None:
            raise ValueError("group_mode.min_group_size only applies to group_mode.mode early")
        if self.branching is not None:
            if self.group_spare:
                raise ValueError("group_spare is not supported with branching (a group is one tree)")
            if mode.mode == GroupMode.EARLY:
                raise ValueError("group_mode early is not supported with branching (a group is one tree)")
            if self.staleness_action == StalenessAction.RERUN:
                raise ValueError("staleness_action rerun is not supported with branching: a branch cannot be "
                                 "rerun without its parent; use dead_letter")
            if self.branching.adaptive is not None and self.policy.api == "scripted":
                raise ValueError("adaptive branching needs logprobs: use the tokens or chat api")
            if self.branching.at_turns is not None and self.branching.at_turns[-1] >= self.agent.max_turns:
                raise ValueError(f"at_turns {self.branching.at_turns[-1]} is not below agent.max_turns "
                                 f"({self.agent.max_turns})")
        return self


class RolloutProgress(BaseModel):
    """How far a rollout has come, in samples (tasks x (group_size + group_spare))."""

    total: int
    finished: int
    """Samples whose last attempt has ended."""
    streamed: int
    """Episodes that entered the delivery stream as training data."""
    delivered: int
    """Streamed training episodes acknowledged by at least one consumer."""


class RolloutRead(BaseModel):
    """A rollout, its settings and progress."""

    id: str
    status: RolloutStatus
    group_size: int
    task_ids: list[str]
    policy: dict[str, Any]
    agent: dict[str, Any]
    limits: dict[str, Any]
    max_staleness: int | None
    staleness_action: StalenessAction
    max_attempts: int
    group_mode: GroupModeSpec
    group_spare: int = 0
    priority: int
    concurrency: int
    branching: dict[str, Any] | None
    lazy_fork: bool
    counts: dict[str, int]
    """Episode rows by status (every attempt counts)."""
    progress: RolloutProgress
    failures: dict[str, int] = {}
    """Failed episode rows (every attempt counts) by outcome: ``infra``, ``verifier_error``, ``policy_error``.
    Failures of no outcome (cancelled, refused before running) are only in ``counts``."""
    partial_groups: int = 0
    """Groups released with fewer usable samples than asked for, each flagged ``partial`` with its reason
    (``group_partial``/``group_reason`` on its delivered episodes). A ``completed`` rollout with partial groups
    did not get every sample it asked for."""
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None


class RolloutPage(BaseModel):
    """One page of rollouts."""

    items: list[RolloutRead]
    next: str | None = None


class PullRequest(BaseModel):
    """Take up to ``max_episodes`` episodes off the stream for ``consumer``, leased for a while."""

    model_config = ConfigDict(extra="forbid")

    consumer: str = Field(pattern=CONSUMER_PATTERN)
    max_episodes: int = Field(default=16, ge=1, le=1024)
    wait_s: float = Field(default=0.0, ge=0.0, le=30.0, description="Long-poll up to this long for an episode.")
    visibility_timeout_s: float = Field(default=60.0, ge=0.0, le=43_200.0,
                                        description="Redeliver an episode not acked this long after delivery.")
    cursor: int | None = Field(default=None, ge=0, le=MAX_SEQ, description="Last seq received (after a crash): pending "
                               "episodes after it are redelivered at once.")
    redeliver: bool = Field(default=False, description="Redeliver every pending (unacked) episode at once.")
    include: list[DeliveryInclude] = Field(
        default_factory=list, max_length=len(DeliveryInclude),
        description="Also deliver these: failed, the failed episodes (infra, verifier_error, policy_error) masked "
        "(reward null, loss_mask all zeros, with outcome and error). Use the same include on every call of a "
        "consumer: entries a call passes over are not offered to it again.")


class DeliveredEpisode(EpisodeTraining):
    """An episode's training view as the stream delivers it, with its group's verdict.

    ``group_partial`` says the episode's group was released with fewer usable samples than it
    asked for (``group_reason`` says which failed and why); a trainer normalizing rewards per
    group sees a short group rather than a silently smaller one.
    """

    seq: int
    rollout_id: str
    task_id: str
    sample_index: int
    attempt: int
    delivery_count: int
    group_partial: bool = False
    """The group was released short of usable samples (see ``group_reason``)."""
    group_reason: str | None = None
    """Why a partial group is short: how many samples failed for good, with each one's outcome and error."""


class PullResponse(BaseModel):
    """What one pull delivered."""

    episodes: list[DeliveredEpisode]
    cursor: int
    """Highest stream position delivered to this consumer so far."""
    done: bool
    """The rollout has finished and this consumer has nothing left (everything acked)."""


class AckRequest(BaseModel):
    """Acknowledge delivered episodes: they are never delivered to this consumer again."""

    model_config = ConfigDict(extra="forbid")

    consumer: str = Field(pattern=CONSUMER_PATTERN)
    episode_ids: list[str] = Field(min_length=1, max_length=10_000)


class AckResponse(BaseModel):
    """How many pending deliveries the ack settled."""

    acked: int


class DeadLetter(EpisodeRead):
    """An episode that will never be delivered, and why."""

    reason: str


class DeadLetterPage(BaseModel):
    """One page of dead letters."""

    items: list[DeadLetter]
    next: str | None = None

