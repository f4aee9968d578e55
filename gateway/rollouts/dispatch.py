"""The in-process dispatcher (embedded mode): runs the episodes of active rollouts.

It owns no state of its own that matters after a crash: every decision is read from and
written to the database through the episode and rollout services, so a restarted
gateway requeues what was interrupted and resumes the rollouts still active.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.episodes import service as episodes_service
from gateway.policies import service as policies_service
from gateway.rollouts import service as rollouts_service
from gateway.tasks import service as tasks_service
from gateway.tasks.models import Task
from workers.errors import WorkerError
from workers.policy import create_policy_client
from workers.policy.base import PolicyClient, Sampling
from workers.runner import AgentSettings, StageLimits, StepRecord, run_episode

if TYPE_CHECKING:
    from gateway.episodes.models import Episode
    from gateway.rollouts.models import Rollout
    from workers.policy.chat_template import ChatTokenizer
    from workers.runtime import WorkerRuntime
    from workers.tasks import TerminalTask

logger = logging.getLogger(__name__)

#: How often a paused policy's gate looks at the database again.
PAUSE_POLL_S = 0.25


class Dispatcher:
    """Run every active rollout's queued episodes on this node's runtime."""

    def __init__(
        self,
        *,
        sessionmaker: async_sessionmaker[AsyncSession],
        runtime: WorkerRuntime,
        node: str,
        stages: StageLimits | None = None,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._runtime = runtime
        self._node = node
        self._stages = stages or StageLimits()
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

    async def cancel(self, rollout_id: str) -> None:
        """Stop a rollout's running episodes (the service has already cancelled it in the DB)."""
        running = list(self._episodes.get(rollout_id, {}).values())
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
            plan = await _Plan.load(rollout)
        except (WorkerError, ValueError) as exc:
            logger.warning("rollout %s cannot run: %s", rollout_id, exc)
            async with self._sessionmaker() as db:
                await rollouts_service.fail_rollout(db_session=db, rollout_id=rollout_id, error=str(exc))
            return
        running = self._episodes.setdefault(rollout_id, {})
        slots = asyncio.Semaphore(max(1, rollout.concurrency))
        tasks: dict[str, TerminalTask] = {}
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
                for episode in queued:
                    await slots.acquire()
                    async with self._sessionmaker() as db:
                        ok = await episodes_service.mark_episode_running(
                            db_session=db, episode_id=episode.id, node=self._node
                        )
                    if not ok:
                        slots.release()
                        continue
                    if episode.task_id not in tasks:
                        tasks[episode.task_id] = await self._load_task(episode.task_id)
                    task = asyncio.create_task(
                        self._run_episode(rollout, plan, episode, tasks[episode.task_id]), name=f"episode {episode.id}"
                    )
                    running[episode.id] = task
                    task.add_done_callback(lambda _t, eid=episode.id: (running.pop(eid, None), slots.release()))
        except asyncio.CancelledError:
            for task in list(running.values()):
                task.cancel()
            await asyncio.gather(*running.values(), return_exceptions=True)
            raise
        finally:
            await plan.aclose()
            self._episodes.pop(rollout_id, None)
        logger.info("rollout %s: no episode left to run", rollout_id)

    async def _load_task(self, task_id: str) -> TerminalTask:
        async with self._sessionmaker() as db:
            row = await db.get(Task, task_id)
        if row is None:
            raise WorkerError(f"task {task_id} vanished")
        return await tasks_service.load_terminal_task(row)

    async def _run_episode(self, rollout: Rollout, plan: _Plan, episode: Episode, task: TerminalTask) -> None:
        sm = self._sessionmaker

        async def on_step(step: StepRecord) -> None:
            async with sm() as db:
                await episodes_service.record_step(db_session=db, episode_id=episode.id, step=step.as_dict())

        async def version_of() -> int:
            async with sm() as db:
                return await policies_service.current_version(db_session=db, name=rollout.policy_name)

        async def stale_check(versions: list[int]) -> str | None:
            if rollout.max_staleness is None:
                return None
            current = await version_of()
            if current - min(versions) <= rollout.max_staleness:
                return None
            return (f"stopped at dispatch: oldest turn at version {min(versions)}, policy at {current} "
                    f"(max_staleness {rollout.max_staleness})")

        async def gate() -> None:
            while True:
                async with sm() as db:
                    if not await policies_service.is_paused(db_session=db, name=rollout.policy_name):
                        return
                await asyncio.sleep(PAUSE_POLL_S)

        try:
            policy = plan.policy_for(task)
            try:
                result = await run_episode(
                    episode_id=episode.id, task=task, runtime=self._runtime, policy=policy,
                    settings=plan.settings, sampling=plan.sampling, tokenizer=plan.tokenizer, stages=self._stages,
                    version_of=version_of, gate=gate, on_step=on_step, stale_check=stale_check,
                    labels={"forkyard.rollout": rollout.id},
                )
            finally:
                if policy is not plan.shared_policy:
                    await policy.aclose()
        except asyncio.CancelledError:
            if self._closed:
                raise  # shutdown: left running, requeued at the next start
            async with sm() as db:
                await episodes_service.finish_episode(
                    db_session=db, episode_id=episode.id, status="failed", termination="cancelled",
                    reward=None, error="the rollout was cancelled while the episode ran",
                )
            raise
        except WorkerError as exc:  # e.g. the scripted policy has no oracle for this task
            async with sm() as db:
                await episodes_service.finish_episode(
                    db_session=db, episode_id=episode.id, status="failed", termination="error", reward=None,
                    error=str(exc),
                )
            return
        async with sm() as db:
            await episodes_service.finish_episode(
                db_session=db, episode_id=episode.id, status=result.status, termination=result.termination,
                reward=result.reward, error=result.error, messages=result.messages, timings=result.timings,
                weight_versions=result.weight_versions, info=result.info,
            )


class _Plan:
    """What every episode of one rollout shares: policy client, tokenizer, agent settings."""

    def __init__(
        self,
        spec: dict[str, Any],
        settings: AgentSettings,
        sampling: Sampling,
        tokenizer: ChatTokenizer | None,
        shared_policy: PolicyClient | None,
    ) -> None:
        self.spec = spec
        self.settings = settings
        self.sampling = sampling
        self.tokenizer = tokenizer
        self.shared_policy = shared_policy

    @classmethod
    async def load(cls, rollout: Rollout) -> _Plan:
        """Build the plan, loading the tokenizer off the event loop; raise WorkerError if it cannot run."""
        spec = dict(rollout.policy)
        settings = AgentSettings.from_spec(rollout.agent, rollout.limits)
        sampling = Sampling.from_dict(spec.get("sampling") or {})
        tokenizer = None
        if spec.get("api") == "tokens":
            from workers.policy.chat_template import load_chat_tokenizer

            source = spec.get("tokenizer") or spec.get("model")
            try:
                tokenizer = await asyncio.to_thread(load_chat_tokenizer, source)
            except WorkerError:
                raise
            except Exception as exc:  # transformers raises OSError/ValueError for a bad path
                raise WorkerError(f"cannot load the tokenizer {source!r}: {exc}") from exc
        shared = None
        if spec.get("api") != "scripted" or spec.get("actions"):
            shared = create_policy_client(spec, tokenizer=tokenizer, tool_call_format=settings.tool_call_format)
        return cls(spec, settings, sampling, tokenizer, shared)

    def policy_for(self, task: TerminalTask) -> PolicyClient:
        """Return the client for an episode of ``task`` (a fresh one for oracle replays)."""
        if self.shared_policy is not None:
            return self.shared_policy
        return create_policy_client(
            self.spec, task=task, tokenizer=self.tokenizer, tool_call_format=self.settings.tool_call_format
        )

    async def aclose(self) -> None:
        if self.shared_policy is not None:
            await self.shared_policy.aclose()

