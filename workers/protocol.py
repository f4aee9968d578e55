"""The wire types between the gateway and the data plane: one definition of each.

What a rollout asks of its episodes (policy, sampling, agent, limits, branching) and the
statuses an episode reports are defined here, once. The gateway's request schemas use
these models as they are (so the API validates exactly what a worker will run), the
gateway stores them as their JSON dumps, and the workers parse those dumps back with the
same models (:meth:`PolicySpec.from_stored` and friends), so nothing is parsed by hand
twice and the two sides cannot drift.

This module imports pydantic and the standard library only: never FastAPI, SQLAlchemy or
anything of the gateway (the layering contract in pyproject.toml checks it), so the same
types serve the in-process executor and a worker on another host.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal, Protocol, Self, runtime_checkable

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

#: What a policy name (the key weight versions are announced under) may hold.
POLICY_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$"
#: Most episodes one trajectory tree may hold.
MAX_TREE_EPISODES = 1024


#: The label naming a sandbox's owner (the value of :data:`sandboxes.base.LABEL_OWNER`; a test checks it).
LABEL_OWNER = "forkyard.owner"
#: Owner label (``forkyard.owner``) of a sandbox waiting in a node's warm pool.
POOL_OWNER = "forkyard-pool"
#: Owner label of the sandboxes ``forkyard swe synth`` runs.
SYNTH_OWNER = "forkyard-swe-synth"
_OWNER_PREFIXES = (("sess_", "session"), ("ep_", "episode"), ("grp_", "group"))


def owner_kind(owner: str | None) -> str | None:
    """Return what owns a sandbox from its owner label: ``session``, ``episode``, ``group`` (a lazy-fork
    group's shared sandbox), ``pool``, ``synth``, ``other``; None for a sandbox without one."""
    if not owner:
        return None
    if owner == POOL_OWNER:
        return "pool"
    if owner == SYNTH_OWNER:
        return "synth"
    return next((kind for prefix, kind in _OWNER_PREFIXES if owner.startswith(prefix)), "other")


class EpisodeStatus(str, enum.Enum):
    """Lifecycle of an episode: queued -> running -> completed | truncated | failed | stale."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    """The agent submitted and the verifier gave a reward (which may be 0)."""
    TRUNCATED = "truncated"
    """Max turns or a timeout ended the agent; the verifier still ran."""
    FAILED = "failed"
    """An error ended the episode; ``error`` says which."""
    STALE = "stale"
    """Its oldest turn was more than ``max_staleness`` versions behind the policy."""


class EpisodeOutcome(str, enum.Enum):
    """Whose result an ended episode is. Only ``reward`` is training data; the others are never a 0.

    An environment's final step says ``info["outcome"]`` (``reward`` or ``verifier_error``);
    the runner adds ``policy_error`` and ``infra`` for episodes that ended in a failure.
    """

    REWARD = "reward"
    """The verifier scored the agent's work (0 included, also when the agent broke its own sandbox
    or was caught tampering: ``info.cause`` says so)."""
    VERIFIER_ERROR = "verifier_error"
    """The verifier timed out, crashed or left no readable reward: the task's fault, not the agent's."""
    POLICY_ERROR = "policy_error"
    """The inference server failed (unreachable, errors, unusable answers)."""
    INFRA = "infra"
    """A sandbox, image, node or task setup failed: nothing the agent could cause."""


class Termination(str, enum.Enum):
    """Why an episode ended."""

    SUBMITTED = "submitted"
    MAX_TURNS = "max_turns"
    TIMEOUT = "timeout"
    ERROR = "error"
    STALE = "stale"
    CANCELLED = "cancelled"


class _Stored(BaseModel):
    """A spec the gateway stores as its JSON dump and a worker reads back."""

    @classmethod
    def from_stored(cls, data: Mapping[str, Any] | None) -> Self:
        """Parse a stored dump (None or ``{}``: the defaults); raise pydantic's ValidationError if it is not one."""
        return cls.model_validate(dict(data or {}))


class SamplingSpec(_Stored):
    """Sampling parameters of every LLM call."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(default=256, ge=1, le=1_000_000)
    stop: list[Annotated[str, Field(min_length=1, max_length=1000)]] = Field(default_factory=list, max_length=16)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)


class PolicySpec(_Stored):
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


class AgentSpec(_Stored):
    """How the agent runs."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(default=20, ge=1, le=1000)
    system_prompt: str | None = Field(default=None, max_length=100_000)
    tool_call_format: Literal["hermes", "json"] = "hermes"


class LimitsSpec(_Stored):
    """Time limits of one episode."""

    model_config = ConfigDict(extra="forbid")

    episode_timeout_s: float = Field(default=600.0, gt=0, le=86_400)
    step_timeout_s: float = Field(default=60.0, gt=0, le=86_400)


class AdaptiveBranchingSpec(BaseModel):
    """Branch where the policy was least certain, spending at most ``budget`` extra episodes per tree."""

    model_config = ConfigDict(extra="forbid")

    budget: int = Field(ge=1, le=MAX_TREE_EPISODES - 1, description="Most extra episodes (branches) per tree.")
    min_entropy: float = Field(ge=0.0, le=100.0, description="Re-sample a turn whose mean negative logprob per "
                               "sampled token (an entropy estimate) reaches this.")
    fanout: int = Field(default=2, ge=2, le=64, description="Branches per branch point, the original included.")


class BranchingSpec(_Stored):
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


def describe(exc: ValidationError, what: str) -> str:
    """One sentence naming the first invalid field of ``what`` (and how many more there are)."""
    errors = exc.errors()
    if not errors:
        return f"invalid {what}"
    first = errors[0]
    where = ".".join(str(p) for p in (what, *first.get("loc", ())))
    text = f"{where}: {str(first.get('msg', 'is invalid')).rstrip('.')}"
    return text + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")


class RolloutJob(BaseModel):
    """What every episode of one rollout runs with: the policy, the agent, the limits, the tree."""

    rollout_id: str
    policy: PolicySpec
    """With its ``api_key``: the gateway stores the key apart and puts it back for the workers."""
    agent: AgentSpec = Field(default_factory=AgentSpec)
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    branching: BranchingSpec | None = None
    lazy_fork: bool = False
    max_staleness: int | None = Field(default=None, ge=0)


class EpisodeJob(BaseModel):
    """One episode (one attempt of one sample) to run under its rollout's :class:`RolloutJob`."""

    episode_id: str
    task_id: str
    root_episode_id: str | None = None
    """The trunk of the episode's trajectory tree (branching rollouts)."""
    env_version: str = ""
    """The environment's ``name@version``, part of the setup cache key."""


class StepRecord(BaseModel):
    """One policy turn: the exact LLM call, the action it produced and what came back."""

    index: int
    parent_index: int | None
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    weight_version: int | None
    finish_reason: str
    text: str
    action: dict[str, Any] | None
    parse_error: str | None
    observation: str
    reward: float | None
    timings: dict[str, float]
    server: str
    artifacts: dict[str, bytes] = Field(default_factory=dict, exclude=True)
    """Files the env made at this step (a screenshot); the reporter stores them apart and records links."""

    def as_dict(self) -> dict[str, Any]:
        """Return the record as plain data (floats as they are: a logprob may be -inf), without artifact bytes."""
        return self.model_dump()


class EpisodeResult(BaseModel):
    """How an episode ended, with everything needed to store and train on it."""

    model_config = ConfigDict(use_enum_values=True)  # status and termination read as plain strings

    status: EpisodeStatus
    termination: Termination
    reward: float | None
    error: str | None
    steps: list[StepRecord]
    messages: list[dict[str, Any]]
    timings: dict[str, float]
    weight_versions: list[int]
    info: dict[str, Any] = Field(default_factory=dict)
    artifacts: dict[str, bytes] = Field(default_factory=dict, exclude=True)
    """Files of the episode's last state (the final page's screenshot); stored apart, linked from ``info``."""


class PolicyState(BaseModel):
    """What an episode needs to know of its policy before each turn."""

    version: int = 0
    """The weight version the trainer last announced (stamped on turns whose server names none)."""
    paused: bool = False
    """Whether the trainer paused dispatch (no new policy call starts while it is)."""


@runtime_checkable
class EpisodeReporter(Protocol):
    """Where a running episode (and each branch of its tree) reports, and learns its policy's state.

    The gateway's implementation writes to the database; a remote worker's sends the same
    calls over the wire. ``policy_state`` and ``wait_until_unpaused`` are called before every
    policy turn of every episode, so they must be cheap: pushed or cached, never a query per
    call.
    """

    async def record_step(self, episode_id: str, step: StepRecord) -> None:
        """Keep one finished turn (live progress: the trainer sees steps as they happen)."""

    async def finish(self, episode_id: str, result: EpisodeResult) -> None:
        """Keep a branch's result (the trunk's is returned to the executor, which stores it)."""

    async def spawn_branches(self, parent_episode_id: str, turn: int, n: int) -> list[str]:
        """Create ``n`` branch episodes of ``parent_episode_id`` forked at ``turn``; return their ids."""

    async def policy_state(self) -> PolicyState:
        """The policy's announced version and pause flag, at most moments old."""

    async def wait_until_unpaused(self) -> None:
        """Return once the policy is not paused."""


# ---------------------------------------------------------------------------- sessions and sandboxes

#: Metadata key of the snapshots the sessions API takes (the session id); the gateway's rows track them.
SESSION_SNAPSHOT_KEY = "forkyard.session"


class SandboxStatus(str, enum.Enum):
    """A sandbox's lifecycle on the wire: the values of :class:`sandboxes.base.SandboxState`.

    The sandboxes layer cannot import this module, nor the gateway that one; a test checks
    that the two enums hold the same values.
    """

    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"
    STOPPING = "stopping"
    GONE = "gone"
    FAILED = "failed"


class SandboxView(Protocol):
    """What the gateway reads of one sandbox (a backend's ``SandboxInfo`` or a :class:`SandboxWire`)."""

    @property
    def id(self) -> str: ...
    @property
    def backend(self) -> str: ...
    @property
    def node(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def image(self) -> str: ...
    @property
    def created_at(self) -> float: ...
    @property
    def labels(self) -> Mapping[str, str]: ...


class StepView(Protocol):
    """What the gateway reads of one step's outcome (an env's ``StepResult`` or a :class:`StepWire`)."""

    @property
    def observation(self) -> str: ...
    @property
    def reward(self) -> float | None: ...
    @property
    def terminated(self) -> bool: ...
    @property
    def truncated(self) -> bool: ...
    @property
    def info(self) -> Mapping[str, Any]: ...
    @property
    def artifacts(self) -> Mapping[str, bytes]:
        """Files the step made (a screenshot), by name: the gateway stores them and links them in ``info``."""


class OpenedView(Protocol):
    """What the gateway reads of a session just opened or forked."""

    @property
    def session_id(self) -> str: ...
    @property
    def sandbox(self) -> SandboxView: ...
    @property
    def observation(self) -> str: ...
    @property
    def tools(self) -> list[dict[str, Any]]: ...


class SnapshotPlace(Protocol):
    """Where a snapshot lives: its backend's id for it, the backend, the node."""

    @property
    def id(self) -> str: ...
    @property
    def backend(self) -> str: ...
    @property
    def node(self) -> str: ...


class SnapshotView(Protocol):
    """What the gateway reads of a session's snapshot: its id, where it lives, its JSON form."""

    @property
    def id(self) -> str: ...
    @property
    def sandbox(self) -> SnapshotPlace: ...

    def to_json(self) -> dict[str, Any]: ...


class SandboxWire(BaseModel):
    """One sandbox as it crosses the wire (the fields of ``SandboxInfo``)."""

    model_config = ConfigDict(frozen=True)

    id: str
    backend: str
    node: str
    state: SandboxStatus
    image: str
    created_at: float
    labels: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def of(cls, info: SandboxView) -> SandboxWire:
        return cls(id=info.id, backend=info.backend, node=info.node, state=SandboxStatus(info.state),
                   image=info.image, created_at=info.created_at, labels=dict(info.labels))


class StepWire(BaseModel):
    """One step's outcome as it crosses the wire (the fields of ``StepResult``).

    ``artifacts`` travel as url-safe base64 text in JSON (:func:`wire_json_default` writes them).
    """

    model_config = ConfigDict(frozen=True, ser_json_bytes="base64", val_json_bytes="base64")

    observation: str
    reward: float | None
    terminated: bool
    truncated: bool
    info: dict[str, Any] = Field(default_factory=dict)
    artifacts: dict[str, bytes] = Field(default_factory=dict)

    @classmethod
    def of(cls, result: StepView) -> StepWire:
        return cls(observation=result.observation, reward=result.reward, terminated=result.terminated,
                   truncated=result.truncated, info=dict(result.info), artifacts=dict(result.artifacts))


def wire_json_default(value: Any) -> Any:
    """``json.dumps`` default for wire data: bytes as url-safe base64 (what :class:`StepWire` reads), else str."""
    if isinstance(value, bytes):
        import base64

        return base64.urlsafe_b64encode(value).decode("ascii")
    return str(value)


class OpenedWire(BaseModel):
    """A session just opened or forked, as it crosses the wire (the fields of ``SessionOpened``)."""

    model_config = ConfigDict(frozen=True)

    session_id: str
    sandbox: SandboxWire
    observation: str
    tools: list[dict[str, Any]]

    @classmethod
    def of(cls, opened: OpenedView) -> OpenedWire:
        return cls(session_id=opened.session_id, sandbox=SandboxWire.of(opened.sandbox),
                   observation=opened.observation, tools=list(opened.tools))


@dataclasses.dataclass(frozen=True)
class SnapshotPlaceWire:
    """Where a snapshot lives (the ``sandbox`` part of a session snapshot's JSON form)."""

    id: str
    backend: str
    node: str


class SnapshotWire:
    """A session's snapshot held by a worker, known by its JSON form (``EnvSnapshot.to_json()``)."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)
        place = self._data["sandbox"]
        self.sandbox = SnapshotPlaceWire(id=str(place["id"]), backend=str(place.get("backend") or ""),
                                         node=str(place.get("node") or ""))
        """Where it lives: the node holding it is where its forks start."""

    @property
    def id(self) -> str:
        return self.sandbox.id

    def to_json(self) -> dict[str, Any]:
        return self._data


@runtime_checkable
class WorkerClient(Protocol):
    """The sessions API's way into the data plane: the sessions and snapshots of one runtime.

    The embedded mode's in-process ``WorkerRuntime`` is one; the distributed mode's
    ``FleetRuntime`` (a gateway's client of the worker nodes) is the other. Errors are
    :class:`workers.errors.WorkerError` subclasses, mapped at the API's edge by their code.
    """

    @property
    def backend_name(self) -> str: ...

    loads_tasks: bool
    """True: the worker loads a session's task itself by its id (the ``forkyard.task`` label), so the
    gateway passes ``task=None``; False: the gateway passes the decoded task."""

    sole_gateway: bool
    """True: every call on a session it holds comes through this process (the embedded mode), so
    the gateway may keep what it knows of an open session in memory; False: other gateways step
    its sessions too (the distributed mode)."""

    async def open_session(self, session_id: str, task: Any, *, labels: Mapping[str, str] | None = None,
                           env_version: str = "") -> OpenedView: ...

    def has_session(self, session_id: str) -> bool: ...

    def session_count(self) -> int: ...

    async def step(self, session_id: str, tool: str, arguments: dict[str, Any]) -> StepView: ...

    async def close_session(self, session_id: str) -> None: ...

    async def snapshot_session(self, session_id: str, *, metadata: Mapping[str, str] | None = None
                               ) -> SnapshotView: ...

    def snapshot_from_json(self, data: Mapping[str, Any]) -> SnapshotView:
        """Return the snapshot :meth:`SnapshotView.to_json` described, as this runtime forks from it."""
        ...

    async def fork_session(self, snapshot: Any, new_session_ids: list[str], task: Any, *,
                           labels: Mapping[str, str] | None = None,
                           launched: Callable[[], None] | None = None) -> Sequence[OpenedView]:
        """Start one session per id, continuing from ``snapshot``.

        ``launched`` (optional) is called, in the event loop's thread and perhaps more than
        once, when the forks' starts no longer need this process (their sandboxes' processes
        are spawned, or another host does the work): the caller's own work fits there.
        It may never be called.
        """
        ...

    async def delete_snapshot(self, snapshot_id: str, *, node: str | None = None) -> None: ...

    async def list_sandboxes(self) -> Sequence[SandboxView]: ...

    async def reap(self, keep_owner_ids: set[str] = ...) -> list[str]: ...

    async def sweep_transient_snapshots(self, keep_session_snapshots: set[str] | None = None) -> list[str]: ...
