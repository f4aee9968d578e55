"""Running a rollout's episodes from their wire jobs: the data plane's side of an executor.

An executor (the embedded dispatcher today; a Celery worker on another host next) turns
each queued episode into an :class:`~workers.protocol.EpisodeJob` under its rollout's
:class:`~workers.protocol.RolloutJob`, and hands it here with the task and an
:class:`~workers.protocol.EpisodeReporter`. What an episode needs beyond that (the policy
client, the tokenizer, the agent settings, the trajectory tree) is built here, once per
rollout in a :class:`RolloutPlan`, so the executor schedules and this module runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from sandboxes.base import LABEL_OWNER
from workers.branching import BranchingSpec, Tree
from workers.envs.registry import family_of
from workers.errors import WorkerError
from workers.policy import create_policy_client
from workers.policy.base import PolicyClient, Sampling
from workers.protocol import EpisodeJob, EpisodeReporter, RolloutJob
from workers.runner import AgentSettings, StageLimits, run_episode

if TYPE_CHECKING:
    from workers.envs.base import EnvTask
    from workers.policy.chat_template import ChatTokenizer
    from workers.runtime import WorkerRuntime

logger = logging.getLogger(__name__)


class RolloutPlan:
    """What every episode of one rollout shares: the policy client, tokenizer, agent settings, tree spec."""

    def __init__(
        self,
        job: RolloutJob,
        *,
        settings: AgentSettings,
        sampling: Sampling,
        tokenizer: ChatTokenizer | None,
        shared_policy: PolicyClient | None,
        branching: BranchingSpec | None,
    ) -> None:
        self.job = job
        self.settings = settings
        self.sampling = sampling
        self.tokenizer = tokenizer
        self.shared_policy = shared_policy
        self.branching = branching

    @classmethod
    async def load(cls, job: RolloutJob) -> RolloutPlan:
        """Build the plan, loading the tokenizer off the event loop; raise WorkerError if it cannot run."""
        spec = job.policy
        settings = AgentSettings.from_spec(job.agent, job.limits)
        sampling = Sampling.from_dict(spec.sampling)
        tokenizer = None
        if spec.api == "tokens":
            from workers.policy.chat_template import load_chat_tokenizer

            source = spec.tokenizer or spec.model
            try:
                tokenizer = await asyncio.to_thread(load_chat_tokenizer, source)
            except WorkerError:
                raise
            except Exception as exc:  # transformers raises OSError/ValueError for a bad path
                raise WorkerError(f"cannot load the tokenizer {source!r}: {exc}") from exc
        shared = None
        if spec.api != "scripted" or spec.actions:
            shared = create_policy_client(spec, tokenizer=tokenizer, tool_call_format=settings.tool_call_format)
        branching = BranchingSpec.from_dict(job.branching) if job.branching is not None else None
        return cls(job, settings=settings, sampling=sampling, tokenizer=tokenizer, shared_policy=shared,
                   branching=branching)

    def shares_sandboxes(self, task: EnvTask) -> bool:
        """Tell whether a group of ``task`` runs on one lazily forked sandbox."""
        return self.job.lazy_fork and self.branching is None and family_of(task).deterministic(task)

    def policy_for(self, task: EnvTask) -> PolicyClient:
        """Return the client for an episode of ``task`` (a fresh one for oracle replays)."""
        if self.shared_policy is not None:
            return self.shared_policy
        return create_policy_client(self.job.policy, task=task, tokenizer=self.tokenizer,
                                    tool_call_format=self.settings.tool_call_format)

    async def aclose(self) -> None:
        if self.shared_policy is not None:
            await self.shared_policy.aclose()


async def run_job(
    job: EpisodeJob,
    *,
    plan: RolloutPlan,
    task: EnvTask,
    runtime: WorkerRuntime,
    reporter: EpisodeReporter,
    stages: StageLimits,
    env_factory: Callable[[], Awaitable[Any]] | None = None,
) -> None:
    """Run one episode (and, in a branching rollout, its whole tree) and report its result.

    The trunk's result goes to ``reporter.finish`` like every branch's. Cancelled, the
    tree's branches are stopped before the cancellation goes on (the executor fails what
    was still running). Raises WorkerError when the episode cannot start at all (e.g. a
    scripted policy without an oracle for the task).
    """
    tree = None
    if plan.branching is not None:
        tree = Tree(plan.branching, root_episode_id=job.root_episode_id or job.episode_id, reporter=reporter,
                    delete_snapshot=runtime.delete_snapshot)
    try:
        policy = plan.policy_for(task)
        try:
            result = await run_episode(
                episode_id=job.episode_id, task=task, runtime=runtime, policy=policy,
                settings=plan.settings, sampling=plan.sampling, tokenizer=plan.tokenizer, stages=stages,
                reporter=reporter, max_staleness=plan.job.max_staleness,
                labels={"forkyard.rollout": plan.job.rollout_id}, env_version=job.env_version, tree=tree,
                env_factory=env_factory,
            )
            if tree is not None:
                result.info["tree"] = {"episodes": tree.episodes, "branch_points": tree.branch_points}
            try:
                await reporter.finish(job.episode_id, result)
            finally:  # the branches use the policy and the tree's snapshots: wait for them in any case
                if tree is not None:
                    await tree.join()
        finally:
            if policy is not plan.shared_policy:
                await policy.aclose()
    except asyncio.CancelledError:
        if tree is not None:
            await asyncio.shield(tree.cancel())
        raise


#: Runs one member of a shared group: its job, the group's private stage limits, the env factory.
MemberRunner = Callable[[EpisodeJob, StageLimits, Callable[[], Awaitable[Any]]], Awaitable[None]]


async def run_shared_group(
    jobs: list[EpisodeJob],
    *,
    plan: RolloutPlan,
    task: EnvTask,
    runtime: WorkerRuntime,
    group_id: str,
    agent_slot: asyncio.Semaphore,
    run_member: MemberRunner,
    on_image_failure: Callable[[Exception], Awaitable[None]],
) -> None:
    """Run a group's samples on one shared sandbox that forks where their actions diverge (lazy fork).

    The group takes one agent slot: its members wait for each other at every step, so they
    get private stage limits and must never queue behind each other. ``run_member`` runs
    each member's job (normally :func:`run_job` plus the executor's own failure handling)
    with the env factory of its place in the group. If the task's image cannot be built,
    no member starts and ``on_image_failure`` gets the error (every member fails with it,
    as a single episode's failed build would).
    """
    from workers.shared_env import SharedEnvGroup

    labels = {LABEL_OWNER: group_id, "forkyard.task": task.name, "forkyard.rollout": plan.job.rollout_id}
    try:
        image = await runtime.task_image(task)
    except Exception as exc:
        logger.warning("group %s: no image for task %s: %s", group_id, task.name, exc)
        await on_image_failure(exc)
        return
    env_version = jobs[0].env_version

    async def new_env() -> Any:
        return runtime.new_env(task, image=image, labels=labels, env_version=env_version)

    group = SharedEnvGroup(new_env, size=len(jobs), ctx=runtime.ctx, task=task, labels=labels)
    private = StageLimits.of(setup=len(jobs), agent=len(jobs), verify=len(jobs))

    def member_env(i: int) -> Callable[[], Awaitable[Any]]:
        async def factory() -> Any:
            return group.member(i)

        return factory

    try:
        async with agent_slot:
            await asyncio.gather(*(run_member(job, private, member_env(i)) for i, job in enumerate(jobs)))
    finally:
        await group.aclose()
        logger.info("group %s: %s", group_id, group.stats)


__all__ = ["MemberRunner", "RolloutPlan", "run_job", "run_shared_group"]
