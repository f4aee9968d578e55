"""The environment-family contract: what the runtime, the runner and the gateway know of a family.

A family (``terminal``, ``swe``, a third-party package's) is one object behind
:class:`EnvFamily` plus one line in :mod:`workers.envs.registry`. It loads its tasks,
prepares the image their sandboxes start from, and opens (or restores) an
:class:`Environment` on a sandbox backend. Everything above it (the runtime, the
episode runner, lazy-fork groups, trajectory trees, the sessions API) drives any
family through these types alone:

- an :class:`Environment` is reset, stepped with :class:`Action` values, truncated
  and closed; a step that returns ``terminated`` has verified the episode;
- an environment that can branch is also :class:`Forkable` (checked with
  ``isinstance`` when a rollout or a fork is planned): its :meth:`Forkable.snapshot`
  returns an :class:`EnvSnapshot`, the backend snapshot plus the family's own state,
  from which :meth:`EnvFamily.restore` continues the episode on a restored sandbox;
- the family's :class:`ToolSpec` list is what the agent sees.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from sandboxes.base import SandboxBackend, SandboxInfo
    from sandboxes.snapshots import Snapshot
    from workers.pool import WarmPool
    from workers.setup_cache import SetupCache


@dataclass(frozen=True)
class Action:
    """One tool call of the agent: the tool's name and its arguments."""

    tool: str
    arguments: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Return ``{"tool", "arguments"}`` (the scripted policy's and the step record's shape)."""
        return {"tool": self.tool, "arguments": dict(self.arguments)}


@dataclass(frozen=True)
class StepResult:
    """Gym-style outcome of one action."""

    observation: str
    reward: float | None
    terminated: bool
    """The episode ended and was verified (``reward`` holds the verifier's score)."""
    truncated: bool
    """The episode was cut short (time, max turns) and verified as it stood."""
    info: dict[str, Any] = field(default_factory=dict)
    artifacts: Mapping[str, bytes] = field(default_factory=dict)
    """Files the step made (a page's screenshot), by name: stored apart by the gateway and linked from the
    step, never part of the observation (nor of the tokens a policy sees)."""


@dataclass(frozen=True)
class ToolSpec:
    """One tool the agent sees: a name, what it does and a JSON schema of its arguments."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    ends_episode: bool = False
    """Calling it ends the episode (and runs the verifier), so the runner counts it as verification."""

    def to_openai(self) -> dict[str, Any]:
        """Return the tool as an OpenAI-style function definition."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }


@dataclass(frozen=True)
class EnvSnapshot:
    """A branch point: the backend snapshot of a sandbox plus the family's own state of the episode."""

    sandbox: Snapshot
    state: dict[str, Any]
    """JSON data the family's :meth:`EnvFamily.restore` continues from (steps, time left, cwd...)."""

    @property
    def id(self) -> str:
        """The backend snapshot's id."""
        return self.sandbox.id

    def to_json(self) -> dict[str, Any]:
        """Return the snapshot as plain JSON data."""
        return {"sandbox": self.sandbox.to_json(), "env": dict(self.state)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EnvSnapshot:
        """Build a snapshot from :meth:`to_json` data."""
        from sandboxes.snapshots import Snapshot

        return cls(sandbox=Snapshot.from_json(data["sandbox"]), state=dict(data.get("env") or {}))


@dataclass
class EnvContext:
    """What a family's environments share on one worker: the backend and the worker's caches."""

    backend: SandboxBackend
    image_cache_dir: Path
    base_image: str | None = None
    """The Debian base every built image starts from (set once the runtime has started)."""
    stand_ins: Mapping[str, str] | None = None
    """Image name patterns to stand-ins (:mod:`workers.standins`); None: the default table."""
    setup_cache: SetupCache | None = None
    pool: WarmPool | None = None
    """Started sandboxes made ahead of demand (:mod:`workers.pool`); resets claim from it."""
    ca_bundle: bytes | None = None
    """The host's CA certificates, trusted in builds and networked sandboxes (:mod:`workers.trust`)."""
    counters: collections.Counter[str] = field(default_factory=collections.Counter)
    """What the envs did (``resets``, ``env_steps``, ``setup_runs``, ...)."""
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict, repr=False)

    def lock(self, key: str) -> asyncio.Lock:
        """Return the lock for ``key`` (e.g. one image build shared by concurrent sessions)."""
        return self._locks.setdefault(key, asyncio.Lock())


@runtime_checkable
class EnvTask(Protocol):
    """What every family's task shows beside its own fields."""

    @property
    def family(self) -> str:
        """The family's registry name."""

    @property
    def name(self) -> str: ...

    @property
    def content_hash(self) -> str:
        """sha256 hex of the task's canonical content: equal hashes, equal tasks."""

    @property
    def instruction(self) -> str:
        """What the agent is asked to do (the first user message)."""

    @property
    def metadata(self) -> Mapping[str, Any]: ...

    @property
    def cpus(self) -> float: ...

    @property
    def memory_mb(self) -> int: ...

    @property
    def disk_mb(self) -> int: ...

    @property
    def warnings(self) -> tuple[str, ...]:
        """What of the task's input the family does not use (reported at import)."""


@runtime_checkable
class Environment(Protocol):
    """One episode of one task in one sandbox."""

    @property
    def tools(self) -> Sequence[ToolSpec]: ...

    @property
    def sandbox(self) -> SandboxInfo | None:
        """The sandbox the episode runs in (None before reset and after close)."""

    @property
    def done(self) -> bool:
        """Tell whether the episode has ended."""

    async def reset(self) -> str:
        """Start a sandbox ready for the task and return the first observation.

        It starts with the task's instruction; a family whose start state matters to the
        agent (a web page) adds it after.
        """

    async def step(self, action: Action, *, budget_s: float | None = None) -> StepResult:
        """Apply one action, within ``budget_s`` seconds if given (the family bounds its tools to it).

        Raises:
            ActionError: unknown tool or invalid arguments (the episode goes on).
            SessionClosedError: the episode has ended or the env is closed.
        """

    async def truncate(self, reason: str) -> StepResult:
        """End the episode early and verify it as it stands."""

    async def close(self) -> None:
        """Destroy the sandbox; idempotent."""


@runtime_checkable
class Forkable(Protocol):
    """An environment whose episode can be branched: snapshot now, restore many times."""

    async def snapshot(self, *, metadata: Mapping[str, str] | None = None) -> EnvSnapshot:
        """Snapshot the sandbox between steps, with the family's state of the episode."""


@runtime_checkable
class EnvFamily(Protocol):
    """One kind of environment: its tasks, images, environments, prompt and oracle."""

    name: str
    version: str
    """Bumped when what a reset leaves changes; part of every setup cache key."""
    tools: Sequence[ToolSpec]

    def load_task(self, name: str, files: Mapping[str, bytes]) -> EnvTask:
        """Validate a task given as files (relative posix path -> bytes).

        Raises:
            TaskFormatError: names the file and the field.
        """

    def parse_tasks(self, data: bytes) -> list[EnvTask]:
        """Read the family's import format (a tar of task dirs, a JSONL file...); all or nothing.

        Raises:
            TaskFormatError: names the file (or line) and the field.
        """

    def encode_task(self, task: EnvTask) -> bytes:
        """Return deterministic bytes the gateway stores for ``task``."""

    def decode_task(self, data: bytes) -> EnvTask:
        """Return the task :meth:`encode_task` stored."""

    async def prepare_image(
        self, task: EnvTask, ctx: EnvContext, *, progress: Callable[[str], None] | None = None
    ) -> str:
        """Return the image ``task``'s sandboxes start from, building it on first use."""

    def open(self, task: EnvTask, ctx: EnvContext, *, image: str, labels: Mapping[str, str],
             env_version: str = "") -> Environment:
        """Return a (not yet reset) environment for ``task`` on ``image``."""

    def restore(self, task: EnvTask, ctx: EnvContext, sandbox: SandboxInfo, state: Mapping[str, Any], *,
                labels: Mapping[str, str]) -> Environment:
        """Wrap a sandbox restored from an :class:`EnvSnapshot` in an environment continuing its episode."""

    def system_prompt(self, task: EnvTask) -> str:
        """Return the system prompt an agent gets unless the rollout gives one."""

    def oracle(self, task: EnvTask) -> list[Action]:
        """Return actions that solve ``task`` (its reference solution), ending with the verifying one.

        Raises:
            TaskFormatError: the task has no reference solution.
        """

    def deterministic(self, task: EnvTask) -> bool:
        """Tell whether the same actions from the same state always give the same observations."""


async def run_actions(env: Environment, actions: Sequence[Action]) -> StepResult:
    """Step ``env`` through ``actions`` (an oracle's, say) until one ends the episode; return that step.

    Raises:
        SessionClosedError: no action ended the episode.
    """
    from workers.errors import SessionClosedError

    for action in actions:
        result = await env.step(action)
        if result.terminated or result.truncated:
            return result
    raise SessionClosedError(f"none of the {len(actions)} action(s) ended the episode")


def openai_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """Return the tools as OpenAI-style function definitions."""
    return [tool.to_openai() for tool in tools]


__all__ = [
    "Action",
    "EnvContext",
    "EnvFamily",
    "EnvSnapshot",
    "EnvTask",
    "Environment",
    "Forkable",
    "StepResult",
    "ToolSpec",
    "openai_tools",
    "run_actions",
]
