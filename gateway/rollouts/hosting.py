"""Where the control plane meets the data plane: episodes run on this node's runtime.

An :class:`EpisodeHost` runs episodes a scheduler has already claimed (marked running,
under a lease) on a :class:`~workers.runtime.WorkerRuntime` and has them report into the
database through a :class:`~gateway.rollouts.reporting.DatabaseReporter`. Two schedulers
use it: the embedded mode's in-process :class:`~gateway.rollouts.dispatch.Dispatcher` and
the distributed mode's node agent (:mod:`gateway.fleet.worker`), which claims the episodes
of the jobs Celery delivers to it. It is one of the gateway's composition roots: with
:mod:`gateway.app` and :mod:`gateway.cli`, the only code that builds on the data plane
beyond its wire types (see the import-linter contracts in ``pyproject.toml``).
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

#: The error of an episode its rollout's cancel stopped.
CANCELLED_WHILE_RUNNING = "the rollout was cancelled while the episode ran"

#: A task ready to run, and its environment's ``name@version`` (part of the setup cache key).
LoadedTask = tuple["EnvTask", str]


class EpisodeHost:
    """Run claimed episodes on one node's runtime; they report into the database."""

    def __init__(
        self,
        *,
        sessionmaker: async_sessionmaker[AsyncSession],
        runtime: WorkerRuntime,
        node: str,
        stages: StageLimits | None = None,
        policies: PolicyStates | None = None,
    ) -> None:
        self._sessionmaker = sessionmaker
        self.runtime = runtime
        self.node = node
        self.stages = stages or StageLimits()
        self.policies = policies or PolicyStates(sessionmaker)
        """The policies' versions and pause flags, cached for every episode this host runs."""
        self.closing = False
        """Set at shutdown: a cancelled episode is then left running (requeued at the next start), not failed."""
        self._cleanups: set[asyncio.Task[None]] = set()
        """Failing the episodes of cancelled runs (held so they finish)."""

    async def load_plan(self, rollout_id: str) -> tuple[Rollout, RolloutPlan]:
        """Return a rollout and its plan (policy client, agent, limits) from its row.

        Raises:
            WorkerError: the stored rollout cannot run (invalid settings, unknown policy API).
        """
        from gateway.rollouts import service as rollouts_service

        async with self._sessionmaker() as db:
            rollout = await rollouts_service.get_rollout(db_session=db, rollout_id=rollout_id)
        try:
            plan = await RolloutPlan.load(rollout_job(rollout))
        except ValueError as exc:
            raise WorkerError(str(exc)) from exc
        return rollout, plan

    async def load_task(self, task_id: str) -> LoadedTask:
        """Return the task and its environment's ``name@version`` (part of the setup cache key)."""
        async with self._sessionmaker() as db:
            row = await db.get(Task, task_id)
            if row is None:
                raise WorkerError(f"task {task_id} vanished")
            env = await db.get(Environment, row.environment_id)
            task = await tasks_service.load_task(db_session=db, task_id=task_id)
        env_version = f"{env.name}@{env.version}" if env is not None else ""
        return task, env_version

    async def queued_group(self, episode: Episode) -> list[Episode]:
        """Return the queued first attempts of ``episode``'s group (it included)."""
        async with self._sessionmaker() as db:
            rows, _ = await episodes_service.list_episodes(
                db_session=db, group_id=episode.group_id, status=EpisodeStatus.QUEUED, limit=1024)
        members = [e for e in rows if e.attempt == 1]
        return sorted(members, key=lambda e: e.sample_index) or [episode]

    async def claim(self, episodes: list[Episode], lease: str | None = None) -> list[Episode]:
        """Mark queued episodes running on this node under ``lease``; return those this call got."""
        started = []
        for episode in episodes:
            async with self._sessionmaker() as db:
                if await episodes_service.mark_episode_running(
                        db_session=db, episode_id=episode.id, node=self.node, lease=lease):
                    started.append(episode)
        return started

    async def run(
        self, rollout: Rollout, plan: RolloutPlan, episodes: list[Episode], task: EnvTask, env_version: str, *,
        lease: str | None = None,
    ) -> None:
        """Run claimed episodes: one alone, or a group's samples on one shared sandbox (lazy fork)."""
        if len(episodes) == 1:
            await self.run_episode(rollout, plan, episodes[0], task, env_version, lease=lease)
        else:
            await self.run_shared_group(rollout, plan, episodes, task, env_version, lease=lease)

    def spawn(
        self, rollout: Rollout, plan: RolloutPlan, episodes: list[Episode], task: EnvTask, env_version: str, *,
        lease: str | None = None,
    ) -> asyncio.Task[None]:
        """Start :meth:`run` as a task that a cancel (the rollout's) can stop at any point.

        A cancel landing before the runner recorded anything (the task not started yet, or
        its episode waiting for a stage slot) still ends the claimed episodes: those still
        running are failed ``cancelled``; one that already ended is left as it is. At
        shutdown (:attr:`closing`) they are left running, to be requeued at the next start.
        """
        run = asyncio.create_task(self.run(rollout, plan, episodes, task, env_version, lease=lease),
                                  name=f"episode {episodes[0].id}")
        def ended(done: asyncio.Task[None]) -> None:
            if done.cancelled() and not self.closing:
                cleanup = asyncio.create_task(self._fail_cancelled(episodes, branching=plan.branching is not None,
                                                                   lease=lease))
                self._cleanups.add(cleanup)
                cleanup.add_done_callback(self._cleanups.discard)

        run.add_done_callback(ended)  # first: it has run by the time anything awaiting ``run`` resumes
        return run

    async def settle(self) -> None:
        """Wait until the episodes of the runs cancelled so far are marked failed (see :meth:`spawn`)."""
        while self._cleanups:
            await asyncio.gather(*list(self._cleanups), return_exceptions=True)

    async def run_shared_group(
        self, rollout: Rollout, plan: RolloutPlan, episodes: list[Episode], task: EnvTask, env_version: str, *,
        lease: str | None = None,
    ) -> None:
        """Run a group's samples on one shared sandbox that forks where their actions diverge."""
        by_id = {e.id: e for e in episodes}
        jobs = [episode_job(e, env_version) for e in episodes]

        async def member(job: EpisodeJob, stages: StageLimits, env_factory: Any) -> None:
            await self.run_episode(rollout, plan, by_id[job.episode_id], task, env_version, stages=stages,
                                   env_factory=env_factory, lease=lease)

        async def no_image(exc: Exception) -> None:
            await self.fail([e.id for e in episodes], "error", f"{type(exc).__name__}: {exc}",
                            infra=infra_failure(exc), lease=lease)

        await run_shared_group(jobs, plan=plan, task=task, runtime=self.runtime, group_id=episodes[0].group_id,
                               agent_slot=self.stages.agent, run_member=member, on_image_failure=no_image)

    async def run_episode(
        self, rollout: Rollout, plan: RolloutPlan, episode: Episode, task: EnvTask, env_version: str, *,
        stages: StageLimits | None = None, env_factory: Any = None, lease: str | None = None,
    ) -> None:
        async def store_failed(episode_id: str, error: str) -> None:
            await self.fail([episode_id], "error", error, lease=lease)

        reporter = DatabaseReporter(self._sessionmaker, node=self.node, policy_name=rollout.policy_name,
                                    policies=self.policies, on_store_failure=store_failed, lease=lease)
        job = episode_job(episode, env_version)
        try:  # a cancel is :meth:`spawn`'s to settle: it fails the episodes (and branches) still running
            await run_job(job, plan=plan, task=task, runtime=self.runtime, reporter=reporter,
                          stages=stages or self.stages, env_factory=env_factory)
        except WorkerError as exc:  # e.g. the scripted policy has no oracle for this task
            await self.fail([episode.id], "error", str(exc), lease=lease)

    async def fail(
        self, episode_ids: list[str], termination: str, error: str, *, infra: bool = False, lease: str | None = None
    ) -> None:
        """Mark episodes failed; one that cannot be stored is logged (a restart fails it, as it is running).

        ``infra``: the failure is the infrastructure's (a sandbox, an image, a node), not the policy's.
        """
        for episode_id in episode_ids:
            try:
                async with self._sessionmaker() as db:
                    await episodes_service.finish_episode(
                        db_session=db, episode_id=episode_id, status="failed", termination=termination,
                        reward=None, error=error, info={"infra": True} if infra else None, lease=lease,
                    )
            except episodes_service.LeaseLostError as exc:
                logger.warning("%s", exc)
            except Exception:
                logger.exception("episode %s: marking it failed (%s) failed", episode_id, error)

    async def _fail_cancelled(self, episodes: list[Episode], *, branching: bool, lease: str | None) -> None:
        """Fail the episodes of a cancelled run, and the branches of their trees still running."""
        ids = [e.id for e in episodes]
        if branching:
            try:
                for episode in episodes:
                    ids += await self._running_branches(episode.root_episode_id or episode.id)
            except Exception:  # the trunk is still failed; a branch left running is failed at the next start
                logger.exception("episode %s: listing the branches of a cancelled tree failed", episodes[0].id)
        await self.fail(list(dict.fromkeys(ids)), "cancelled", CANCELLED_WHILE_RUNNING, lease=lease)

    async def _running_branches(self, root_episode_id: str) -> list[str]:
        """Return the ids of a tree's branches still marked running (its trunk left out)."""
        async with self._sessionmaker() as db:
            rows = await episodes_service.list_tree_episodes(
                db_session=db, root_episode_id=root_episode_id, status=EpisodeStatus.RUNNING)
        return [e.id for e in rows if e.id != root_episode_id]


def episode_job(episode: Episode, env_version: str) -> EpisodeJob:
    return EpisodeJob(episode_id=episode.id, task_id=episode.task_id, root_episode_id=episode.root_episode_id,
                      env_version=env_version)


def rollout_job(rollout: Rollout) -> RolloutJob:
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
