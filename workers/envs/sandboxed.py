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
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sandboxes.base import ExecResult, SandboxBackend, SandboxInfo, SandboxSpec
from workers.envs.base import StepResult, ToolSpec
from workers.errors import ActionError, SessionClosedError

if TYPE_CHECKING:
    from sandboxes.snapshots import Snapshot
    from workers.pool import WarmPool, Warmup

#: Seconds a bash call may run when the agent gives no timeout (and the caller no budget).
DEFAULT_COMMAND_TIMEOUT_S = 60.0
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
        """Destroy the sandbox; later calls do nothing."""
        async with self._lock:
            self._closed = self._done = True
            await self._destroy_sandbox()

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

    async def _finish(self, observation: str, *, truncated: bool) -> StepResult:
        """End the episode, verify it and return the final step (each family's own)."""
        raise NotImplementedError

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
        result = await self.backend.exec(self._sandbox_id(), command, timeout_s=timeout,
                                         max_output_bytes=self.max_output_bytes)
        observation = format_exec_result(result, timeout_s=timeout)
        if self.time_left() <= 0 or (result.timed_out and wanted >= left):
            return await self._out_of_time(observation + "\n")
        return StepResult(observation=observation, reward=None, terminated=False, truncated=False,
                          info={"exit_code": result.exit_code, "timed_out": result.timed_out,
                                "time_left_s": self.time_left()})


__all__ = ["BASH_TOOL", "DEFAULT_COMMAND_TIMEOUT_S", "DEFAULT_MAX_OUTPUT_BYTES", "SUBMIT_TOOL", "SandboxedEnv",
           "bash_arguments", "check_no_arguments", "finite_number", "format_exec_result"]
