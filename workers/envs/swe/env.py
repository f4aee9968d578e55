"""One SWE episode: the repository at its base commit, bash, an editor, and grading on submit.

Reset starts a sandbox from the instance's environment image and writes the repository
at ``base_commit`` into the workdir as a fresh git repository of one commit (no later
history, no objects of the fix), plus the bug for a ``patch_kind = "bug"`` instance.
With a setup cache the result is snapshotted once per (instance, image), and later
resets restore it.

Grading follows the reference harness: the agent's change is the diff of the workdir
against that base commit (untracked files included), taken from the agent's sandbox
without touching it; the grader is a fresh sandbox of the instance as reset left it,
where that diff is applied (less any change to test files, ``conftest.py``, pytest's
option files or startup hooks, which would let a patch decide its own grade), then
``test_patch``, then ``test_cmd`` runs between markers (:mod:`~workers.envs.swe.grading`).
Nothing the agent left running, installed or wrote outside the workdir reaches the grader.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import logging
import re
import shlex
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sandboxes.base import Resources, SandboxBackend, SandboxInfo, SandboxSpec
from sandboxes.errors import (
    BackendUnavailableError,
    FileTooLargeError,
    SandboxCrashedError,
    SandboxError,
    SandboxNotFoundError,
)
from workers.envs.base import Action, EnvSnapshot, StepResult, ToolSpec
from workers.envs.sandboxed import (
    BASH_TOOL,
    SUBMIT_TOOL,
    SandboxedEnv,
    check_no_arguments,
)
from workers.envs.swe.editor import EDITOR_TOOL, Editor
from workers.envs.swe.grading import (
    END_MARKER,
    EXIT_MARKER,
    START_MARKER,
    grade,
    is_test_path,
)
from workers.envs.swe.repos import RepoStore
from workers.envs.swe.task import SWETask
from workers.errors import ActionError, SessionClosedError, TaskSetupError
from workers.setup_cache import SetupCacheKey

if TYPE_CHECKING:
    from workers.pool import WarmPool
    from workers.setup_cache import SetupCache

logger = logging.getLogger(__name__)

#: Version of what a reset leaves in the sandbox (part of every setup cache key).
SWE_ENV_VERSION = "1"
TOOLS: tuple[ToolSpec, ...] = (BASH_TOOL, EDITOR_TOOL, SUBMIT_TOOL)
#: The most of the agent's diff the grader takes; a bigger change is graded 0 with the reason.
MAX_PATCH_BYTES = 4 * 1024 * 1024
#: The most of the grader's log read back.
MAX_LOG_BYTES = 16 * 1024 * 1024
_GRADE_DIR = "/tmp/forkyard-grade"
_BASE_TAR = "/tmp/forkyard-base.tar"
_STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_HOUSEKEEPING_TIMEOUT_S = 300.0
_GIT = "git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c user.name=forkyard -c user.email=forkyard@localhost"


def _subshell(command: str) -> str:
    return f"(PATH={_STANDARD_PATH}; set -e; {command})"


class SWEEnv(SandboxedEnv):
    """One episode of a SWE instance in one sandbox."""

    def __init__(
        self,
        task: SWETask,
        backend: SandboxBackend,
        *,
        image: str,
        repos: RepoStore | None,
        labels: Mapping[str, str] | None = None,
        setup_cache: SetupCache | None = None,
        env_version: str = "",
        counters: collections.Counter[str] | None = None,
        pool: WarmPool | None = None,
    ) -> None:
        super().__init__(backend, agent_timeout_s=task.agent_timeout_s, counters=counters, pool=pool)
        self.task = task
        self.image = image
        self.repos = repos
        self.labels = dict(labels or {})
        self.setup_cache = setup_cache
        self.env_version = env_version
        self.base_id = ""
        """The workdir's one commit: the agent's change is the diff against it."""
        self.editor = Editor(backend, task.workdir)

    @property
    def tools(self) -> tuple[ToolSpec, ...]:
        """``bash``, ``str_replace_editor`` and ``submit``."""
        return TOOLS

    async def reset(self) -> str:
        """Start a sandbox with the repository at the instance's base commit; return the problem statement."""
        async with self._lock:
            if self._closed:
                raise SessionClosedError("the environment is closed")
            await self._destroy_sandbox()
            self._count("resets")
            self.sandbox, self.base_id = await self._start()
            self.editor = Editor(self.backend, self.task.workdir)
            self._start_clock()
            logger.info("swe instance %s: sandbox %s ready (image %s)", self.task.instance_id, self.sandbox.id,
                        self.image)
            return self.task.instruction

    async def step(self, action: Action, *, budget_s: float | None = None) -> StepResult:
        """Apply one tool call; ``submit`` (or running out of time) grades the episode.

        Raises:
            ActionError: unknown tool or invalid arguments (the episode goes on).
            SessionClosedError: the episode has ended or the env is closed.
        """
        async with self._lock:
            self._check_open()
            tool, arguments = action.tool, action.arguments
            if not isinstance(arguments, Mapping):
                raise ActionError(f"the arguments of {tool!r} must be an object, got {type(arguments).__name__}")
            if tool == BASH_TOOL.name:
                return await self._bash_step(arguments, budget_s)
            if tool == EDITOR_TOOL.name:
                self._took_step()
                if self.time_left() <= 0:
                    return await self._out_of_time("")
                observation = await self.editor.run(self._sandbox_id(), arguments)
                return StepResult(observation, None, False, False, {"time_left_s": self.time_left()})
            if tool == SUBMIT_TOOL.name:
                check_no_arguments(tool, arguments)
                self._took_step()
                return await self._finish("[episode ended: submitted]\n", truncated=False)
            raise ActionError(f"unknown tool {tool!r}; the tools are: {', '.join(t.name for t in TOOLS)}")

    async def truncate(self, reason: str) -> StepResult:
        """End the episode early and grade it as it stands."""
        async with self._lock:
            self._check_open()
            return await self._finish(f"[episode ended: {reason}]\n", truncated=True)

    def export_state(self) -> dict[str, Any]:
        """Return what a fork needs to continue this episode (not the sandbox)."""
        return {"image": self.image, "steps": self.steps, "time_left_s": self.time_left(), "base_id": self.base_id,
                "editor_history": self.editor.export_history()}

    async def snapshot(self, *, metadata: Mapping[str, str] | None = None) -> EnvSnapshot:
        """Snapshot the sandbox between steps, with :meth:`export_state`."""
        async with self._lock:
            self._check_open()
            snap = await self.backend.snapshot(self._sandbox_id(), metadata=metadata)
            return EnvSnapshot(snap, self.export_state())

    @classmethod
    def from_snapshot(cls, task: SWETask, backend: SandboxBackend, sandbox: SandboxInfo, state: Mapping[str, Any], *,
                      repos: RepoStore | None, labels: Mapping[str, str] | None = None,
                      setup_cache: SetupCache | None = None, env_version: str = "",
                      counters: collections.Counter[str] | None = None) -> SWEEnv:
        """Wrap a sandbox restored from a snapshot in an env continuing from :meth:`export_state` data."""
        env = cls(task, backend, image=state.get("image") or sandbox.image, repos=repos, labels=labels,
                  setup_cache=setup_cache, env_version=env_version, counters=counters)
        env.sandbox = sandbox
        env.steps = int(state.get("steps") or 0)
        env.base_id = str(state.get("base_id") or "")
        env.editor = Editor(backend, task.workdir, state.get("editor_history") or {})
        env._deadline = time.monotonic() + float(state.get("time_left_s", task.agent_timeout_s))
        return env

    # ------------------------------------------------------------------ internals

    def _spec(self, labels: Mapping[str, str] | None = None) -> SandboxSpec:
        task = self.task
        return SandboxSpec(image=self.image, resources=Resources(cpus=task.cpus, memory_mb=task.memory_mb,
                                                                 disk_mb=task.disk_mb),
                           network=False, labels=dict(labels if labels is not None else self.labels))

    async def _sh(self, sandbox_id: str, command: str, *, what: str, timeout_s: float = _HOUSEKEEPING_TIMEOUT_S,
                  max_output_bytes: int | None = None) -> str:
        result = await self.backend.exec(sandbox_id, _subshell(command), timeout_s=timeout_s,
                                         **({"max_output_bytes": max_output_bytes} if max_output_bytes else {}))
        if result.exit_code != 0 or result.timed_out:
            detail = (result.stderr or result.stdout).strip()[-500:] or f"exit code {result.exit_code}"
            raise SandboxError(f"could not {what} in sandbox {sandbox_id}: {detail}")
        return result.stdout

    async def _start(self, labels: Mapping[str, str] | None = None) -> tuple[SandboxInfo, str]:
        """Return a sandbox with the workdir as reset leaves it (and its base commit), cached when it can be."""
        cache = self.setup_cache
        if cache is None:
            return await self._start_fresh(labels)
        key = SetupCacheKey(environment=f"{self.env_version}+swe.{SWE_ENV_VERSION}",
                            task_hash=self.task.content_hash, image_digest=await self.backend.image_digest(self.image))
        for attempt in (1, 2):
            async with cache.claim(key) as entry:
                if entry is None:
                    self._count("setup_cache_misses")
                    info, base_id = await self._start_fresh(labels)
                    await self._fill(cache, key, info, base_id)
                    return info, base_id
                try:
                    info = await self._restore_setup(entry.snapshot, self._spec(labels))
                except SandboxNotFoundError:
                    if attempt == 2:
                        raise
                    await cache.discard(key)
                    continue
                self._count("setup_cache_hits")
                return info, str(entry.state.get("base_id") or "")
        raise AssertionError("unreachable")

    async def _fill(self, cache: SetupCache, key: SetupCacheKey, info: SandboxInfo, base_id: str) -> None:
        """Cache a snapshot of a freshly reset sandbox; a failure to cache leaves the sandbox as it is."""
        try:
            snap = await self.backend.snapshot(info.id, metadata={"forkyard.kind": "setup",
                                                                  "forkyard.task": self.task.instance_id})
        except (SandboxNotFoundError, SandboxCrashedError, BackendUnavailableError):
            await self.backend.destroy(info.id)
            raise
        except SandboxError:
            logger.warning("swe instance %s: cannot snapshot its reset for the setup cache", self.task.instance_id,
                           exc_info=True)
            return
        try:
            await cache.put(key, snap, {"base_id": base_id})
        except Exception:
            if not cache.holds(snap.id):
                await self.backend.delete_snapshot(snap.id)
            logger.warning("swe instance %s: cannot store its reset in the setup cache", self.task.instance_id,
                           exc_info=True)
        except BaseException:
            if not cache.holds(snap.id):
                await asyncio.shield(self.backend.delete_snapshot(snap.id))
            raise

    async def _start_fresh(self, labels: Mapping[str, str] | None = None) -> tuple[SandboxInfo, str]:
        """Create a sandbox and write the repository at the base commit into the workdir."""
        task = self.task
        if self.repos is None:
            raise TaskSetupError(f"instance {task.instance_id}: no repository store is configured "
                                 "(FORKYARD_SWE__REPO_STORE)")
        try:
            tree = await asyncio.to_thread(self.repos.archive, task.repo, task.base_commit)
        except Exception as exc:
            raise TaskSetupError(f"instance {task.instance_id}: {exc}") from exc
        info = await self._create_sandbox(self._spec(labels))
        try:
            await self.backend.write_file(info.id, _BASE_TAR, tree)
            workdir = shlex.quote(task.workdir)
            bug = ""
            if task.patch_kind == "bug":
                await self.backend.write_file(info.id, f"{_GRADE_DIR}/bug.patch", task.patch.encode())
                bug = f"git apply --whitespace=nowarn {_GRADE_DIR}/bug.patch && rm -rf {_GRADE_DIR} && "
            out = await self._sh(
                info.id,
                f"mkdir -p {workdir} && cd {workdir} && "
                "find . -mindepth 1 -maxdepth 1 ! -name '*.egg-info' -exec rm -rf {} + && "
                f"tar -xf {_BASE_TAR} && rm -f {_BASE_TAR} && {bug}"
                f"git init -q && {_GIT} add -A && {_GIT} commit -q --no-verify -m base && git rev-parse HEAD",
                what="check out the repository",
            )
            self._count("setup_runs")
            return info, out.strip().splitlines()[-1]
        except BaseException:
            await self.backend.destroy(info.id)
            raise

    async def _finish(self, observation: str, *, truncated: bool) -> StepResult:
        self._done = True
        reward, info = await self._grade()
        lines = [observation.rstrip("\n")]
        if info.get("error"):
            lines.append(f"[grading error: {info['error']}]")
        lines.append(f"[reward: {reward:g}]")
        logger.info("swe instance %s: episode ended after %d steps, reward %g", self.task.instance_id, self.steps,
                    reward)
        return StepResult("\n".join(lines), reward, not truncated, truncated, {"grading": info})

    async def agent_patch(self) -> tuple[str, list[str]]:
        """Return the agent's change as a diff against the base commit, and the test paths left out of it."""
        index = f"{_GRADE_DIR}-index"
        base = shlex.quote(self.base_id or "HEAD")
        result = await self.backend.exec(
            self._sandbox_id(),
            _subshell(f"cd {shlex.quote(self.task.workdir)} && rm -f {index} && export GIT_INDEX_FILE={index} && "
                      f"{_GIT} add -A . >/dev/null && {_GIT} diff --cached --binary --no-color {base}; "
                      f"rc=$?; rm -f {index}; exit $rc"),
            timeout_s=_HOUSEKEEPING_TIMEOUT_S, max_output_bytes=MAX_PATCH_BYTES)
        if result.exit_code != 0:
            raise _GradingError(f"could not read the change to the repository: {result.stderr.strip()[-300:]}")
        if result.truncated:
            raise _GradingError(f"the change to the repository is larger than {MAX_PATCH_BYTES // (1024 * 1024)} MiB")
        kept, dropped = [], []
        for chunk in re.split(r"(?m)^(?=diff --git )", result.stdout):
            match = re.match(r"diff --git a/(\S+) b/(\S+)", chunk)
            if match is None:
                continue
            (dropped if is_test_path(match.group(1)) or is_test_path(match.group(2)) else kept).append(chunk)
        return "".join(kept), [re.match(r"diff --git a/\S+ b/(\S+)", c).group(1) for c in dropped]  # type: ignore[union-attr]

    async def _grade(self) -> tuple[float, dict[str, Any]]:
        """Grade the agent's change in a fresh sandbox of the instance; return (reward, info)."""
        info: dict[str, Any] = {}
        grader: SandboxInfo | None = None
        try:
            patch, dropped = await self.agent_patch()
            info["patch_bytes"] = len(patch.encode())
            if dropped:
                info["ignored_test_paths"] = dropped
            labels = {**self.labels, "forkyard.role": "grader"}
            grader, _ = await self._start(labels)
            return await self._grade_in(grader.id, patch, info)
        except _GradingError as exc:
            info["error"] = str(exc)
            return 0.0, info
        except (SandboxNotFoundError, SandboxCrashedError, BackendUnavailableError):
            raise
        except (SandboxError, TaskSetupError, OSError) as exc:
            logger.warning("swe instance %s: grading failed: %s", self.task.instance_id, exc)
            info["error"] = f"grading could not run: {exc}"
            return 0.0, info
        finally:
            if grader is not None:
                await self.backend.destroy(grader.id)

    async def _grade_in(self, sandbox_id: str, patch: str, info: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        task = self.task
        text = await run_tests(self.backend, sandbox_id, task, patches=[("agent", patch), ("test", task.test_patch)],
                               info=info)
        report = grade(text, parser=task.log_parser, fail_to_pass=task.fail_to_pass, pass_to_pass=task.pass_to_pass)
        info.update(report.to_info())
        info["log_tail"] = text[-2048:]
        if report.problem:
            info["error"] = report.problem
        return (1.0 if report.resolved else 0.0), info


async def run_tests(backend: SandboxBackend, sandbox_id: str, task: SWETask, *, patches: list[tuple[str, str]],
                    info: dict[str, Any] | None = None) -> str:
    """Apply ``patches`` (name, diff) in the workdir, run ``test_cmd`` between the markers; return the log.

    Raises:
        _GradingError: a patch does not apply, the tests ran out of time, or the log is too big.
    """
    steps = [f"cd {shlex.quote(task.workdir)}"]
    applied = [(name, patch) for name, patch in patches if patch]
    for code, (name, patch) in enumerate(applied, start=11):
        await backend.write_file(sandbox_id, f"{_GRADE_DIR}/{name}.patch", patch.encode())
        steps.append(f"git apply --whitespace=nowarn {_GRADE_DIR}/{name}.patch || exit {code}")
    log = f"{_GRADE_DIR}/test.log"
    script = "\n".join([
        *steps,
        f"{{ echo '{START_MARKER}'; ( {task.test_cmd} ) ; rc=$?; echo '{END_MARKER}'; "
        f"echo \"{EXIT_MARKER}: $rc\"; }} > {log} 2>&1",
        "exit 0",
    ]) + "\n"
    await backend.write_file(sandbox_id, f"{_GRADE_DIR}/grade.sh", script.encode(), mode=0o755)
    result = await backend.exec(sandbox_id, f"bash {_GRADE_DIR}/grade.sh", timeout_s=task.verifier_timeout_s,
                                max_output_bytes=16 * 1024)
    if result.timed_out:
        raise _GradingError(f"the tests ran past the {task.verifier_timeout_s:g}s limit")
    if 11 <= result.exit_code < 11 + len(applied):
        name = applied[result.exit_code - 11][0]
        if info is not None and name == "agent":
            info["patch_applied"] = False
        whose = "the agent's change" if name == "agent" else f"the {name} patch"
        raise _GradingError(f"{whose} does not apply: {result.stderr.strip()[-500:]}")
    if info is not None:
        info["patch_applied"] = True
    try:
        raw = await backend.read_file(sandbox_id, log, max_bytes=MAX_LOG_BYTES)
    except FileTooLargeError:
        raise _GradingError(f"the test log is larger than {MAX_LOG_BYTES // (1024 * 1024)} MiB") from None
    return raw.decode("utf-8", errors="replace")


class _GradingError(Exception):
    """The agent's change cannot be graded (too big, does not apply, tests ran out of time)."""


def oracle_patch_command(task: SWETask) -> str:
    """Return a bash command that applies the gold solution in the workdir."""
    packed = base64.b64encode(task.patch.encode()).decode("ascii")
    reverse = " -R" if task.patch_kind == "bug" else ""
    return (f"cd {shlex.quote(task.workdir)} && printf %s '{packed}' | base64 -d | "
            f"git apply --whitespace=nowarn{reverse} -")


__all__ = ["SWE_ENV_VERSION", "TOOLS", "SWEEnv", "oracle_patch_command", "run_tests"]
