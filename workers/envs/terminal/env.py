"""The terminal environment family: a Harbor-style task in a sandbox, driven by bash.

The agent sees two tools, ``bash`` and ``submit``. Each bash call runs in the
sandbox's persistent shell (``cd`` and ``export`` persist between calls). The
episode ends when the agent submits or its time (``[agent] timeout_sec``, wall
clock from reset) runs out; either way the verifier runs, with the image's own tools
over the agent's files (:meth:`TerminalEnv._verify`, :mod:`workers.envs.tamper`):
``tests/`` is copied to ``/tests`` only then, ``bash /tests/test.sh`` runs from the
task's working directory with the environment the image started with (never what the
agent exported), and the reward is read from ``/logs/verifier/reward.txt`` (a number)
or ``/logs/verifier/reward.json`` (an object of numbers). The final step's
``info.outcome`` is ``reward`` (``info.cause`` says when the agent's doing decided it:
``tamper``, ``tests_timed_out``, ``sandbox_broken``, ``sandbox_crashed``) or
``verifier_error`` (no reward).

A task with ``forkyard/reset.sh`` has it run at every reset, right after the
sandbox starts (from the working directory, with the image's environment, bounded by
``[environment] setup_timeout_sec``); a failure fails the reset. With a
:class:`~workers.setup_cache.SetupCache`, only the first reset of a (environment
version, task content, image) runs it: the sandbox is snapshotted right after, and
later resets restore that snapshot with a fresh agent time budget. A snapshot keeps
files, not processes: a setup that leaves any running (a service, a daemon) is not
cached, and every reset of its task runs it, as without a cache. A failure to cache
(snapshot, index) does not fail the reset: it goes on with the uncached sandbox.

The bash tool and the agent clock are :mod:`workers.envs.sandboxed`'s.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import shlex
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sandboxes.base import (
    ExecResult,
    Resources,
    Revert,
    SandboxBackend,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
)
from sandboxes.errors import (
    BackendUnavailableError,
    FileTooLargeError,
    ImageNotFoundError,
    SandboxCrashedError,
    SandboxError,
    SandboxNotFoundError,
)
from sandboxes.layers import LayerStack, diff
from sandboxes.snapshots import CAPTURE_COMMAND, CAPTURE_MAX_BYTES, Snapshot, parse_exported
from workers.envs.base import Action, EnvSnapshot, StepResult, ToolSpec
from workers.envs.sandboxed import (
    BASH_TOOL,
    CAUSE_SANDBOX_BROKEN,
    CAUSE_TAMPER,
    CAUSE_TESTS_TIMED_OUT,
    DEFAULT_MAX_OUTPUT_BYTES,
    LABEL_ROLE,
    SUBMIT_TOOL,
    SandboxedEnv,
    Verdict,
    bash_arguments,
    check_no_arguments,
    format_exec_result,
)
from workers.envs.tamper import (
    Finding,
    TamperPolicy,
    VerifierContext,
    scan_filesystem,
    scan_variables,
    verifier_environment,
)
from workers.envs.terminal.task import SETUP_SCRIPT, TerminalTask
from workers.envs.terminal.verifier import (
    REWARD_JSON,
    REWARD_MAX_BYTES,
    REWARD_TXT,
    VERIFIER_LOG_DIR,
    RewardError,
    parse_reward_json,
    parse_reward_txt,
)
from workers.errors import ActionError, SessionClosedError, TaskSetupError
from workers.setup_cache import SetupCacheKey
from workers.trust import CA_BUNDLE_PATH, ca_env

if TYPE_CHECKING:
    from workers.pool import WarmPool
    from workers.setup_cache import SetupCache

logger = logging.getLogger(__name__)

#: Version of what a reset leaves in the sandbox; part of every setup cache key. Bump it
#: when reset changes (other dirs, another way of running reset.sh) so old entries miss.
TERMINAL_ENV_VERSION = "5"
#: Where the agent's logs go, and where the verifier finds the tests.
AGENT_LOG_DIR = "/logs/agent"
TESTS_DIR = "/tests"
#: Where reset.sh is copied to run; removed afterwards.
SETUP_DIR = "/forkyard-reset"
#: Metadata key of the snapshot a verifier's fork is restored from (deleted right after).
VERIFIER_SNAPSHOT_KEY = "forkyard.verifier"
# Bounds the read of the agent's exports (reported, never used).
_EXPORTS_TIMEOUT_S = 5.0
# A control run that takes more than this share of the verifier's limit tells nothing of a time-out.
_CONTROL_MARGIN = 0.5
# Bounds the housekeeping commands the env itself runs (mkdir, rm, probes).
_HOUSEKEEPING_TIMEOUT_S = 30.0
_STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Variables bash sets for itself; not restored for the verifier.
_SHELL_OWNED_VARS = frozenset({"_", "PWD", "OLDPWD", "SHLVL"})
# Bytes of verifier stdout/stderr kept in info.
_VERIFIER_OUTPUT_BYTES = 16 * 1024
# Bytes of reset.sh output kept, and how much of it an error quotes.
_SETUP_OUTPUT_BYTES = 16 * 1024
_SETUP_ERROR_CHARS = 1000
# Lists the sandbox's processes but pid 1 (the shell on local, docker-init on docker) and
# the shell itself, as "__fy_proc PID COMM" lines after a "__fy_proc_ok" line saying /proc
# shows the shell. Builtins only, run by the shell itself: the probe forks nothing it could
# count, and neither backend's exec starts a helper in the sandbox. Each record starts on a
# line of its own, since a background job's output may come first. Zombies are not running.
_PROCESS_PROBE = r"""[ -r "/proc/$$/comm" ] && printf '\n__fy_proc_ok\n'
for __fy_d in /proc/[0-9]*; do
  __fy_p=${__fy_d#/proc/}
  case $__fy_p in 1|"$$"|"$BASHPID") continue ;; esac
  read -r __fy_s < "$__fy_d/stat" 2>/dev/null || continue
  __fy_s=${__fy_s##*) }
  case ${__fy_s%% *} in Z|X|x) continue ;; esac
  read -r __fy_c < "$__fy_d/comm" 2>/dev/null || continue
  printf '\n__fy_proc %s %s\n' "$__fy_p" "$__fy_c"
done
unset __fy_d __fy_p __fy_s __fy_c
"""

TOOLS: tuple[ToolSpec, ...] = (BASH_TOOL, SUBMIT_TOOL)


class TerminalEnv(SandboxedEnv):
    """One episode of a terminal task in one sandbox: reset, step, submit, close."""

    def __init__(
        self,
        task: TerminalTask,
        backend: SandboxBackend,
        *,
        image: str,
        labels: Mapping[str, str] | None = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        setup_cache: SetupCache | None = None,
        env_version: str = "",
        counters: collections.Counter[str] | None = None,
        ca_bundle: bytes | None = None,
        pool: WarmPool | None = None,
    ) -> None:
        """Prepare an env; nothing starts before :meth:`reset`.

        Args:
            setup_cache: where resets of tasks with a reset.sh keep and find their post-setup snapshot.
            env_version: the environment's name@version; part of the setup cache key.
            counters: incremented as things happen: ``resets``, ``env_steps``, ``setup_runs``,
                ``setup_cache_hits``, ``setup_cache_misses``, ``setup_uncacheable`` (a task whose
                setup left processes running, once per cache key).
            ca_bundle: the host's CA certificates, which a networked task's sandbox trusts
                (:mod:`workers.trust`).
            pool: the warm pool resets claim their sandbox from (:mod:`workers.pool`).
        """
        super().__init__(backend, agent_timeout_s=task.agent_timeout_s, counters=counters,
                         max_output_bytes=max_output_bytes, pool=pool)
        self.task = task
        self.ca_bundle = ca_bundle if task.network else None
        self.image = image
        self.labels = dict(labels or {})
        self.setup_cache = setup_cache
        self.env_version = env_version
        self.workdir: str | None = None
        """The shell's directory right after reset (the image's WORKDIR); tests and the oracle run there."""
        self._initial_env: dict[str, str] | None = None

    async def reset(self) -> str:
        """Start a sandbox ready for the task (dropping any previous one) and return the instruction.

        Runs ``forkyard/reset.sh`` if the task has one, or restores the setup cache's
        snapshot of an earlier run of it.

        Raises:
            SandboxError: the sandbox could not be prepared, or reset.sh failed or timed out.
        """
        async with self._lock:
            if self._closed:
                raise SessionClosedError("the environment is closed")
            await self._destroy_sandbox()
            await self._drop_base()
            self._count("resets")
            if self.task.setup_script is not None and self.setup_cache is not None:
                await self._start_cached(self.setup_cache)
            else:
                await self._start_fresh()
            if self.task.setup_script is not None and self._base is None:
                await self._keep_base(self.task.name)
            self._start_clock()
            logger.info(
                "terminal task %s: sandbox %s ready (image %s, workdir %s)",
                self.task.name,
                self._sandbox_id(),
                self.image,
                self.workdir,
            )
            return self.task.instruction

    async def setup_key(self) -> SetupCacheKey:
        """Return the setup cache key of this env's task on its image."""
        return SetupCacheKey(
            environment=f"{self.env_version}+terminal.{TERMINAL_ENV_VERSION}",
            task_hash=self.task.content_hash,
            image_digest=await self.backend.image_digest(self.image),
        )

    @property
    def tools(self) -> tuple[ToolSpec, ...]:
        """The tools the agent sees: ``bash`` and ``submit``."""
        return TOOLS

    async def step(self, action: Action, *, budget_s: float | None = None) -> StepResult:
        """Apply one tool call; ``submit`` (or running out of time) ends the episode.

        With ``budget_s`` (the time the caller gives this step), a bash call's timeout is
        capped to it in whole seconds, and a call that names none gets it: members of a
        shared group, whose budgets differ by milliseconds, then issue the same call.

        Raises:
            ActionError: unknown tool or invalid arguments (the episode goes on).
            SessionClosedError: the episode has ended or the env is closed.
        """
        async with self._lock:
            self._check_open()
            tool, arguments = action.tool, action.arguments
            if arguments is None:
                arguments = {}
            if not isinstance(arguments, Mapping):
                raise ActionError(f"the arguments of {tool!r} must be an object, got {type(arguments).__name__}")
            if tool == BASH_TOOL.name:
                return await self._bash_step(arguments, budget_s)
            if tool == SUBMIT_TOOL.name:
                check_no_arguments(tool, arguments)
                self._took_step()
                return await self._finish("[episode ended: submitted]\n", truncated=False)
            names = ", ".join(t.name for t in TOOLS)
            raise ActionError(f"unknown tool {tool!r}; the tools are: {names}")

    async def truncate(self, reason: str) -> StepResult:
        """End the episode early (max turns, a rollout's episode timeout): verify, truncated=True.

        Raises:
            SessionClosedError: the episode has already ended or the env is closed.
        """
        async with self._lock:
            self._check_open()
            self._count("env_steps")
            return await self._finish(f"[episode ended: {reason}]\n", truncated=True)

    def export_state(self) -> dict[str, Any]:
        """Return the logical state a fork needs to continue this episode (not the sandbox)."""
        return {
            "image": self.image,
            "workdir": self.workdir,
            "steps": self.steps,
            "time_left_s": self.time_left(),
            "initial_env": dict(self._initial_env) if self._initial_env is not None else None,
            "base": self._base_state(),
        }

    async def snapshot(self, *, metadata: Mapping[str, str] | None = None) -> EnvSnapshot:
        """Snapshot the sandbox between steps, with :meth:`export_state`.

        Raises:
            SessionClosedError: the episode has ended or the env is closed.
        """
        async with self._lock:
            self._check_open()
            snap = await self.backend.snapshot(self._sandbox_id(), metadata=metadata)
            return EnvSnapshot(snap, self.export_state())

    @classmethod
    def from_snapshot(
        cls,
        task: TerminalTask,
        backend: SandboxBackend,
        sandbox: SandboxInfo,
        state: Mapping[str, Any],
        *,
        labels: Mapping[str, str] | None = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        counters: collections.Counter[str] | None = None,
    ) -> TerminalEnv:
        """Wrap a sandbox restored from a snapshot in an env continuing from :meth:`export_state` data."""
        env = cls(task, backend, image=state.get("image") or sandbox.image, labels=labels,
                  max_output_bytes=max_output_bytes, counters=counters)
        env.sandbox = sandbox
        env.workdir = state.get("workdir") or "/"
        env.steps = int(state.get("steps") or 0)
        initial = state.get("initial_env")
        env._initial_env = dict(initial) if initial is not None else None
        env._adopt_base(state)
        left = float(state.get("time_left_s", task.agent_timeout_s))
        env._deadline = time.monotonic() + left
        return env

    # ------------------------------------------------------------------ internals

    def _spec(self) -> SandboxSpec:
        return SandboxSpec(
            image=self.image,
            resources=Resources(cpus=self.task.cpus, memory_mb=self.task.memory_mb, disk_mb=self.task.disk_mb),
            network=self.task.network,
            env={**self.task.environment_env, **(ca_env() if self.ca_bundle is not None else {})},
            labels=self.labels,
        )

    async def _start_fresh(self) -> None:
        """Create a sandbox from the image, prepare it and run reset.sh if the task has one."""
        self.sandbox = await self._create_sandbox(self._spec())
        try:
            if self.ca_bundle is not None:
                await self.backend.write_file(self.sandbox.id, CA_BUNDLE_PATH, self.ca_bundle, mode=0o644)
            result = await self._housekeeping(
                f"mkdir -p {AGENT_LOG_DIR} && pwd", what="prepare the sandbox"
            )
            self.workdir = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "/"
            self._initial_env = await self._capture_env()
            if self.task.setup_script is not None:
                await self._run_setup(self.task.setup_script)
        except BaseException:
            await self._destroy_sandbox()
            raise

    async def _start_cached(self, cache: SetupCache) -> None:
        """Restore the cached post-setup snapshot, or start fresh and cache a snapshot of the result."""
        key = await self.setup_key()
        for attempt in (1, 2):
            async with cache.claim(key) as entry:
                if entry is None:
                    await self._start_and_fill(cache, key)
                    return
                try:
                    self.sandbox = await self._restore_setup(entry.snapshot, self._spec())
                except SandboxNotFoundError:
                    if attempt == 2:
                        raise
                    logger.warning(
                        "terminal task %s: cached setup snapshot %s is gone; running setup again",
                        self.task.name,
                        entry.snapshot.id,
                    )
                    await cache.discard(key)
                    continue
                self._count("setup_cache_hits")
                self._base = entry.snapshot
                self.workdir = entry.state.get("workdir") or "/"
                initial = entry.state.get("initial_env")
                self._initial_env = dict(initial) if initial is not None else None
                return

    async def _start_and_fill(self, cache: SetupCache, key: SetupCacheKey) -> None:
        """Start fresh (running setup) and, unless ``key`` is marked uncacheable, cache the result.

        Caching is a saving, not part of the reset: if it fails while the sandbox is fine,
        the reset goes on with that sandbox (as without a cache) and the next one tries again.
        """
        if cache.uncacheable(key) is not None:
            await self._start_fresh()
            return
        self._count("setup_cache_misses")
        await self._start_fresh()
        try:
            await self._fill(cache, key)
        except (SandboxNotFoundError, SandboxCrashedError, BackendUnavailableError):
            await self._destroy_sandbox()
            raise
        except Exception:
            logger.warning(
                "terminal task %s: cannot store its setup in the setup cache; sandbox %s goes on uncached",
                self.task.name,
                self._sandbox_id(),
                exc_info=True,
            )
        except BaseException:
            await self._destroy_sandbox()
            raise

    async def _fill(self, cache: SetupCache, key: SetupCacheKey) -> None:
        """Cache a snapshot of the sandbox as setup left it, or mark ``key`` uncacheable if setup left processes."""
        leftovers = await self._leftover_processes()
        if leftovers:
            names = ", ".join(sorted(set(leftovers)))
            reason = f"{SETUP_SCRIPT} left processes running ({names}), and a snapshot keeps files, not processes"
            cache.mark_uncacheable(key, reason)
            self._count("setup_uncacheable")
            logger.warning(
                "terminal task %s: not caching its setup: %s; every reset of it runs setup (key %s)",
                self.task.name,
                reason,
                key.id[:12],
            )
            return
        snap = await self.backend.snapshot(
            self._sandbox_id(), metadata={"forkyard.kind": "setup", "forkyard.task": self.task.name}
        )
        await self._cache_put(cache, key, snap)

    async def _leftover_processes(self) -> list[str]:
        """Return the names (comm) of the sandbox's processes besides pid 1 and the shell.

        Right after setup, these are what reset.sh left running.

        Raises:
            SandboxError: /proc in the sandbox does not show its shell, so nothing can be told.
        """
        result = await self.backend.exec(self._sandbox_id(), _PROCESS_PROBE, timeout_s=_HOUSEKEEPING_TIMEOUT_S)
        lines = result.stdout.splitlines()
        if "__fy_proc_ok" not in lines:
            detail = result.stderr.strip()[-500:] or f"exit code {result.exit_code}"
            raise SandboxError(f"cannot list the processes of sandbox {self._sandbox_id()}: {detail}")
        return [line.split(" ", 2)[2] for line in lines if line.startswith("__fy_proc ")]

    async def _cache_put(self, cache: SetupCache, key: SetupCacheKey, snap: Snapshot) -> None:
        state = {
            "image": self.image,
            "workdir": self.workdir,
            "initial_env": dict(self._initial_env) if self._initial_env is not None else None,
        }
        try:
            await cache.put(key, snap, state)
        except BaseException:
            if not cache.holds(snap.id):
                await asyncio.shield(self.backend.delete_snapshot(snap.id))
            raise

    async def _run_setup(self, script: bytes) -> None:
        """Run reset.sh from the workdir with the image's environment.

        Raises:
            SandboxError: it exited non-zero or ran past ``[environment] setup_timeout_sec``.
        """
        sandbox_id = self._sandbox_id()
        path = f"{SETUP_DIR}/setup.sh"
        await self._housekeeping(f"rm -rf {SETUP_DIR}", what=f"clear {SETUP_DIR}")
        await self.backend.write_file(sandbox_id, path, script, mode=0o755)
        self._count("setup_runs")
        timeout = self.task.setup_timeout_s
        result = await self.backend.exec(
            sandbox_id, self._clean_command(path), timeout_s=timeout, max_output_bytes=_SETUP_OUTPUT_BYTES
        )
        tail = (result.stderr.strip() or result.stdout.strip())[-_SETUP_ERROR_CHARS:]
        if result.timed_out:
            raise TaskSetupError(
                f"task {self.task.name!r}: {SETUP_SCRIPT} ran past its {timeout:g}s limit in sandbox {sandbox_id}; "
                f"make it faster or raise [environment] setup_timeout_sec. Its output ended: {tail or '(none)'}"
            )
        if result.exit_code != 0:
            raise TaskSetupError(
                f"task {self.task.name!r}: {SETUP_SCRIPT} failed with exit code {result.exit_code} "
                f"in sandbox {sandbox_id}: {tail or '(no output)'}"
            )
        await self._housekeeping(f"rm -rf {SETUP_DIR}", what=f"remove {SETUP_DIR}")

    async def _housekeeping(self, command: str, *, what: str, sandbox_id: str | None = None) -> ExecResult:
        # A subshell with a standard PATH: whatever the agent exported must not break these.
        sandbox_id = sandbox_id or self._sandbox_id()
        wrapped = f"(PATH={_STANDARD_PATH}; {command})"
        result = await self.backend.exec(sandbox_id, wrapped, timeout_s=_HOUSEKEEPING_TIMEOUT_S)
        if result.exit_code != 0:
            detail = (result.stderr or result.stdout).strip()[-500:]
            detail = detail or f"exit code {result.exit_code}"
            raise SandboxError(f"could not {what} in sandbox {sandbox_id}: {detail}")
        return result

    async def _capture_env(self) -> dict[str, str] | None:
        """Return the shell's exported variables as the image left them (None if unreadable)."""
        result = await self.backend.exec(self._sandbox_id(), "env -0", timeout_s=_HOUSEKEEPING_TIMEOUT_S)
        if result.exit_code != 0:
            logger.warning(
                "terminal task %s: cannot read the image environment; the verifier inherits the agent's", self.task.name
            )
            return None
        env: dict[str, str] = {}
        for item in result.stdout.split("\0"):
            key, sep, value = item.partition("=")
            if sep and key and key not in _SHELL_OWNED_VARS:
                env[key] = value
        return env

    def _clean_command(self, script: str, env: Mapping[str, str] | None = None) -> str:
        """Return a command running ``bash script`` from the workdir with the image's environment and ``env``.

        Variables the agent exported (PATH, PYTHONPATH...) must not steer the verifier.
        """
        run = f"bash {shlex.quote(script)}"
        extra = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted((env or {}).items()))
        if self._initial_env is not None:
            assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(self._initial_env.items()))
            run = f"command -p env -i {assignments} {extra} {run}"
        elif extra:
            run = f"command -p env {extra} {run}"
        return f"(cd {shlex.quote(self.workdir or '/')} && {run})"

    async def _finish(self, observation: str, *, truncated: bool, cause: str | None = None) -> StepResult:
        """Run the verifier, end the episode and return the final step."""
        self._done = True
        verdict = await self._verify()
        if cause is not None and verdict.cause is None:
            verdict.cause = cause
        logger.info("terminal task %s: episode ended in sandbox %s after %d steps, %s", self.task.name,
                    self.sandbox.id if self.sandbox else "-", self.steps, verdict.summary())
        return verdict.ending(observation, truncated=truncated, refused="the agent changed what the verifier relies on")

    def _verifier_context(self) -> VerifierContext:
        env = self._initial_env or {}
        path = env.get("PATH") or _STANDARD_PATH
        homes = dict.fromkeys(["/root", *([env["HOME"]] if env.get("HOME", "").startswith("/") else [])])
        return VerifierContext(path_dirs=tuple(d for d in path.split(":") if d.startswith("/")), homes=tuple(homes),
                               tests_dir=TESTS_DIR, verifier_dirs=(VERIFIER_LOG_DIR,))

    async def _exported_hooks(self, sandbox_id: str) -> list[Finding]:
        """Return the start-hook variables the agent exported in its shell (best effort: reported, never used)."""
        try:
            result = await self.backend.exec(sandbox_id, CAPTURE_COMMAND, timeout_s=_EXPORTS_TIMEOUT_S,
                                             max_output_bytes=CAPTURE_MAX_BYTES)
        except SandboxError:
            return []
        if result.exit_code != 0 or result.timed_out or result.truncated:
            return []
        return scan_variables(parse_exported(result.stdout), self._initial_env or {})

    async def _verify(self) -> Verdict:
        """Verify the agent's work with the image's own tools; return the verdict.

        The agent's files are captured host-side (no program of its sandbox runs) and
        compared with what it started from (:mod:`workers.envs.tamper`): what it changed of
        the verifier's tools and hooks is a finding, and the verifier runs in a new sandbox
        of those files where every such path reads as the image had it, with an environment
        made from the image's, never the agent's. It joins the agent sandbox's network
        namespace, so services the agent started still answer on localhost as Harbor's
        tests expect, but none of its processes, so nothing the agent left running can touch
        the tests, the verifier's processes or its reward file.
        """
        sandbox_id = self._sandbox_id()
        verdict = Verdict(details={"reward_details": {}, "verifier": _no_run()})
        snap = None
        fork_id = None
        try:
            variables = await self._exported_hooks(sandbox_id)
            snap = await self.backend.snapshot(sandbox_id, metadata={VERIFIER_SNAPSHOT_KEY: self.task.name},
                                               shell_state=False)
            top = await self.backend.filesystem(snap)
            base_ref, base = await self._base_filesystem()
            try:
                changes = await asyncio.to_thread(diff, base, top)
            except SandboxError as exc:  # more changed paths than anything honest makes
                verdict.refuse(str(exc), cause=CAUSE_SANDBOX_BROKEN)
                return verdict
            scan = scan_filesystem(changes, top=top, base=base, context=self._verifier_context())
            verdict.tamper = [f.as_dict() for f in (*variables, *scan.findings)]
            if scan.revert:
                verdict.details["reverted_paths"] = len(scan.revert)
            if verdict.tamper and self.task.tamper is TamperPolicy.FAIL:
                verdict.refuse("the agent changed what the verifier relies on", cause=CAUSE_TAMPER)
                return verdict
            spec = dataclasses.replace(self._spec(), labels={**self.labels, LABEL_ROLE: "verifier"},
                                       network_of=sandbox_id if await self._alive(sandbox_id) else None)
            try:
                [fork] = await self.backend.restore(snap, 1, spec=spec, revert=Revert(tuple(scan.revert), base_ref),
                                                    shell_state=False)
            except (SandboxNotFoundError, BackendUnavailableError):
                raise
            except SandboxError as exc:
                if not await self.fresh_sandbox_starts():
                    raise
                verdict.refuse(f"no verifier could start on the agent's files: {exc}", cause=CAUSE_SANDBOX_BROKEN)
                return verdict
            fork_id = fork.id
            failure = await self._verify_in(fork_id, verdict, rebuild_loader_cache=scan.rebuild_loader_cache)
            if failure is not None:
                reason, cause = failure
                await self._blame(verdict, reason, cause=cause)
            return verdict
        finally:
            # The fork first: a snapshot's storage must outlive every sandbox restored from it.
            if fork_id is not None:
                await self.backend.destroy(fork_id)
            if snap is not None:
                await self.backend.delete_snapshot(snap.id)

    async def _base_filesystem(self) -> tuple[Snapshot | str, LayerStack]:
        """Return what the agent started from and its files (the image, when a reset.sh's snapshot is gone)."""
        if self._base is not None:
            try:
                return self._base, await self.backend.filesystem(self._base)
            except (SandboxNotFoundError, ImageNotFoundError):
                logger.warning("terminal task %s: the snapshot of what reset.sh left (%s) is gone; the agent's "
                               "changes are measured against the image", self.task.name, self._base.id)
        return self.image, await self.backend.filesystem(self.image)

    async def _alive(self, sandbox_id: str) -> bool:
        try:
            info = await self.backend.status(sandbox_id)
        except SandboxError:
            return False
        return info.state in (SandboxState.READY, SandboxState.BUSY)

    async def _verify_in(self, sandbox_id: str, verdict: Verdict, *,
                         rebuild_loader_cache: bool) -> tuple[str, str] | None:
        """Copy the tests into ``sandbox_id``, run test.sh there and read the reward into ``verdict``.

        Returns (why, cause) when the run did not finish (it timed out, or its sandbox broke
        under the tests): whose fault that is takes a control run (:meth:`_blame`). A reward
        file that is missing, too large or no reward fails the verdict (``verifier_error``).
        """
        record = verdict.details["verifier"]
        try:
            # The image's ldconfig, over the image's loader configuration: libraries the agent installed are found.
            ldconfig = "{ ! command -v ldconfig >/dev/null || ldconfig; } && " if rebuild_loader_cache else ""
            # The workdir is made again if the agent removed it: the tests then fail on their own.
            workdir = shlex.quote(self.workdir or "/")
            ready = await self._housekeeping(
                f"{ldconfig}rm -rf {TESTS_DIR} {VERIFIER_LOG_DIR} && mkdir -p {VERIFIER_LOG_DIR} {workdir} && "
                "id -u && id -g",
                what="prepare the verifier",
                sandbox_id=sandbox_id,
            )
            # /tests is the verifier's (its user's, the image's USER) to write in: pytest puts its
            # cache and __pycache__ beside the tests.
            uid, gid = (int(n) for n in ready.stdout.split()[-2:])
            for rel, data in sorted(self.task.test_files.items()):
                mode = 0o755 if rel.endswith(".sh") else 0o644
                await self.backend.write_file(sandbox_id, f"{TESTS_DIR}/{rel}", data, mode=mode, owner=(uid, gid))
            timeout = self.task.verifier_timeout_s
            result = await self.backend.exec(
                sandbox_id,
                self._verifier_command(f"{TESTS_DIR}/test.sh"),
                timeout_s=timeout,
                max_output_bytes=_VERIFIER_OUTPUT_BYTES,
            )
            record.update(exit_code=result.exit_code, stdout=result.stdout, stderr=result.stderr,
                          timed_out=result.timed_out)
            verdict.took_s = result.duration_s
            if result.timed_out:
                return f"the verifier timed out after {timeout:g}s", CAUSE_TESTS_TIMED_OUT
            probe = await self._housekeeping(
                f"if [ -f {REWARD_TXT} ]; then echo txt; elif [ -f {REWARD_JSON} ]; then echo json; fi",
                what="look for the reward file",
                sandbox_id=sandbox_id,
            )
            kind = probe.stdout.strip()
            if kind not in ("txt", "json"):
                raise RewardError(
                    f"the verifier wrote neither {REWARD_TXT} nor {REWARD_JSON} (exit code {result.exit_code})"
                )
            path = REWARD_TXT if kind == "txt" else REWARD_JSON
            try:
                raw = await self.backend.read_file(sandbox_id, path, max_bytes=REWARD_MAX_BYTES)
            except FileTooLargeError:
                raise RewardError(
                    f"the verifier's {path} is larger than {REWARD_MAX_BYTES // 1024} KiB; a reward file holds "
                    "one number or one small JSON object"
                ) from None
            reward, details = parse_reward_txt(raw) if kind == "txt" else parse_reward_json(raw)
            verdict.reward, verdict.details["reward_details"] = reward, details
        except RewardError as exc:
            verdict.fail(str(exc))
        except (SandboxNotFoundError, BackendUnavailableError):
            raise
        except (SandboxError, OSError) as exc:
            logger.warning("terminal task %s: the verifier failed in sandbox %s: %s", self.task.name, sandbox_id, exc)
            return f"the verifier's sandbox broke under the tests: {exc}", CAUSE_SANDBOX_BROKEN
        return None

    async def _blame(self, verdict: Verdict, reason: str, *, cause: str) -> None:
        """Decide whose a verifier run that did not finish is: the agent's work's, if it finishes without it.

        A control run of the same verifier on a fresh sandbox of what the agent started
        from: if it finishes well within the limit, the agent's work made the tests hang or
        broke their sandbox (reward 0 with ``cause``), so a policy cannot make its failures
        vanish by hanging; if not, no verdict can be had (``verifier_error``, never a 0).
        """
        if await self._control_finishes():
            verdict.refuse(f"{reason}; on what the agent started from the verifier runs to its end", cause=cause)
        else:
            verdict.fail(reason)

    async def _control_finishes(self) -> bool:
        """Tell whether the verifier runs to its end, well within its limit, on a fresh sandbox of the base."""
        spec = dataclasses.replace(self._spec(), labels={**self.labels, LABEL_ROLE: "control"})
        try:
            if self._base is not None:
                [control] = await self.backend.restore(self._base, 1, spec=spec, shell_state=False)
            else:
                control = await self.backend.create(spec)
        except (SandboxNotFoundError, ImageNotFoundError):
            return False  # the base is gone: no control, so no blame
        try:
            record = Verdict(details={"reward_details": {}, "verifier": _no_run()})
            failed = await self._verify_in(control.id, record, rebuild_loader_cache=False)
            return failed is None and record.took_s <= self.task.verifier_timeout_s * _CONTROL_MARGIN
        finally:
            await self.backend.destroy(control.id)

    def _verifier_command(self, script: str) -> str:
        """Return a command running ``bash script`` from the workdir, with an environment built from nothing.

        The image's environment as the sandbox started (less the variables that make a shell
        or an interpreter run a file at start) and ``[verifier] env``; ``bash`` reads no
        profile or rc file. ``env`` and ``bash`` are the image's: the verifier's sandbox
        shows every program the agent touched as the image had it.
        """
        base = self._initial_env if self._initial_env is not None else {"PATH": _STANDARD_PATH}
        env = verifier_environment(base, self.task.verifier_env)
        assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items()))
        run = f"command -p env -i {assignments} bash --noprofile --norc {shlex.quote(script)}"
        return f"(cd {shlex.quote(self.workdir or '/')} && {run})"


def _no_run() -> dict[str, Any]:
    return {"exit_code": None, "stdout": "", "stderr": "", "timed_out": False}


__all__ = ["BASH_TOOL", "SUBMIT_TOOL", "TOOLS", "TerminalEnv", "bash_arguments", "format_exec_result"]
