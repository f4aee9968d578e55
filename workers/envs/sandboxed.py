"""What every family's environment on one sandbox shares: its lifecycle, the agent's clock and the bash tool.

A family's environment subclasses :class:`SandboxedEnv` and implements ``_finish`` (end
the episode and verify). The ``bash`` and ``submit`` tools are defined here once: the
terminal family offers them alone, the SWE family beside its editor.

The observation of a bash step is, in this order and each only when present::

    <stdout>
    [stderr]
    <stderr>
    [output truncated]
    [timed out after 60s]
    [exit code: N]
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sandboxes.base import ExecResult, SandboxBackend, SandboxInfo, SandboxSpec
from sandboxes.errors import SandboxCrashedError, SandboxError
from sandboxes.snapshots import Snapshot
from workers.envs.base import StepResult, ToolSpec
from workers.errors import ActionError, SessionClosedError
from workers.protocol import EpisodeOutcome

if TYPE_CHECKING:
    from workers.pool import WarmPool, Warmup

#: Seconds a bash call may run when the agent gives no timeout (and the caller no budget).
logger = logging.getLogger(__name__)

DEFAULT_COMMAND_TIMEOUT_S = 60.0
#: Label naming what a sandbox is for (``verifier``, ``grader``, ``control``).
LABEL_ROLE = "forkyard.role"
#: ``info.cause`` of an episode whose agent took its own sandbox down: scored on what it left.
CAUSE_SANDBOX_CRASHED = "sandbox_crashed"
#: ``info.cause`` of an episode whose files no verifier could start on (while a fresh sandbox does).
CAUSE_SANDBOX_BROKEN = "sandbox_broken"
#: ``info.cause`` of a verdict refused for tampering (``info.tamper`` lists what was found).
CAUSE_TAMPER = "tamper"
#: ``info.cause`` of tests that ran past their limit on the agent's work but not on a fresh reset of the task.
CAUSE_TESTS_TIMED_OUT = "tests_timed_out"
#: Metadata key of the files a reset left, kept while the episode runs: what the agent's changes are
#: measured against (the runtime sweeps those a crash left).
BASE_SNAPSHOT_KEY = "forkyard.base"
#: Bytes of stdout (and, separately, stderr) an observation keeps per command.
DEFAULT_MAX_OUTPUT_BYTES = 32 * 1024

BASH_TOOL = ToolSpec(
    name="bash",
    description=(
        "Run a bash command in the task's terminal and return its stdout, stderr and exit code. "
        "The shell persists between calls (cd and export carry over). Commands get no stdin; "
        "do not start interactive programs."
    ),
    parameters={
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The bash command to run."},
            "timeout": {
                "type": "number",
                "description": f"Seconds before the command is killed (default {DEFAULT_COMMAND_TIMEOUT_S:g}).",
            },
        },
        "required": ["command"],
        "additionalProperties": False,
    },
)

SUBMIT_TOOL = ToolSpec(
    name="submit",
    description="Finish the task: call this once the work is done; the result is then checked.",
    parameters={"type": "object", "properties": {}, "additionalProperties": False},
    ends_episode=True,
)


def format_exec_result(result: ExecResult, *, timeout_s: float | None = None) -> str:
    """Render a command's outcome as the observation text the agent sees."""
    parts: list[str] = []
    if result.stdout:
        parts.append(result.stdout if result.stdout.endswith("\n") else result.stdout + "\n")
    if result.stderr:
        stderr = result.stderr if result.stderr.endswith("\n") else result.stderr + "\n"
        parts.append("[stderr]\n" + stderr)
    if result.truncated:
        parts.append("[output truncated]\n")
    if result.timed_out:
        after = f" after {round(timeout_s, 1):g}s" if timeout_s is not None else ""
        parts.append(f"[timed out{after}]\n")
    parts.append(f"[exit code: {result.exit_code}]")
    return "".join(parts)


def finite_number(value: object) -> float | None:
    """Return ``value`` as a float if it is a finite int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def bash_arguments(arguments: Mapping[str, Any]) -> tuple[str, float | None]:
    """Return (command, timeout or None) of a bash call's arguments; raise ActionError if they are invalid."""
    unknown = sorted(set(arguments) - {"command", "timeout"})
    if unknown:
        raise ActionError(f"bash takes 'command' and optional 'timeout', not {', '.join(map(repr, unknown))}")
    command = arguments.get("command")
    if not isinstance(command, str):
        raise ActionError(f"bash needs a 'command' string, got {command!r}")
    if not command.strip():
        raise ActionError("bash needs a non-empty 'command'")
    if "\x00" in command:
        raise ActionError("the bash command must not contain NUL bytes")
    timeout = arguments.get("timeout")
    if timeout is None:
        return command, None
    number = finite_number(timeout)
    if number is None or number <= 0:
        raise ActionError(f"bash 'timeout' must be a positive number of seconds, got {timeout!r}")
    return command, number


def check_no_arguments(tool: str, arguments: Mapping[str, Any]) -> None:
    """Raise ActionError if a tool that takes no arguments got some."""
    if arguments:
        raise ActionError(f"{tool} takes no arguments, got {', '.join(map(repr, sorted(arguments)))}")


#: Most tamper findings a verdict lists (``info.tamper_more`` counts the rest).
MAX_TAMPER_LISTED = 50


@dataclass
class Verdict:
    """What verifying an episode found: a reward, or whose fault it is that there is none.

    ``details`` holds the family's own keys of the final step's info (the terminal verifier's
    ``reward_details`` and ``verifier``; SWE's ``grading``).
    """

    reward: float | None = None
    outcome: EpisodeOutcome = EpisodeOutcome.REWARD
    cause: str | None = None
    error: str | None = None
    tamper: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    took_s: float = 0.0
    """How long the tests ran (not part of the info: a step's info stays the same for the same work)."""

    def refuse(self, reason: str, *, cause: str) -> None:
        """Score 0 for what the agent did (``cause``), without a verdict of the tests."""
        self.reward, self.cause, self.error = 0.0, cause, reason

    def fail(self, reason: str) -> None:
        """No reward: the verifier failed (timed out, crashed, left no readable reward). Never a 0."""
        self.reward, self.outcome, self.error = None, EpisodeOutcome.VERIFIER_ERROR, reason

    def info(self) -> dict[str, Any]:
        """Return the final step's info (see :class:`~workers.protocol.EpisodeOutcome` for ``outcome``)."""
        info: dict[str, Any] = {"outcome": self.outcome.value, **self.details}
        if self.cause is not None:
            info["cause"] = self.cause
        if self.tamper:
            info["tamper"] = _diverse(self.tamper, MAX_TAMPER_LISTED)
            if len(self.tamper) > MAX_TAMPER_LISTED:
                info["tamper_more"] = len(self.tamper) - MAX_TAMPER_LISTED
        if self.error is not None:
            info["verifier_error" if self.outcome is EpisodeOutcome.VERIFIER_ERROR else "reason"] = self.error
        return info

    def ending(self, observation: str, *, truncated: bool, refused: str) -> StepResult:
        """Return the episode's final step: ``observation``, then what the verdict is and why."""
        lines = [observation.rstrip("\n")]
        if self.cause == CAUSE_TAMPER:
            lines.append(f"[verdict refused: {refused} ({len(self.tamper)} finding(s), see info.tamper)]")
        elif self.error is not None:
            kind = "verifier error" if self.outcome is EpisodeOutcome.VERIFIER_ERROR else "no verdict of the tests"
            lines.append(f"[{kind}: {self.error}]")
        lines.append(f"[reward: {self.reward:g}]" if self.reward is not None else "[reward: none]")
        return StepResult(observation="\n".join(lines), reward=self.reward, terminated=not truncated,
                          truncated=truncated, info=self.info())

    def summary(self) -> str:
        """Return the verdict in a few words, for the log."""
        return ((f"reward {self.reward:g}" if self.reward is not None else "no reward")
                + (f", cause {self.cause}" if self.cause else "") + (f" ({self.error})" if self.error else ""))


def _diverse(findings: list[dict[str, Any]], most: int) -> list[dict[str, Any]]:
    """Return at most ``most`` findings, taking each reason in turn: one deleted directory of a thousand
    files must not hide the one ``.pth`` beside it."""
    by_why: dict[str, list[dict[str, Any]]] = {}
    for finding in findings:
        by_why.setdefault(str(finding.get("why")), []).append(finding)
    picked: list[dict[str, Any]] = []
    for rank in range(len(findings)):
        for group in by_why.values():
            if rank < len(group) and len(picked) < most:
                picked.append(group[rank])
        if len(picked) >= most:
            break
    return picked


class SandboxedEnv:
    """The part of an environment that is one sandbox, an agent clock and a step count."""

    def __init__(self, backend: SandboxBackend, *, agent_timeout_s: float,
                 counters: collections.Counter[str] | None = None,
                 max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES, pool: WarmPool | None = None) -> None:
        self.backend = backend
        self.pool = pool
        self.counters = counters
        self.max_output_bytes = max_output_bytes
        self.sandbox: SandboxInfo | None = None
        self.steps = 0
        self.agent_timeout_s = agent_timeout_s
        self._deadline: float | None = None
        self._done = False
        self._closed = False
        self._lock = asyncio.Lock()
        self._base: Snapshot | None = None
        """What the agent started from when it is not the image: a snapshot of what reset left (the setup
        cache's, or one this env took). The verdict measures the agent's changes against it."""
        self._owned_base: Snapshot | None = None
        """A base snapshot this env took (deleted at the next reset and at close)."""

    @property
    def done(self) -> bool:
        """Tell whether the episode has ended."""
        return self._done

    def time_left(self) -> float:
        """Return the seconds of agent time left (the full budget before reset)."""
        if self._deadline is None:
            return self.agent_timeout_s
        return self._deadline - time.monotonic()

    def _start_clock(self, seconds: float | None = None) -> None:
        self.steps, self._done = 0, False
        self._deadline = time.monotonic() + (self.agent_timeout_s if seconds is None else seconds)

    async def close(self) -> None:
        """Destroy the sandbox and the base snapshot this env took; later calls do nothing."""
        async with self._lock:
            self._closed = self._done = True
            await self._destroy_sandbox()
            await self._drop_base()

    async def _keep_base(self, name: str) -> None:
        """Keep the files as reset left them (files only, a snapshot this env owns) as the base of the verdict."""
        self._base = self._owned_base = await self.backend.snapshot(
            self._sandbox_id(), metadata={BASE_SNAPSHOT_KEY: name}, shell_state=False)

    async def _drop_base(self) -> None:
        owned, self._owned_base, self._base = self._owned_base, None, None
        if owned is not None:
            await asyncio.shield(self.backend.delete_snapshot(owned.id))

    def _base_state(self) -> dict[str, Any] | None:
        """Return the base as :meth:`export_state` carries it to forks (which never own it)."""
        return self._base.to_json() if self._base is not None else None

    def _adopt_base(self, state: Mapping[str, Any]) -> None:
        """Take the base a fork's state names (see :meth:`_base_state`)."""
        base = state.get("base")
        self._base = Snapshot.from_json(base) if base else None

    async def _destroy_sandbox(self) -> None:
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            await self.backend.destroy(sandbox.id)

    async def _create_sandbox(self, spec: SandboxSpec, *, warmup: Warmup | None = None) -> SandboxInfo:
        """Start a sandbox for ``spec``: claimed from the warm pool when it has one (warmed by ``warmup``), else cold."""
        if self.pool is not None:
            return await self.pool.create(spec, warmup=warmup)
        return await self.backend.create(spec)

    async def _restore_setup(self, snapshot: Snapshot, spec: SandboxSpec) -> SandboxInfo:
        """Start a sandbox from the setup cache's ``snapshot``: claimed from the warm pool when it has one."""
        if self.pool is not None:
            return await self.pool.restore(snapshot, spec)
        (info,) = await self.backend.restore(snapshot, 1, spec=spec)
        return info

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("the environment is closed")
        if self._done:
            raise SessionClosedError("the episode has ended; reset to start another")
        if self.sandbox is None:
            raise SessionClosedError("the environment has not been reset")

    def _sandbox_id(self) -> str:
        assert self.sandbox is not None
        return self.sandbox.id

    def _count(self, name: str) -> None:
        if self.counters is not None:
            self.counters[name] += 1

    def _took_step(self) -> None:
        self.steps += 1
        self._count("env_steps")

    async def _finish(self, observation: str, *, truncated: bool, cause: str | None = None) -> StepResult:
        """End the episode, verify it and return the final step (each family's own).

        ``cause`` says what the agent did that ended it early (``sandbox_crashed``); it goes
        in the final step's ``info.cause`` beside the verdict on what the agent left.
        """
        raise NotImplementedError

    def _spec(self) -> SandboxSpec:
        """Return the spec of a fresh sandbox of the task (each family's own)."""
        raise NotImplementedError

    async def fresh_sandbox_starts(self) -> bool:
        """Tell whether a fresh sandbox of the task starts now on this backend.

        The control that tells what the agent did to its own sandbox (reward 0, with the
        cause) from what the host did (an infrastructure failure, never a 0): when the
        agent's sandbox, or one made of its files, will not run, a fresh one that does
        puts the fault on the agent's files.
        """
        spec = dataclasses.replace(self._spec(), network=False, network_of=None,
                                   labels={**self._spec().labels, LABEL_ROLE: "control"})
        try:
            info = await self.backend.create(spec)
        except SandboxError as exc:
            logger.warning("a control sandbox of image %s did not start either: %s", spec.image, exc)
            return False
        await self.backend.destroy(info.id)
        return True

    async def _out_of_time(self, observation: str) -> StepResult:
        note = f"[episode ended: agent time limit of {self.agent_timeout_s:g}s reached]\n"
        return await self._finish(observation + note, truncated=True)

    async def _bash_step(self, arguments: Mapping[str, Any], budget_s: float | None) -> StepResult:
        """Run one bash call in the sandbox's shell; a command cut short by the agent's deadline ends the episode.

        With ``budget_s`` (the time the caller gives this step) the call's timeout is capped
        to it in whole seconds, and a call that names none gets it: members of a shared group,
        whose budgets differ by milliseconds, then issue the same call.
        """
        command, requested = bash_arguments(arguments)
        if budget_s is not None:
            cap = max(1.0, float(math.floor(budget_s)))
            requested = min(requested, cap) if requested is not None else cap
        self._took_step()
        left = self.time_left()
        if left <= 0:
            return await self._out_of_time("")
        wanted = requested if requested is not None else DEFAULT_COMMAND_TIMEOUT_S
        timeout = min(wanted, left)
        try:
            result = await self.backend.exec(self._sandbox_id(), command, timeout_s=timeout,
                                             max_output_bytes=self.max_output_bytes)
        except SandboxCrashedError as exc:
            # The command took the sandbox down (killed its shell, deleted bash, ...): the agent's
            # doing, scored on what it left, unless a fresh sandbox will not start either.
            if not await self.fresh_sandbox_starts():
                raise
            return await self._finish(f"[the sandbox stopped working: {exc}]\n", truncated=True,
                                      cause=CAUSE_SANDBOX_CRASHED)
        observation = format_exec_result(result, timeout_s=timeout)
        if self.time_left() <= 0 or (result.timed_out and wanted >= left):
            return await self._out_of_time(observation + "\n")
        return StepResult(observation=observation, reward=None, terminated=False, truncated=False,
                          info={"exit_code": result.exit_code, "timed_out": result.timed_out,
                                "time_left_s": self.time_left()})


__all__ = ["MAX_TAMPER_LISTED", "Verdict", "BASE_SNAPSHOT_KEY", "BASH_TOOL", "CAUSE_SANDBOX_BROKEN", "CAUSE_SANDBOX_CRASHED", "CAUSE_TAMPER",
           "CAUSE_TESTS_TIMED_OUT", "DEFAULT_COMMAND_TIMEOUT_S",
           "LABEL_ROLE", "DEFAULT_MAX_OUTPUT_BYTES", "SUBMIT_TOOL", "SandboxedEnv",
           "bash_arguments", "check_no_arguments", "finite_number", "format_exec_result"]
