"""Request and response bodies of ``/v1/rollouts`` (rollouts and their delivery stream)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from gateway.episodes.schemas import EpisodeRead, EpisodeTraining
from gateway.policies.schemas import POLICY_NAME_PATTERN
from gateway.rollouts.models import GroupMode, RolloutStatus, StalenessAction

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


class SamplingSpec(BaseModel):
    """Sampling parameters of every LLM call."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(default=256, ge=1, le=1_000_000)
    stop: list[str] = Field(default_factory=list, max_length=16)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)


class PolicySpec(BaseModel):
    """The policy the episodes sample from: its name (for versions), servers, model and API."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=POLICY_NAME_PATTERN, description="Name weight versions are announced under.")
    base_urls: list[AnyHttpUrl] = Field(default_factory=list, max_length=256)
    model: str = Field(default="", max_length=500)
    api: Literal["tokens", "chat", "scripted"]
    tokenizer: str | None = Field(default=None, max_length=1000,
                                  description="Local tokenizer path for the tokens api; default: the model.")
    actions: list[dict[str, Any]] | None = Field(default=None, max_length=10_000,
                                                 description="Scripted actions; default: the task's oracle.")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    api_key: SecretStr | None = Field(
        default=None, min_length=1, max_length=4096,
        description="Bearer token the inference servers require (vLLM --api-key). Kept as a secret: "
                    "never returned by any GET, redacted in logs.",
    )  # fmt: skip
    tool_choice: Literal["auto", "none", "required"] | None = Field(
        default=None,
        description="chat api: the tool_choice of every request; default auto (none, from then on, "
                    "when a server has no tool parser).",
    )  # fmt: skip

    @model_validator(mode="after")
    def _servers(self) -> PolicySpec:
        if self.api in ("tokens", "chat"):
            if not self.base_urls:
                raise ValueError(f"base_urls must list at least one inference server for the {self.api} api")
            if not self.model:
                raise ValueError(f"model is required for the {self.api} api")
        if self.tool_choice is not None and self.api != "chat":
            raise ValueError(f"tool_choice applies to the chat api only, not {self.api}")
        return self

    def secret_api_key(self) -> str | None:
        """Return the API key in clear (for the rollout's secret column), or None."""
        return self.api_key.get_secret_value() if self.api_key is not None else None

    def to_dict(self) -> dict[str, Any]:
        """Return the spec as the plain dict stored on the rollout, without its API key.

        URLs are strings without a trailing slash; the key is stored apart
        (:attr:`Rollout.policy_api_key`) so that nothing returning the policy can show it.
        """
        data = self.model_dump(mode="json", exclude={"api_key"})
        data["base_urls"] = [str(u).rstrip("/") for u in self.base_urls]
        return data


class AgentSpec(BaseModel):
    """How the agent runs."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(default=20, ge=1, le=1000)
    system_prompt: str | None = Field(default=None, max_length=100_000)
    tool_call_format: Literal["hermes", "json"] = "hermes"


class LimitsSpec(BaseModel):
    """Time limits of one episode."""

    model_config = ConfigDict(extra="forbid")

    episode_timeout_s: float = Field(default=600.0, gt=0, le=86_400)
    step_timeout_s: float = Field(default=60.0, gt=0, le=86_400)


class GroupModeSpec(BaseModel):
    """When a group enters the delivery stream."""

    model_config = ConfigDict(extra="forbid")

    mode: GroupMode = GroupMode.COMPLETE
    min_group_size: int | None = Field(default=None, ge=1, le=1024)


#: Most episodes one trajectory tree may hold.
MAX_TREE_EPISODES = 1024


class AdaptiveBranchingSpec(BaseModel):
    """Branch where the policy was least certain, spending at most ``budget`` extra episodes per tree."""

    model_config = ConfigDict(extra="forbid")

    budget: int = Field(ge=1, le=MAX_TREE_EPISODES - 1, description="Most extra episodes (branches) per tree.")
    min_entropy: float = Field(ge=0.0, le=100.0, description="Re-sample a turn whose mean negative logprob per "
                               "sampled token (an entropy estimate) reaches this.")
    fanout: int = Field(default=2, ge=2, le=64, description="Branches per branch point, the original included.")


class BranchingSpec(BaseModel):
    """Trajectory trees: fork each sample's episode at fixed turns, or adaptively."""

    model_config = ConfigDict(extra="forbid")

    at_turns: list[Annotated[int, Field(ge=0, le=1000)]] | None = Field(default=None, min_length=1, max_length=16,
                                       description="Fork at the start of these turns (0-based, increasing).")
    fanout: int = Field(default=2, ge=2, le=64, description="Branches per branch point, the original included.")
    max_episodes: int | None = Field(default=None, ge=2, le=MAX_TREE_EPISODES,
                                     description="Most episodes (leaves) per tree; default fanout ** len(at_turns).")
    adaptive: AdaptiveBranchingSpec | None = None

    @model_validator(mode="after")
    def _one_way(self) -> BranchingSpec:
        if (self.at_turns is None) == (self.adaptive is None):
            raise ValueError("give either at_turns (with fanout) or adaptive {budget, min_entropy}")
        if self.adaptive is not None:
            if "fanout" in self.model_fields_set or self.max_episodes is not None:
                raise ValueError("with adaptive branching, give fanout inside adaptive and no max_episodes")
            return self
        assert self.at_turns is not None
        if any(t < 0 for t in self.at_turns) or any(b <= a for a, b in zip(self.at_turns, self.at_turns[1:])):
            raise ValueError("at_turns must be non-negative and strictly increasing")
        if self.max_episodes is None and self.fanout ** len(self.at_turns) > MAX_TREE_EPISODES:
            raise ValueError(f"fanout ** len(at_turns) is more than {MAX_TREE_EPISODES} episodes per tree; "
                             "set max_episodes")
        return self

    def stored(self) -> dict[str, Any]:
        """The dict stored on the rollout (and echoed back): only the fields of the chosen way."""
        return self.model_dump(mode="json", exclude_none=True, exclude={"fanout"} if self.adaptive else None)

    @property
    def tree_episodes(self) -> int:
        """Most episodes one tree can hold."""
        if self.adaptive is not None:
            return 1 + self.adaptive.budget
        assert self.at_turns is not None
        return self.max_episodes or self.fanout ** len(self.at_turns)


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
    max_attempts: int = Field(default=2, ge=1, le=20, description="Attempts per sample (stale reruns, restarts).")
    group_mode: GroupModeSpec = Field(default_factory=GroupModeSpec)
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
    """How far a rollout has come, in samples (tasks x group_size)."""

    total: int
    finished: int
    """Samples whose last attempt has ended."""
    streamed: int
    """Episodes that entered the delivery stream."""
    delivered: int
    """Streamed episodes acknowledged by at least one consumer."""


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
    priority: int
    concurrency: int
    branching: dict[str, Any] | None
    lazy_fork: bool
    counts: dict[str, int]
    """Episode rows by status (every attempt counts)."""
    progress: RolloutProgress
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


class DeliveredEpisode(EpisodeTraining):
    """An episode's training view as the stream delivers it."""

    seq: int
    rollout_id: str
    task_id: str
    sample_index: int
    attempt: int
    delivery_count: int


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
