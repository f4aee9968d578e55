"""The in-process dispatcher (embedded mode): schedules the episodes of active rollouts.

It decides what runs (queued episodes, concurrency, lazy-fork groups, drain) and hands
each episode to the data plane as an :class:`~workers.protocol.EpisodeJob` under its
rollout's :class:`~workers.protocol.RolloutJob`; :func:`workers.jobs.run_job` runs it and
reports through a :class:`~gateway.rollouts.reporting.DatabaseReporter`.

It owns no state of its own that matters after a crash: every decision is read from and
written to the database through the episode and rollout services, so a restarted
gateway requeues what was interrupted and resumes the rollouts still active.

Two ways of running episodes share sandboxes:

- Branching rollouts run each sample as a trajectory tree (:mod:`workers.branching`):
  the trunk episode forks branch episodes, which this dispatcher stores as they appear.
- Groups of a task that declares deterministic tools (``[environment]
  deterministic_tools = true``) run as one unit on a
  :class:`~workers.shared_env.SharedEnvGroup` (lazy fork, :func:`workers.jobs.run_shared_group`), unless the rollout turns
  ``lazy_fork`` off. The group takes one concurrency slot and one agent slot: its samples
  wait for each other at every step, so they must never queue behind each other.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.environments.models import Environment
from gateway.episodes import service as episodes_service
from gateway.logs import register_secret
from gateway.nodes import service as nodes_service
from gateway.rollouts import service as rollouts_service
from gateway.rollouts.reporting import DatabaseReporter, PolicyStates
from gateway.tasks import service as tasks_service
from gateway.tasks.models import Task
from workers.errors import WorkerError
from workers.jobs import RolloutPlan, run_job, run_shared_group
from workers.protocol import (
    AgentSpec,
    BranchingSpec,
    EpisodeJob,
    EpisodeStatus,
    LimitsSpec,
    PolicySpec,
    RolloutJob,
    describe,
)
from workers.runner import StageLimits, infra_failure

if TYPE_CHECKING:
    from gateway.episodes.models import Episode
    from gateway.rollouts.models import Rollout
    from workers.envs.base import EnvTask
    from workers.runtime import WorkerRuntime

logger = logging.getLogger(__name__)


class Dispatcher:
    """Run every active rollout's queued episodes on this node's runtime."""

    def __init__(
        self,
        *,
        sessionmaker: async_sessionmaker[AsyncSession],
        runtime: WorkerRuntime,
        node: str,
        stages: StageLimits | None = None,
        policies: PolicyStates | None = None,
        drain_poll_s: float = 5.0,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._runtime = runtime
        self._node = node
        self._stages = stages or StageLimits()
        self.policies = policies or PolicyStates(sessionmaker)
        """The policies' versions and pause flags, cached for every episode this dispatcher runs."""
        self._drain_poll_s = drain_poll_s
        self._rollouts: dict[str, asyncio.Task[None]] = {}
        self._episodes: dict[str, dict[str, asyncio.Task[None]]] = {}
        self._closed = False

    async def start(self) -> None:
        """Requeue what a crash interrupted and resume the rollouts still active."""
        async with self._sessionmaker() as db:
            interrupted = await episodes_service.requeue_interrupted(db_session=db, node=self._node)
        if interrupted:
            logger.warning("requeued %d episode(s) interrupted by a restart", interrupted)
        async with self._sessionmaker() as db:
            active = await rollouts_service.list_active_rollouts(db_session=db)
        for rollout in active:
            self.submit(rollout.id)

    def submit(self, rollout_id: str) -> None:
        """Start running a rollout's episodes in the background (no-op if it already runs)."""
        if self._closed:
            return
        task = self._rollouts.get(rollout_id)
        if task is None or task.done():
            self._rollouts[rollout_id] = asyncio.create_task(self._run_rollout(rollout_id), name=f"rollout {rollout_id}")

    @property
    def running_episodes(self) -> int:
        """Episodes running on this node now (a shared group's samples each count)."""
        return sum(len(running) for running in self._episodes.values())

    async def _draining(self) -> bool:
        async with self._sessionmaker() as db:
            return await nodes_service.is_draining(db_session=db, name=self._node)

    async def cancel(self, rollout_id: str) -> None:
        """Stop a rollout's running episodes (the service has already cancelled it in the DB)."""
        running = list(set(self._episodes.get(rollout_id, {}).values()))
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    async def aclose(self) -> None:
        """Stop everything; interrupted episodes stay ``running`` and are requeued at the next start."""
        self._closed = True
        tasks = list(self._rollouts.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_rollout(self, rollout_id: str) -> None:
        try:
            async with self._sessionmaker() as db:
                rollout = await rollouts_service.get_rollout(db_session=db, rollout_id=rollout_id)
            plan = await RolloutPlan.load(_rollout_job(rollout))
        except (WorkerError, ValueError) as exc:
            logger.warning("rollout %s cannot run: %s", rollout_id, exc)
            async with self._sessionmaker() as db:
                await rollouts_service.fail_rollout(db_session=db, rollout_id=rollout_id, error=str(exc))
            return
        running = self._episodes.setdefault(rollout_id, {})
        slots = asyncio.Semaphore(max(1, rollout.concurrency))
        tasks: dict[str, tuple[EnvTask, str]] = {}
        try:
            while True:
                async with self._sessionmaker() as db:
                    queued = await episodes_service.list_queued_episodes(
                        db_session=db, rollout_id=rollout_id, limit=max(1, rollout.concurrency)
                    )
                queued = [ep for ep in queued if ep.id not in running]
                if not queued:
                    if not running:
                        break
                    await asyncio.wait(list(running.values()), return_when=asyncio.FIRST_COMPLETED)
                    continue
                if await self._draining():  # no new episode starts here; what runs finishes
                    await asyncio.sleep(self._drain_poll_s)
                    continue
                for episode in queued:
                    if episode.id in running:  # taken with its group
                        continue
                    await slots.acquire()
                    if episode.task_id not in tasks:
                        tasks[episode.task_id] = await self._load_task(episode.task_id)
                    task, env_version = tasks[episode.task_id]
                    members = [episode]
                    if plan.shares_sandboxes(task) and episode.attempt == 1:
                        members = await self._queued_group(episode)
                    started = []
                    for member in members:
                        async with self._sessionmaker() as db:
                            if await episodes_service.mark_episode_running(
                                    db_session=db, episode_id=member.id, node=self._node):
                                started.append(member)
                    if not started:
                        slots.release()
                        continue
                    if len(started) == 1:
                        coro = self._run_episode(rollout, plan, started[0], task, env_version)
                    else:
                        coro = self._run_shared_group(rollout, plan, started, task, env_version)
                    run = asyncio.create_task(coro, name=f"episode {started[0].id}")
                    for member in started:
                        running[member.id] = run
                    ids = [m.id for m in started]
                    run.add_done_callback(lambda _t, ids=ids: ([running.pop(i, None) for i in ids], slots.release()))
        except asyncio.CancelledError:
            for task in set(running.values()):
                task.cancel()
            await asyncio.gather(*set(running.values()), return_exceptions=True)
            raise
        finally:
            await plan.aclose()
            self._episodes.pop(rollout_id, None)
        logger.info("rollout %s: no episode left to run", rollout_id)

    async def _load_task(self, task_id: str) -> tuple[EnvTask, str]:
        """Return the task and its environment's ``name@version`` (part of the setup cache key)."""
        async with self._sessionmaker() as db:
            row = await db.get(Task, task_id)
            if row is None:
                raise WorkerError(f"task {task_id} vanished")
            env = await db.get(Environment, row.environment_id)
            task = await tasks_service.load_task(db_session=db, task_id=task_id)
        env_version = f"{env.name}@{env.version}" if env is not None else ""
        return task, env_version

    async def _queued_group(self, episode: Episode) -> list[Episode]:
        """Return the queued first attempts of ``episode``'s group (it included)."""
        async with self._sessionmaker() as db:
            rows, _ = await episodes_service.list_episodes(
                db_session=db, group_id=episode.group_id, status=EpisodeStatus.QUEUED, limit=1024)
        members = [e for e in rows if e.attempt == 1]
        return sorted(members, key=lambda e: e.sample_index) or [episode]

    async def _run_shared_group(
        self, rollout: Rollout, plan: RolloutPlan, episodes: list[Episode], task: EnvTask, env_version: str
    ) -> None:
        """Run a group's samples on one shared sandbox that forks where their actions diverge."""
        by_id = {e.id: e for e in episodes}
        jobs = [_episode_job(e, env_version) for e in episodes]

        async def member(job: EpisodeJob, stages: StageLimits, env_factory: Any) -> None:
            await self._run_episode(rollout, plan, by_id[job.episode_id], task, env_version, stages=stages,
                                    env_factory=env_factory)

        async def no_image(exc: Exception) -> None:
            await self._fail([e.id for e in episodes], "error", f"{type(exc).__name__}: {exc}",
                             infra=infra_failure(exc))

        await run_shared_group(jobs, plan=plan, task=task, runtime=self._runtime, group_id=episodes[0].group_id,
                               agent_slot=self._stages.agent, run_member=member, on_image_failure=no_image)

    async def _run_episode(
        self, rollout: Rollout, plan: RolloutPlan, episode: Episode, task: EnvTask, env_version: str, *,
        stages: StageLimits | None = None, env_factory: Any = None,
    ) -> None:
        reporter = DatabaseReporter(self._sessionmaker, node=self._node, policy_name=rollout.policy_name,
                                    policies=self.policies, on_store_failure=self._store_failed)
        job = _episode_job(episode, env_version)
        try:
            await run_job(job, plan=plan, task=task, runtime=self._runtime, reporter=reporter,
                          stages=stages or self._stages, env_factory=env_factory)
        except asyncio.CancelledError:
            branches = await self._running_branches(job.root_episode_id or job.episode_id) if plan.branching else []
            if self._closed:
                raise  # shutdown: left running, failed (or requeued) at the next start
            await self._fail([episode.id, *branches], "cancelled", "the rollout was cancelled while the episode ran")
            raise
        except WorkerError as exc:  # e.g. the scripted policy has no oracle for this task
            await self._fail([episode.id], "error", str(exc))

    async def _store_failed(self, episode_id: str, error: str) -> None:
        await self._fail([episode_id], "error", error)

    async def _fail(self, episode_ids: list[str], termination: str, error: str, *, infra: bool = False) -> None:
        """Mark episodes failed; one that cannot be stored is logged (a restart fails it, as it is running).

        ``infra``: the failure is the infrastructure's (a sandbox, an image, a node), not the policy's.
        """
        for episode_id in episode_ids:
            try:
                async with self._sessionmaker() as db:
                    await episodes_service.finish_episode(
                        db_session=db, episode_id=episode_id, status="failed", termination=termination,
                        reward=None, error=error, info={"infra": True} if infra else None,
                    )
            except Exception:
                logger.exception("episode %s: marking it failed (%s) failed", episode_id, error)

    async def _running_branches(self, root_episode_id: str) -> list[str]:
        """Return the ids of a tree's branches still marked running (its trunk left out)."""
        async with self._sessionmaker() as db:
            rows = await episodes_service.list_tree_episodes(
                db_session=db, root_episode_id=root_episode_id, status=EpisodeStatus.RUNNING)
        return [e.id for e in rows if e.id != root_episode_id]


def _episode_job(episode: Episode, env_version: str) -> EpisodeJob:
    return EpisodeJob(episode_id=episode.id, task_id=episode.task_id, root_episode_id=episode.root_episode_id,
                      env_version=env_version)


def _rollout_job(rollout: Rollout) -> RolloutJob:
    """Return what the rollout's episodes run with, from its row (the API key put back); raise WorkerError if invalid."""
    policy = dict(rollout.policy)
    if rollout.policy_api_key:
        register_secret(rollout.policy_api_key)
        policy["api_key"] = rollout.policy_api_key
    try:
        return RolloutJob(
            rollout_id=rollout.id, policy=PolicySpec.from_stored(policy), agent=AgentSpec.from_stored(rollout.agent),
            limits=LimitsSpec.from_stored(rollout.limits),
            branching=BranchingSpec.from_stored(rollout.branching) if rollout.branching else None,
            lazy_fork=bool(rollout.lazy_fork), max_staleness=rollout.max_staleness,
        )
    except ValidationError as exc:
        raise WorkerError(describe(exc, f"rollout {rollout.id}")) from exc
