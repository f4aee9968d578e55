"""The terminal family: Harbor-style task directories in a sandbox, driven by bash.

- :mod:`~workers.envs.terminal.task`: loading, validating, hashing and archiving task dirs;
- :mod:`~workers.envs.terminal.image`: the image a task's sandboxes start from;
- :mod:`~workers.envs.terminal.env`: the environment (``bash`` and ``submit``);
- :mod:`~workers.envs.terminal.verifier`: the reward files ``tests/test.sh`` writes.

Registered as ``terminal`` in :mod:`workers.envs.registry`.
"""

from __future__ import annotations

import base64
import shlex
from collections.abc import Callable, Mapping
from typing import Any

from sandboxes.base import SandboxInfo
from workers.archives import pack_files
from workers.envs.base import Action, EnvContext, ToolSpec
from workers.envs.terminal.env import TERMINAL_ENV_VERSION, TOOLS, TerminalEnv
from workers.envs.terminal.task import (
    SOLUTION_SCRIPT,
    TerminalTask,
    load_task_files,
    task_to_tar,
    tasks_from_tar,
)
from workers.errors import TaskFormatError

#: The system prompt an agent gets unless its rollout gives one.
SYSTEM_PROMPT = (
    "You are an agent working in a Linux shell. Use the bash tool to inspect and change the "
    "system, and call submit when the task is done. Call exactly one tool per turn."
)
#: Where the oracle finds the task's ``solution/`` (Harbor's path).
ORACLE_DIR = "/solution"


class TerminalFamily:
    """The ``terminal`` environment family."""

    name = "terminal"
    version = TERMINAL_ENV_VERSION
    tools: tuple[ToolSpec, ...] = TOOLS

    def load_task(self, name: str, files: Mapping[str, bytes]) -> TerminalTask:
        """Validate a task directory given as files."""
        return load_task_files(name, files)

    def parse_tasks(self, data: bytes) -> list[TerminalTask]:
        """Read the task dirs of a tar archive (plain, gzip, bzip2 or xz)."""
        return tasks_from_tar(data)

    def encode_task(self, task: Any) -> bytes:
        """Return the task as a deterministic tar.gz of its directory."""
        return task_to_tar(_terminal(task))

    def decode_task(self, data: bytes) -> TerminalTask:
        """Return the task :meth:`encode_task` stored."""
        (task,) = tasks_from_tar(data)
        return task

    async def prepare_image(
        self, task: Any, ctx: EnvContext, *, progress: Callable[[str], None] | None = None
    ) -> str:
        """Return the task's image: a real local one, its stand-in, or its Dockerfile built."""
        from workers.envs.terminal.image import task_image

        return await task_image(_terminal(task), ctx, progress=progress)

    def open(self, task: Any, ctx: EnvContext, *, image: str, labels: Mapping[str, str],
             env_version: str = "") -> TerminalEnv:
        """Return a (not yet reset) env for ``task``."""
        return TerminalEnv(_terminal(task), ctx.backend, image=image, labels=labels, setup_cache=ctx.setup_cache,
                           env_version=env_version, counters=ctx.counters, ca_bundle=ctx.ca_bundle,
                           pool=ctx.pool)

    def restore(self, task: Any, ctx: EnvContext, sandbox: SandboxInfo, state: Mapping[str, Any], *,
                labels: Mapping[str, str]) -> TerminalEnv:
        """Continue an episode on a sandbox restored from its snapshot."""
        return TerminalEnv.from_snapshot(_terminal(task), ctx.backend, sandbox, state, labels=labels,
                                         counters=ctx.counters)

    def system_prompt(self, task: Any) -> str:
        """Return the shell agent's system prompt."""
        return SYSTEM_PROMPT

    def oracle(self, task: Any) -> list[Action]:
        """Return the oracle as Harbor runs it: ``solution/`` at /solution, ``solve.sh`` run, then submit.

        One ``bash`` call unpacks the task's ``solution/`` into ``/solution`` (a gzipped tar
        inlined as base64: it goes through the agent's own tool, nothing else) and runs
        ``bash /solution/solve.sh`` from the shell's directory with stdin from /dev/null, so
        a command in the script that reads stdin gets end-of-file, not the rest of the script.

        Raises:
            TaskFormatError: the task ships no ``solution/solve.sh``.
        """
        task = _terminal(task)
        files = task.solution_files
        if "solve.sh" not in files:
            raise TaskFormatError(f"task {task.name!r} has no oracle: {SOLUTION_SCRIPT} is missing",
                                  file=SOLUTION_SCRIPT)
        archive = pack_files(files, mode=lambda rel: 0o755 if rel.endswith(".sh") else 0o644)
        packed = base64.b64encode(archive).decode("ascii")
        command = (
            f"rm -rf {ORACLE_DIR} && mkdir -p {ORACLE_DIR} && "
            f"printf %s '{packed}' | base64 -d | tar -xzf - -C {ORACLE_DIR} --no-same-owner && "
            f"{_env_prefix(task.solution_env)}bash {ORACLE_DIR}/solve.sh < /dev/null"
        )
        return [Action("bash", {"command": command, "timeout": task.agent_timeout_s}), Action("submit", {})]

    def deterministic(self, task: Any) -> bool:
        """Tell whether the task declares ``[environment] deterministic_tools``."""
        return _terminal(task).deterministic_tools


def _terminal(task: Any) -> TerminalTask:
    if not isinstance(task, TerminalTask):
        raise TypeError(f"the terminal family runs TerminalTask, not {type(task).__name__}")
    return task


def _env_prefix(env: Mapping[str, str]) -> str:
    """Return ``env K=V ... `` for a command run with ``env`` added ("" for none)."""
    if not env:
        return ""
    return "env " + " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items())) + " "


#: The family object the registry hands out.
FAMILY = TerminalFamily()

__all__ = ["FAMILY", "ORACLE_DIR", "SYSTEM_PROMPT", "TerminalFamily"]
