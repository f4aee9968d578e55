"""The worker runtime: owns a sandbox backend and the live environment sessions.

The gateway never touches a sandbox; it calls these methods (in-process in embedded
mode, through Celery tasks in distributed mode).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandboxes.base import LABEL_OWNER, SandboxBackend, SandboxInfo, on_launched
from sandboxes.errors import SandboxCrashedError, SandboxError, SandboxNotFoundError
from workers.envs.base import (
    Action,
    EnvContext,
    Environment,
    EnvSnapshot,
    EnvTask,
    Forkable,
    StepResult,
    openai_tools,
    run_actions,
)
from workers.envs.registry import family_of
from workers.errors import (
    ActionError,
    SandboxBackendError,
    SandboxLostError,
    SessionClosedError,
    SessionNotFoundError,
    WorkerError,
)
from workers.protocol import SESSION_SNAPSHOT_KEY

if TYPE_CHECKING:
    from workers.pool import WarmPool
    from workers.setup_cache import SetupCache

logger = logging.getLogger(__name__)

#: Metadata keys of the snapshots a trajectory tree (``forkyard.tree``), a lazy-fork group
#: (``forkyard.shared``) or a verifier's fork (``forkyard.verifier``) takes; nothing outlives them.
TRANSIENT_SNAPSHOT_KEYS = frozenset({"forkyard.tree", "forkyard.shared", "forkyard.verifier", "forkyard.base"})
#: A built image handed out for a sandbox this recently is never removed by the image cap.
IMAGE_KEEP_S = 600.0


@dataclass(frozen=True)
class SessionOpened:
    """What a new session shows the caller."""

    session_id: str
    sandbox: SandboxInfo
    observation: str
    tools: list[dict[str, Any]]


def worker_error(exc: Exception) -> WorkerError:
    """Return the worker error (what crosses the wire) for any exception of a runtime call.

    A sandbox that crashed or vanished is :class:`SandboxLostError`; another backend error is
    :class:`SandboxBackendError`; a worker error is itself; anything else is logged and
    answered as an internal error, its details kept off the wire.
    """
    if isinstance(exc, WorkerError):
        return exc
    if isinstance(exc, SandboxCrashedError | SandboxNotFoundError):
        return SandboxLostError(str(exc))
    if isinstance(exc, SandboxError):
        return SandboxBackendError(f"sandbox backend error: {exc}")
    logger.error("runtime call failed unexpectedly", exc_info=exc)
    return WorkerError("An internal error occurred.")


class WorkerRuntime:
    """Own one sandbox backend and the environment sessions running on it.

    It is the embedded mode's :class:`workers.protocol.WorkerClient`: the sessions API calls
    it in-process.
    """

    loads_tasks = False
    """The gateway hands it decoded tasks (:attr:`workers.protocol.WorkerClient.loads_tasks`)."""
    sole_gateway = True
    """Its sessions live in this process: the gateway here is the only one calling them."""

    def __init__(
        self,
        backend: SandboxBackend,
        *,
        image_cache_dir: Path,
        stand_ins: Mapping[str, str] | None = None,
        base_image: str | None = None,
        setup_cache: SetupCache | None = None,
        ca_bundle: bytes | None = None,
        image_max_bytes: int | None = None,
        pool: WarmPool | None = None,
    ) -> None:
        self.backend = backend
        self.image_max_bytes = image_max_bytes
        """Cap on the bytes of built task and stand-in images (:mod:`workers.images`); None: no cap."""
        self.ctx = EnvContext(
            backend=backend, image_cache_dir=Path(image_cache_dir), base_image=base_image, stand_ins=stand_ins,
            setup_cache=setup_cache, ca_bundle=ca_bundle, pool=pool,
        )
        """What every env this runtime makes shares (backend, base image, setup cache, CA bundle, counters)."""
        self._envs: dict[str, tuple[Environment, EnvTask]] = {}
        self._running_steps: dict[str, asyncio.Future[StepResult]] = {}
        self._images_handed_out: dict[str, float] = {}  # image ref -> when a sandbox last asked for it (monotonic)
        self._capping: asyncio.Task[None] | None = None

    @property
    def base_image(self) -> str | None:
        """The Debian base every built image starts from (made at :meth:`start` unless given)."""
        return self.ctx.base_image

    @base_image.setter
    def base_image(self, value: str | None) -> None:
        self.ctx.base_image = value

    @property
    def setup_cache(self) -> SetupCache | None:
        """Post-setup snapshots of tasks with a reset hook, shared by every env this runtime makes."""
        return self.ctx.setup_cache

    @property
    def pool(self) -> WarmPool | None:
        """Started sandboxes made ahead of demand, which resets claim (:mod:`workers.pool`)."""
        return self.ctx.pool

    @property
    def counters(self) -> collections.Counter[str]:
        """What the envs did: ``env_steps``, ``resets``, ``setup_runs``, ``setup_cache_hits``/``_misses``, ``setup_uncacheable``."""
        return self.ctx.counters

    @property
    def stand_ins(self) -> Mapping[str, str] | None:
        """Image name patterns to stand-ins (:mod:`workers.standins`); None: the default table."""
        return self.ctx.stand_ins

    @property
    def ca_bundle(self) -> bytes | None:
        """The host's CA certificates, trusted in builds and networked sandboxes (:mod:`workers.trust`)."""
        return self.ctx.ca_bundle

    @property
    def backend_name(self) -> str:
        """The sandbox backend this node runs (``local``, ``docker``)."""
        return self.backend.name

    @property
    def node(self) -> str:
        """Name of the node this runtime's sandboxes live on."""
        return self.backend.node

    async def start(self, *, progress: Callable[[str], None] | None = None) -> None:
        """Make sure the base image exists on the backend (built once, then reused); load the setup cache."""
        from sandboxes.images import ensure_base_image

        if self.ctx.base_image is None:
            self.ctx.base_image = await ensure_base_image(self.backend, self.ctx.image_cache_dir, progress=progress)
        if self.setup_cache is not None:
            await self.setup_cache.load()
        if self.pool is not None:
            self.pool.start()

    async def task_image(self, task: EnvTask, *, progress: Callable[[str], None] | None = None) -> str:
        """Return the image a task's sandboxes start from (its family prepares it, building on first use).

        The first time this runtime hands out an image, the built images are pruned to the
        cap (:attr:`image_max_bytes`) in the background.
        """
        if self.ctx.base_image is None:
            await self.start(progress=progress)
        ref = await family_of(task).prepare_image(task, self.ctx, progress=progress)
        first = ref not in self._images_handed_out
        self._images_handed_out[ref] = time.monotonic()
        if first and self.image_max_bytes is not None and (self._capping is None or self._capping.done()):
            self._capping = asyncio.create_task(self._cap_images(), name="image cap")
        return ref

    async def _cap_images(self) -> None:
        """Remove the oldest built images no sandbox uses until they fit the cap; never one handed out lately."""
        from workers.images import prune_images

        assert self.image_max_bytes is not None
        now = time.monotonic()
        recent = {ref for ref, at in self._images_handed_out.items() if now - at < IMAGE_KEEP_S}
        try:
            report = await prune_images(self.backend, max_bytes=self.image_max_bytes, keep=recent)
        except Exception:
            logger.exception("keeping the built images under %d bytes failed", self.image_max_bytes)
            return
        if report.removed:
            logger.info("removed %d built image(s) (%.1f MiB) to keep under the cap of %.1f MiB: %s",
                        len(report.removed), report.freed_bytes / 2**20, self.image_max_bytes / 2**20,
                        ", ".join(i.ref for i in report.removed))
        if report.total_bytes > self.image_max_bytes:
            logger.warning("built images hold %.1f MiB, over the cap of %.1f MiB: %d of them are in use",
                           report.total_bytes / 2**20, self.image_max_bytes / 2**20, report.in_use)

    def new_env(
        self, task: EnvTask, *, image: str, labels: Mapping[str, str], env_version: str = ""
    ) -> Environment:
        """Return a (not yet reset) env for ``task`` on this runtime's backend, caches and counters."""
        return family_of(task).open(task, self.ctx, image=image, labels=labels, env_version=env_version)

    async def open_session(
        self, session_id: str, task: EnvTask, *, labels: Mapping[str, str] | None = None,
        env_version: str = "",
    ) -> SessionOpened:
        """Start a sandbox for ``task`` and return the first observation and the tools.

        ``env_version`` (the environment's name@version) keys the setup cache.
        """
        if session_id in self._envs:
            raise ActionError(f"session {session_id} is already open")
        image = await self.task_image(task)
        env = self.new_env(
            task,
            image=image,
            labels={LABEL_OWNER: session_id, "forkyard.task": task.name, **(labels or {})},
            env_version=env_version,
        )
        self._envs[session_id] = (env, task)
        try:
            observation = await env.reset()
        except BaseException:
            self._envs.pop(session_id, None)
            await env.close()
            raise
        assert env.sandbox is not None
        logger.info("session %s opened on sandbox %s (task %s)", session_id, env.sandbox.id, task.name)
        return SessionOpened(session_id, env.sandbox, observation, openai_tools(env.tools))

    def has_session(self, session_id: str) -> bool:
        """Tell whether the session is open here (between its open and its close)."""
        return session_id in self._envs

    def session_count(self) -> int:
        """Return how many sessions are open here."""
        return len(self._envs)

    def _env(self, session_id: str) -> Environment:
        try:
            return self._envs[session_id][0]
        except KeyError:
            raise SessionNotFoundError(f"no open session {session_id} on node {self.node}") from None

    async def step(self, session_id: str, tool: str, arguments: dict[str, Any]) -> StepResult:
        """Apply one action in the session's environment.

        Raises:
            SessionClosedError: the session was closed while the step ran (the close interrupts it).
            SandboxLostError: the session's sandbox crashed or vanished (the session cannot go on).
        """
        running = asyncio.ensure_future(self._env(session_id).step(Action(tool, arguments)))
        self._running_steps[session_id] = running
        try:
            return await running
        except (SandboxCrashedError, SandboxNotFoundError) as exc:
            raise worker_error(exc) from exc
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if running.cancelled() and not (current is not None and current.cancelling()):
                raise SessionClosedError(f"session {session_id} was closed while this step ran") from None
            raise
        finally:
            if self._running_steps.get(session_id) is running:
                del self._running_steps[session_id]

    async def run_oracle(self, session_id: str) -> StepResult:
        """Step the session through its task's oracle (:meth:`EnvFamily.oracle`); return the verifying step.

        Raises:
            TaskFormatError: the task has no reference solution.
            SessionClosedError: the oracle's actions did not end the episode.
        """
        env = self._env(session_id)
        task = self._envs[session_id][1]
        return await run_actions(env, family_of(task).oracle(task))

    async def close_session(self, session_id: str) -> None:
        """Destroy the session's sandbox; closing twice is fine."""
        opened = self._envs.pop(session_id, None)
        running = self._running_steps.pop(session_id, None)
        if running is not None and not running.done():
            running.cancel()  # the step answers SessionClosedError instead of holding the close
            await asyncio.wait([running])
        if opened is not None:
            await opened[0].close()
            logger.info("session %s closed", session_id)

    async def snapshot_session(
        self, session_id: str, *, metadata: Mapping[str, str] | None = None
    ) -> EnvSnapshot:
        """Snapshot an open session between steps: its sandbox and its env's logical state.

        Raises:
            SessionNotFoundError: no such open session here.
            SessionClosedError: its episode has ended.
            ActionError: its environment cannot be forked.
        """
        env = self._env(session_id)
        if not isinstance(env, Forkable):
            raise ActionError(f"session {session_id}: its environment cannot be snapshotted")
        snap = await env.snapshot(metadata=metadata)
        logger.info("session %s: snapshot %s", session_id, snap.id)
        return snap

    async def restore_envs(
        self, snapshot: EnvSnapshot, task: EnvTask, labels: list[dict[str, str]]
    ) -> list[Environment]:
        """Restore one sandbox per labels dict and wrap each in an env continuing from ``snapshot``.

        All or nothing: if one restore fails, the sandboxes already made are destroyed and
        the first error is raised. The envs are not registered as sessions.
        """
        from sandboxes.base import SandboxSpec

        src = snapshot.sandbox

        async def one(branch_labels: dict[str, str]) -> SandboxInfo:
            spec = SandboxSpec(image=src.image, resources=src.resources, network=src.network, labels=branch_labels)
            (info,) = await self.backend.restore(src, 1, spec=spec)
            return info

        restoring = asyncio.gather(*(one(lb) for lb in labels), return_exceptions=True)
        try:
            results = await asyncio.shield(restoring)
        except asyncio.CancelledError:  # let the restores finish, then destroy what they made
            results = await restoring
            await self._destroy_quietly([r for r in results if isinstance(r, SandboxInfo)], "a cancelled fork")
            raise
        made = [r for r in results if isinstance(r, SandboxInfo)]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self._destroy_quietly(made, "a failed fork")
            raise failed[0]
        family = family_of(task)
        return [
            family.restore(task, self.ctx, info, snapshot.state, labels=lb)
            for info, lb in zip(made, labels, strict=True)
        ]

    async def _destroy_quietly(self, sandboxes: list[SandboxInfo], after: str) -> None:
        for info in sandboxes:
            try:
                await self.backend.destroy(info.id)
            except Exception:
                logger.exception("destroying sandbox %s after %s failed", info.id, after)

    def snapshot_from_json(self, data: Mapping[str, Any]) -> EnvSnapshot:
        """Return the session snapshot :meth:`EnvSnapshot.to_json` described."""
        return EnvSnapshot.from_json(data)

    async def fork_session(
        self, snapshot: EnvSnapshot, new_session_ids: list[str], task: EnvTask, *,
        labels: Mapping[str, str] | None = None, launched: Callable[[], None] | None = None,
    ) -> list[SessionOpened]:
        """Restore one sandbox per new session id and continue the episode from ``snapshot`` in each.

        All or nothing: if one restore fails, the sandboxes already made are destroyed.
        ``launched``: see :meth:`workers.protocol.WorkerClient.fork_session` (the backend says when).
        """
        taken = [s for s in new_session_ids if s in self._envs]
        if taken or len(set(new_session_ids)) != len(new_session_ids):
            raise ActionError(f"sessions {', '.join(taken) or 'given twice'} are already open")
        with on_launched(launched) if launched is not None else contextlib.nullcontext():
            envs = await self.restore_envs(snapshot, task, [
                {LABEL_OWNER: s, "forkyard.task": task.name, **(labels or {})} for s in new_session_ids])
        opened = []
        for session_id, env in zip(new_session_ids, envs, strict=True):
            assert env.sandbox is not None
            self._envs[session_id] = (env, task)
            opened.append(SessionOpened(session_id, env.sandbox, task.instruction, openai_tools(env.tools)))
        logger.info("snapshot %s forked into %d session(s)", snapshot.id, len(opened))
        return opened

    async def delete_snapshot(self, snapshot_id: str, *, node: str | None = None) -> None:
        """Free a backend snapshot (idempotent); ``node`` is where it lives (here, the only node)."""
        await self.backend.delete_snapshot(snapshot_id)
        logger.info("snapshot %s deleted", snapshot_id)

    async def sweep_transient_snapshots(self, keep_session_snapshots: set[str] | None = None) -> list[str]:
        """Delete the snapshots trajectory trees and lazy-fork groups took (at start, after a crash).

        They live only as long as the tree or group that took it, and a new runtime runs
        none: whatever is left was orphaned by a crash. With ``keep_session_snapshots``
        (the ids the gateway's snapshot rows still reference), session snapshots not in it
        go too: a crash between taking one and recording it left them to nobody.
        """
        swept = []
        for snap in await self.backend.list_snapshots():
            keys = set(snap.metadata)
            orphan = (keep_session_snapshots is not None and SESSION_SNAPSHOT_KEY in keys
                      and snap.id not in keep_session_snapshots)
            if TRANSIENT_SNAPSHOT_KEYS & keys or orphan:
                await self.backend.delete_snapshot(snap.id)
                swept.append(snap.id)
        if swept:
            logger.warning("deleted %d snapshot(s) of trees, groups or sessions a crash interrupted", len(swept))
        return swept

    async def list_sandboxes(self) -> list[SandboxInfo]:
        """Return every sandbox of this node, live, orphaned or idle in the warm pool.

        A sandbox claimed from the pool shows the labels of its claim (its owner), not the pool's.
        """
        listed = await self.backend.list()
        if self.pool is None:
            return listed
        self.pool.forget_gone({info.id for info in listed})
        return [self.pool.view(info) for info in listed]

    def sandboxes_made_after(self, mark: int) -> tuple[list[SandboxInfo], int]:
        """Return the sandboxes this node made after ``mark`` (0: all it recalls), live or gone, as made,
        and the next mark (:class:`sandboxes.base.SandboxLedger`).

        A listing misses those made and destroyed between two; the heartbeat records them from here.
        One claimed from the pool shows the labels of its claim, as in :meth:`list_sandboxes` (ask
        before listing: a listing forgets the claims of sandboxes already gone).
        """
        made, next_mark = self.backend.made_after(mark)
        if self.pool is not None:
            made = [self.pool.view(info) for info in made]
        return made, next_mark

    def load_report(self) -> dict[str, Any]:
        """Return what this node's heartbeat reports beside its load: the warm pool's and the setup cache's state."""
        report: dict[str, Any] = {"sessions": self.session_count()}
        if self.pool is not None:
            report["pool"] = self.pool.stats()
        if self.setup_cache is not None:
            report["setup_cache"] = self.setup_cache.summary()
        return report

    async def run_command(self, kind: str, args: Mapping[str, Any]) -> str:
        """Carry out an operator's command (the console queues them; the heartbeat runs them); return what it did.

        ``kill_sandbox`` (``sandbox_id``): destroy it (a session's is closed; an episode's fails
        with an infra error at its next step). ``resize_pool`` (``key``, ``size``; < 0 clears the
        override). ``evict_cache`` (``entry``: a setup cache key id).

        Raises:
            ValueError: an unknown command, or one this node cannot carry out.
        """
        if kind == "kill_sandbox":
            sandbox_id = str(args["sandbox_id"])
            owner = next((info.labels.get(LABEL_OWNER) for info in await self.list_sandboxes()
                          if info.id == sandbox_id), None)
            if owner is not None and owner in self._envs:
                await self.close_session(owner)
                return f"closed session {owner} and its sandbox {sandbox_id}"
            if self.pool is not None:
                self.pool.drop(sandbox_id)
            await self.backend.destroy(sandbox_id)
            return f"destroyed sandbox {sandbox_id}"
        if kind == "resize_pool":
            if self.pool is None:
                raise ValueError("this node has no warm pool (FORKYARD_POOL__MAX_IDLE is 0)")
            self.pool.resize(str(args["key"]), int(args["size"]))
            return f"pool key {str(args['key'])[:12]}: target {args['size'] if int(args['size']) >= 0 else 'by demand'}"
        if kind == "evict_cache":
            if self.setup_cache is None or not await self.setup_cache.discard_id(str(args["entry"])):
                raise ValueError(f"no setup cache entry {str(args['entry'])[:16]} on this node")
            return f"evicted setup cache entry {str(args['entry'])[:12]}"
        raise ValueError(f"unknown node command {kind!r}")

    async def reap(self, keep_owner_ids: set[str] = frozenset()) -> list[str]:
        """Destroy this node's sandboxes that neither a live session here nor ``keep_owner_ids`` owns."""
        reaped = []
        for info in await self.list_sandboxes():
            if self.pool is not None and self.pool.holds(info.id):
                continue
            owner = info.labels.get(LABEL_OWNER)
            if owner in self._envs or owner in keep_owner_ids:
                continue
            await self.backend.destroy(info.id)
            reaped.append(info.id)
            logger.warning("reaped orphan sandbox %s (owner %s)", info.id, owner)
        return reaped

    async def aclose(self) -> None:
        """Close every session, then the backend."""
        if self._capping is not None:
            self._capping.cancel()
            await asyncio.gather(self._capping, return_exceptions=True)
        for session_id in list(self._envs):
            try:
                await self.close_session(session_id)
            except Exception:  # keep closing the others
                logger.exception("closing session %s failed", session_id)
        if self.pool is not None:
            await self.pool.aclose()
        await self.backend.aclose()
