"""One SWE episode: the repository at its base commit, bash, an editor, and grading on submit.

Reset starts a sandbox from the instance's environment image and writes the repository
at ``base_commit`` into the workdir as a fresh git repository of one commit (no later
history, no objects of the fix), plus the bug for a ``patch_kind = "bug"`` instance.
With a setup cache the result is snapshotted once per (instance, image), and later
resets restore it. What the agent starts from is kept for the episode (the cache's
snapshot, or one of the env's own): the agent's change is measured against it.

Grading follows the reference harness, on a pristine environment:

1. the agent's change is the diff of its workdir against that reset point, taken on
   the host from both snapshots' files with a git that reads no repository
   configuration (:mod:`~workers.envs.swe.patch`): nothing of the agent's sandbox runs
   and nothing of its repository (hooks, config, attributes, filters, an external diff)
   is read;
2. what in it steers its own grade (tests, ``conftest.py``, pytest's configuration,
   startup files, source newly reaching into the test runner) is tamper: the
   instance's ``tamper`` policy fails the episode (reward 0, ``info.cause = "tamper"``)
   or leaves those files out and reports them;
3. a fresh sandbox of the instance (never a fork of the agent's) applies the patch,
   then ``test_patch``, then runs ``test_cmd`` between markers
   (:mod:`~workers.envs.swe.grading`).

The final step's ``info`` says whose result it is: ``outcome`` is ``reward`` (0 included:
``cause`` names what the agent's change did, ``tamper`` lists findings) or
``verifier_error`` (no reward: the tests cannot be run to a verdict even without the
agent's change); ``grading`` holds the details. Nothing the agent left running,
installed or wrote outside the workdir reaches the grader.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import logging
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sandboxes.base import Resources, SandboxBackend, SandboxInfo, SandboxSpec, Snapshot
from sandboxes.errors import (
    BackendUnavailableError,
    FileTooLargeError,
    ImageNotFoundError,
    SandboxCrashedError,
    SandboxError,
    SandboxNotFoundError,
)
from sandboxes.layers import LayerStack
from workers.envs.base import Action, EnvSnapshot, StepResult, ToolSpec
from workers.envs.sandboxed import (
    BASH_TOOL,
    CAUSE_SANDBOX_BROKEN,
    CAUSE_TAMPER,
    CAUSE_TESTS_TIMED_OUT,
    LABEL_ROLE,
    SUBMIT_TOOL,
    SandboxedEnv,
    Verdict,
    check_no_arguments,
)
from workers.envs.swe.editor import EDITOR_TOOL, Editor
from workers.envs.swe.grading import END_MARKER, EXIT_MARKER, START_MARKER, grade
from workers.envs.swe.patch import MAX_PATCH_BYTES, PatchError, take_patch
from workers.envs.swe.repos import RepoStore
from workers.envs.swe.task import SWETask
from workers.envs.tamper import TamperPolicy
from workers.errors import ActionError, SessionClosedError, TaskSetupError
from workers.setup_cache import SetupCacheKey

if TYPE_CHECKING:
    from workers.pool import WarmPool
    from workers.setup_cache import SetupCache

logger = logging.getLogger(__name__)

#: Version of what a reset leaves in the sandbox (part of every setup cache key).
SWE_ENV_VERSION = "1"
TOOLS: tuple[ToolSpec, ...] = (BASH_TOOL, EDITOR_TOOL, SUBMIT_TOOL)
#: The most of the grader's log read back.
MAX_LOG_BYTES = 16 * 1024 * 1024
#: Metadata key of the snapshots grading takes of a sandbox's files (deleted right after; one of
#: the runtime's transient keys, so a crash leaves none behind).
GRADE_SNAPSHOT_KEY = "forkyard.verifier"
#: ``info.cause`` of a reward 0 for what the agent's change did to the grading run.
CAUSE_PATCH_NOT_APPLIED = "patch_not_applied"
CAUSE_TEST_PATCH_NOT_APPLIED = "test_patch_not_applied"
CAUSE_TEST_LOG_TOO_LARGE = "test_log_too_large"
#: A control run that takes more than this share of the test limit tells nothing of a time-out.
_CONTROL_MARGIN = 0.5
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
        """The workdir's one commit, as reset made it."""
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
            await self._drop_base()
            self._count("resets")
            self.sandbox, self.base_id, self._base = await self._start()
            if self._base is None:
                await self._keep_base(self.task.instance_id)
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
                "editor_history": self.editor.export_history(),
                "base": self._base_state()}

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
        env._adopt_base(state)
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

    async def _start(self, labels: Mapping[str, str] | None = None) -> tuple[SandboxInfo, str, Snapshot | None]:
        """Return a sandbox with the workdir as reset leaves it, its base commit and the setup cache's snapshot of it.

        The snapshot is None where the cache holds none (no cache, or caching failed).
        """
        cache = self.setup_cache
        if cache is None:
            return (*await self._start_fresh(labels), None)
        key = SetupCacheKey(environment=f"{self.env_version}+swe.{SWE_ENV_VERSION}",
                            task_hash=self.task.content_hash, image_digest=await self.backend.image_digest(self.image))
        for attempt in (1, 2):
            async with cache.claim(key) as entry:
                if entry is None:
                    self._count("setup_cache_misses")
                    info, base_id = await self._start_fresh(labels)
                    return info, base_id, await self._fill(cache, key, info, base_id)
                try:
                    info = await self._restore_setup(entry.snapshot, self._spec(labels))
                except SandboxNotFoundError:
                    if attempt == 2:
                        raise
                    await cache.discard(key)
                    continue
                self._count("setup_cache_hits")
                return info, str(entry.state.get("base_id") or ""), entry.snapshot
        raise AssertionError("unreachable")

    async def _fill(self, cache: SetupCache, key: SetupCacheKey, info: SandboxInfo, base_id: str) -> Snapshot | None:
        """Cache a snapshot of a freshly reset sandbox and return it; a failure to cache leaves the sandbox as it is."""
        try:
            snap = await self.backend.snapshot(info.id, metadata={"forkyard.kind": "setup",
                                                                  "forkyard.task": self.task.instance_id})
        except (SandboxNotFoundError, SandboxCrashedError, BackendUnavailableError):
            await self.backend.destroy(info.id)
            raise
        except SandboxError:
            logger.warning("swe instance %s: cannot snapshot its reset for the setup cache", self.task.instance_id,
                           exc_info=True)
            return None
        try:
            await cache.put(key, snap, {"base_id": base_id})
            return snap if cache.holds(snap.id) else None
        except Exception:
            if not cache.holds(snap.id):
                await self.backend.delete_snapshot(snap.id)
            logger.warning("swe instance %s: cannot store its reset in the setup cache", self.task.instance_id,
                           exc_info=True)
            return None
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

    async def _finish(self, observation: str, *, truncated: bool, cause: str | None = None) -> StepResult:
        """Grade the agent's change, end the episode and return the final step."""
        self._done = True
        verdict = await self._verify()
        if cause is not None and verdict.cause is None:
            verdict.cause = cause
        logger.info("swe instance %s: episode ended after %d steps, %s", self.task.instance_id, self.steps,
                    verdict.summary())
        return verdict.ending(observation, truncated=truncated, refused="the change touches what decides its own grade")

    async def _verify(self) -> _Verdict:
        """Grade the agent's change in a fresh sandbox of the instance; return the verdict.

        The change is taken host-side from a files-only snapshot of the agent's sandbox (no
        program of it runs) against what the agent started from; when that base snapshot is
        gone (evicted from the setup cache, or taken by the episode this one was forked
        from, which has ended), the fresh grader's own files serve: reset makes the same
        files every time, and nothing has touched the grader yet.
        """
        verdict = _Verdict()
        grader: SandboxInfo | None = None
        taken_snapshots: list[Snapshot] = []
        try:
            base = await self._base_filesystem()
            if base is None:
                grader = await self._start_grader()
                base = await self._files_of(grader.id, taken_snapshots)
            top = await self._files_of(self._sandbox_id(), taken_snapshots)
            policy = self.task.tamper
            try:
                taken = await asyncio.to_thread(take_patch, base, top, self.task.workdir,
                                                leave_out_findings=policy is TamperPolicy.REPORT)
            except PatchError as exc:
                verdict.refuse(str(exc), cause=exc.cause)
                return verdict
            except OSError as exc:  # a layer went while it was read: the host's doing
                raise SandboxError(f"could not read the files of the agent's change: {exc}") from exc
            verdict.grading["patch_bytes"] = len(taken.patch)
            if taken.bytecode_skipped:
                verdict.grading["bytecode_left_out"] = taken.bytecode_skipped
            verdict.tamper = [f.as_dict() for f in taken.findings]
            if taken.findings and policy is TamperPolicy.FAIL:
                verdict.refuse("the change touches what decides its own grade", cause=CAUSE_TAMPER)
                return verdict
            if taken.left_out:
                verdict.grading["left_out_paths"] = taken.left_out
            if grader is None:
                grader = await self._start_grader()
            await self._grade_in(grader.id, taken.patch, verdict)
            return verdict
        finally:
            if grader is not None:
                await self.backend.destroy(grader.id)
            for snap in taken_snapshots:
                await self.backend.delete_snapshot(snap.id)

    async def _base_filesystem(self) -> LayerStack | None:
        """Return the files the agent started from, or None where their snapshot is gone."""
        if self._base is None:
            return None
        try:
            return await self.backend.filesystem(self._base)
        except (SandboxNotFoundError, ImageNotFoundError):
            logger.info("swe instance %s: the snapshot of the reset point (%s) is gone; a fresh grader's files "
                        "serve", self.task.instance_id, self._base.id)
            return None

    async def _files_of(self, sandbox_id: str, taken: list[Snapshot]) -> LayerStack:
        """Snapshot a sandbox's files without a word to its shell; return them (the snapshot goes in ``taken``)."""
        snap = await self.backend.snapshot(sandbox_id, metadata={GRADE_SNAPSHOT_KEY: self.task.instance_id},
                                           shell_state=False)
        taken.append(snap)
        return await self.backend.filesystem(snap)

    async def _start_grader(self, role: str = "grader") -> SandboxInfo:
        """Start a fresh sandbox of the instance as reset leaves it (a failure is no one's but the host's)."""
        info, _base_id, _cached = await self._start({**self.labels, LABEL_ROLE: role})
        return info

    async def _grade_in(self, sandbox_id: str, patch: bytes, verdict: _Verdict) -> None:
        """Apply the patch and the test patch in ``sandbox_id``, run the tests and read the verdict into ``verdict``."""
        task = self.task
        try:
            text = await run_tests(self.backend, sandbox_id, task,
                                   patches=[("agent", patch), ("test", task.test_patch)], check_first=("test",),
                                   info=verdict.grading)
        except _PatchNotApplied as exc:
            if exc.name == "agent":
                verdict.refuse(str(exc), cause=CAUSE_PATCH_NOT_APPLIED)
            elif exc.before_others:  # not even on a fresh checkout: the instance is broken
                verdict.fail(str(exc))
            else:
                verdict.refuse(f"{exc} after the agent's change", cause=CAUSE_TEST_PATCH_NOT_APPLIED)
            return
        except _GradingError as exc:
            await self._blame(verdict, str(exc), cause=exc.cause)
            return
        except (SandboxNotFoundError, BackendUnavailableError):
            raise
        except (SandboxError, OSError) as exc:
            logger.warning("swe instance %s: the grader failed in sandbox %s: %s", task.instance_id, sandbox_id, exc)
            await self._blame(verdict, f"the grader's sandbox broke under the tests: {exc}", cause=CAUSE_SANDBOX_BROKEN)
            return
        report = grade(text, parser=task.log_parser, fail_to_pass=task.fail_to_pass, pass_to_pass=task.pass_to_pass)
        verdict.grading.update(report.to_info())
        verdict.grading["log_tail"] = text[-2048:]
        if report.problem:
            verdict.grading["error"] = report.problem
        verdict.reward = 1.0 if report.resolved else 0.0

    async def _blame(self, verdict: _Verdict, reason: str, *, cause: str) -> None:
        """Decide whose a test run that did not finish is: the change's, if the tests finish without it.

        A control run on a fresh checkout with the test patch alone: if it finishes well
        within the limit, the agent's change made the run hang, flood its log or break its
        sandbox (reward 0 with ``cause``), and a policy cannot make its failures vanish by
        hanging; if not, no verdict can be had (``verifier_error``).
        """
        if await self._control_finishes():
            verdict.refuse(f"{reason} (without the change the tests run to their end)", cause=cause)
        else:
            verdict.fail(reason)

    async def _control_finishes(self) -> bool:
        """Tell whether the tests run to their end, well within their limit, on a fresh checkout with no change."""
        control = await self._start_grader("control")
        try:
            started = time.monotonic()
            await run_tests(self.backend, control.id, self.task, patches=[("test", self.task.test_patch)])
            return time.monotonic() - started <= self.task.verifier_timeout_s * _CONTROL_MARGIN
        except (SandboxNotFoundError, BackendUnavailableError):
            raise
        except (_GradingError, SandboxError, OSError) as exc:
            logger.warning("swe instance %s: the tests do not finish on a fresh checkout either: %s",
                           self.task.instance_id, exc)
            return False
        finally:
            await self.backend.destroy(control.id)


@dataclass
class _Verdict(Verdict):
    """A SWE verdict: the grading's own record (``info.grading``) says why, too."""

    def __post_init__(self) -> None:
        self.details.setdefault("grading", {})

    @property
    def grading(self) -> dict[str, Any]:
        """The grading record (patch, per-test statuses, log tail, error)."""
        return self.details["grading"]  # type: ignore[no-any-return]

    def refuse(self, reason: str, *, cause: str) -> None:
        """Score 0 for what the agent's change did (``cause``)."""
        super().refuse(reason, cause=cause)
        self.grading["error"] = reason

    def fail(self, reason: str) -> None:
        """No reward: the tests cannot be run to a verdict, whatever the agent did. Never a 0."""
        super().fail(reason)
        self.grading["error"] = reason


async def run_tests(backend: SandboxBackend, sandbox_id: str, task: SWETask, *,
                    patches: Sequence[tuple[str, str | bytes]], check_first: Sequence[str] = (),
                    info: dict[str, Any] | None = None) -> str:
    """Apply ``patches`` (name, diff) in the workdir, run ``test_cmd`` between the markers; return the log.

    The patches named in ``check_first`` are checked to apply to the workdir as it is,
    before any patch is applied.

    Raises:
        _PatchNotApplied: a patch does not apply.
        _GradingError: the tests ran past the limit, or their log is too big.
        SandboxError: the sandbox broke under the tests.
    """
    steps = [f"cd {shlex.quote(task.workdir)}"]
    applied = [(name, patch if isinstance(patch, bytes) else patch.encode()) for name, patch in patches if patch]
    checked = [name for name, _patch in applied if name in check_first]
    for name, patch in applied:
        await backend.write_file(sandbox_id, f"{_GRADE_DIR}/{name}.patch", patch)
    for code, name in enumerate(checked, start=_CHECK_EXIT):
        steps.append(f"git apply --check --whitespace=nowarn {_GRADE_DIR}/{name}.patch || exit {code}")
    for code, (name, _patch) in enumerate(applied, start=_APPLY_EXIT):
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
        raise _GradingError(f"the tests ran past the {task.verifier_timeout_s:g}s limit", cause=CAUSE_TESTS_TIMED_OUT)
    failed: tuple[str, bool] | None = None
    if _CHECK_EXIT <= result.exit_code < _CHECK_EXIT + len(checked):
        failed = (checked[result.exit_code - _CHECK_EXIT], True)
    elif _APPLY_EXIT <= result.exit_code < _APPLY_EXIT + len(applied):
        failed = (applied[result.exit_code - _APPLY_EXIT][0], False)
    if failed is not None:
        name, before_others = failed
        if info is not None and name == "agent":
            info["patch_applied"] = False
        whose = "the agent's change" if name == "agent" else f"the {name} patch"
        raise _PatchNotApplied(f"{whose} does not apply: {result.stderr.strip()[-500:]}", name=name,
                               before_others=before_others)
    if info is not None:
        info["patch_applied"] = True
    try:
        raw = await backend.read_file(sandbox_id, log, max_bytes=MAX_LOG_BYTES)
    except FileTooLargeError:
        raise _GradingError(f"the test log is larger than {MAX_LOG_BYTES // (1024 * 1024)} MiB",
                            cause=CAUSE_TEST_LOG_TOO_LARGE) from None
    return raw.decode("utf-8", errors="replace")


# Exit codes of the grading script: a patch that does not apply to the workdir as it is, or in turn.
_CHECK_EXIT = 11
_APPLY_EXIT = 31


class _GradingError(Exception):
    """The tests could not be run to a verdict (ran out of time, flooded the log); ``cause`` if it is the change's doing."""

    def __init__(self, message: str, *, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


class _PatchNotApplied(_GradingError):
    """A patch does not apply (``before_others``: not even to the workdir as reset left it)."""

    def __init__(self, message: str, *, name: str, before_others: bool) -> None:
        super().__init__(message, cause=CAUSE_PATCH_NOT_APPLIED if name == "agent" else CAUSE_TEST_PATCH_NOT_APPLIED)
        self.name = name
        self.before_others = before_others


def oracle_patch_command(task: SWETask) -> str:
    """Return a bash command that applies the gold solution in the workdir."""
    packed = base64.b64encode(task.patch.encode()).decode("ascii")
    reverse = " -R" if task.patch_kind == "bug" else ""
    return (f"cd {shlex.quote(task.workdir)} && printf %s '{packed}' | base64 -d | "
            f"git apply --whitespace=nowarn{reverse} -")


__all__ = ["CAUSE_PATCH_NOT_APPLIED", "CAUSE_TEST_LOG_TOO_LARGE",
           "CAUSE_TEST_PATCH_NOT_APPLIED", "GRADE_SNAPSHOT_KEY", "MAX_PATCH_BYTES", "SWE_ENV_VERSION", "TOOLS",
           "SWEEnv", "oracle_patch_command", "run_tests"]
