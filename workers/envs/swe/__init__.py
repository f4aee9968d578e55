"""The SWE family: SWE-bench-style instances on real repositories, graded like the reference harness.

- :mod:`~workers.envs.swe.task`: the instance schema and JSONL import;
- :mod:`~workers.envs.swe.repos`: the offline repository store;
- :mod:`~workers.envs.swe.image`: one environment image per repository version;
- :mod:`~workers.envs.swe.env`: the environment (``bash``, ``str_replace_editor``, ``submit``);
- :mod:`~workers.envs.swe.editor`: the editor tool;
- :mod:`~workers.envs.swe.patch`: the agent's change, taken host-side, and what in it is tamper;
- :mod:`~workers.envs.swe.grading`: log parsers and the FAIL_TO_PASS / PASS_TO_PASS verdict.

Registered as ``swe`` in :mod:`workers.envs.registry`. Its one option is the repository
store (:meth:`SWEFamily.configure`, ``FORKYARD_SWE__REPO_STORE``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from sandboxes.base import SandboxInfo
from workers.envs.base import Action, EnvContext, ToolSpec
from workers.envs.swe.env import SWE_ENV_VERSION, TOOLS, SWEEnv, oracle_patch_command
from workers.envs.swe.repos import RepoStore
from workers.envs.swe.task import (
    INSTANCE_FILE,
    SWETask,
    decode_instance,
    encode_instance,
    instance_from_json,
    parse_jsonl,
)
from workers.errors import TaskFormatError

SYSTEM_PROMPT = (
    "You are a software engineer fixing an issue in a repository. Use bash to explore and run code, "
    "str_replace_editor to view and edit files, and call submit when the change is done; it is graded by "
    "the repository's tests. Call exactly one tool per turn."
)


class SWEFamily:
    """The ``swe`` environment family."""

    name = "swe"
    version = SWE_ENV_VERSION
    tools: tuple[ToolSpec, ...] = TOOLS

    def __init__(self) -> None:
        self.repos: RepoStore | None = None
        """Where instances' repositories come from (None: not configured; imports are not checked against it)."""

    def configure(self, *, repo_store: str | os.PathLike[str] | None) -> None:
        """Use the repository store at ``repo_store`` (None: none)."""
        self.repos = RepoStore(repo_store) if repo_store is not None else None

    def load_task(self, name: str, files: Mapping[str, bytes]) -> SWETask:
        """Validate an instance given as ``instance.json``; its id must be ``name``."""
        if set(files) != {INSTANCE_FILE}:
            raise TaskFormatError(f"a swe task is one file, {INSTANCE_FILE}; got {', '.join(sorted(files)) or 'none'}",
                                  file=INSTANCE_FILE)
        import json

        try:
            data = json.loads(files[INSTANCE_FILE])
        except ValueError as exc:
            raise TaskFormatError(f"{INSTANCE_FILE} is not valid JSON: {exc}", file=INSTANCE_FILE) from None
        task = instance_from_json(data)
        if task.instance_id != name:
            raise TaskFormatError(f"the task is named {name!r} but its instance_id is {task.instance_id!r}",
                                  field="instance_id")
        self.check_repos([task])
        return task

    def parse_tasks(self, data: bytes) -> list[SWETask]:
        """Read a JSONL file of instances, each checked against the repository store; all or nothing."""
        tasks = parse_jsonl(data)
        self.check_repos(tasks)
        return tasks

    def check_repos(self, tasks: list[SWETask]) -> None:
        """Refuse instances whose repository or commits the store lacks (when a store is configured).

        Raises:
            TaskFormatError: every missing repository or commit, by instance.
        """
        if self.repos is None:
            return
        problems = []
        for task in tasks:
            for commit in dict.fromkeys([task.base_commit, task.setup_commit]):
                try:
                    self.repos.resolve(task.repo, commit)
                except TaskFormatError as exc:
                    problems.append(f"{task.instance_id}: {exc}")
                    break
        if problems:
            raise TaskFormatError("; ".join(problems[:20]) + (f"; ... and {len(problems) - 20} more"
                                                              if len(problems) > 20 else ""), field="repo")

    def encode_task(self, task: Any) -> bytes:
        """Return the instance's canonical JSON."""
        return encode_instance(_swe(task))

    def decode_task(self, data: bytes) -> SWETask:
        """Return the instance :meth:`encode_task` stored."""
        return decode_instance(data)

    async def prepare_image(self, task: Any, ctx: EnvContext, *, progress: Callable[[str], None] | None = None) -> str:
        """Return the instance's environment image, building it once per repository version."""
        from workers.envs.swe.image import environment_image

        return await environment_image(_swe(task), ctx, self.repos, progress=progress)

    def open(self, task: Any, ctx: EnvContext, *, image: str, labels: Mapping[str, str],
             env_version: str = "") -> SWEEnv:
        """Return a (not yet reset) env for the instance."""
        return SWEEnv(_swe(task), ctx.backend, image=image, repos=self.repos, labels=labels,
                      setup_cache=ctx.setup_cache, env_version=env_version, counters=ctx.counters, pool=ctx.pool)

    def restore(self, task: Any, ctx: EnvContext, sandbox: SandboxInfo, state: Mapping[str, Any], *,
                labels: Mapping[str, str]) -> SWEEnv:
        """Continue an episode on a sandbox restored from its snapshot."""
        return SWEEnv.from_snapshot(_swe(task), ctx.backend, sandbox, state, repos=self.repos, labels=labels,
                                    setup_cache=ctx.setup_cache, counters=ctx.counters)

    def system_prompt(self, task: Any) -> str:
        """Return the software engineer's system prompt."""
        return SYSTEM_PROMPT

    def oracle(self, task: Any) -> list[Action]:
        """Return the gold patch applied through bash, then submit.

        Raises:
            TaskFormatError: the instance has no gold ``patch``.
        """
        task = _swe(task)
        if not task.patch:
            raise TaskFormatError(f"instance {task.instance_id} has no gold patch", field="patch")
        return [Action("bash", {"command": oracle_patch_command(task)}), Action("submit", {})]

    def deterministic(self, task: Any) -> bool:
        """False: test runs and tools read clocks and temp names; groups do not share sandboxes."""
        return False


def _swe(task: Any) -> SWETask:
    if not isinstance(task, SWETask):
        raise TypeError(f"the swe family runs SWETask, not {type(task).__name__}")
    return task


#: The family object the registry hands out.
FAMILY = SWEFamily()

__all__ = ["FAMILY", "SYSTEM_PROMPT", "SWEFamily"]
