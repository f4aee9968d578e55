"""``forkyard worker``: a node agent that runs the episode jobs Celery delivers on this host's sandboxes.

A worker node owns a sandbox backend (docker or local) under its own data dir and node
name. It is one of the gateway package's composition roots (with :mod:`gateway.app` and
:mod:`gateway.cli`): it builds the data plane (:class:`~workers.runtime.WorkerRuntime`) and
reports into the database like the embedded mode's dispatcher, through the same
:class:`~gateway.rollouts.hosting.EpisodeHost`.

Threads: Celery's consumer and its pool (``threads``, one per capacity slot) block on the
jobs; the jobs themselves run as coroutines on one asyncio loop in a thread of its own,
beside the node's heartbeat and its cancel listener.

A job names an episode. The node runs it only if it can claim it (queued → running on this
node, under a fresh lease: a fencing token every write of the attempt carries); a
duplicate delivery finds it claimed, or ended, and exits without touching a sandbox. A
draining node hands a job back to the schedulers instead of running it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import sys
import threading
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from gateway.db import check_database, create_engine, create_sessionmaker, new_id, redact_database_url
from gateway.episodes import service as episodes_service
from gateway.errors import NotFoundError
from gateway.fleet import event_loop
from gateway.fleet.channel import NodeServer, pb2
from gateway.fleet.queues import CANCEL_CHANNEL, RUN_EPISODE, SHARED_QUEUE, celery_app, node_queue
from gateway.nodes import service as nodes_service
from gateway.nodes.heartbeat import Heartbeat
from gateway.rollouts import service as rollouts_service
from gateway.rollouts.events import RedisBridge, rollout_events
from gateway.rollouts.hosting import EpisodeHost
from gateway.rollouts.models import RolloutStatus
from gateway.sessions import service as sessions_service
from workers.errors import NotSupportedError, WorkerError
from workers.protocol import EpisodeStatus, OpenedWire, SandboxWire, StepWire, wire_json_default
from workers.runner import StageLimits
from workers.runtime import worker_error

if TYPE_CHECKING:
    from gateway.rollouts.hosting import LoadedTask, RolloutPlan
    from gateway.rollouts.models import Rollout
    from gateway.settings import Settings

logger = logging.getLogger(__name__)

#: What :meth:`NodeAgent.run_job` says of a job.
RAN, DUPLICATE, RETURNED, CANCELLED, FAILED = "ran", "duplicate", "returned", "cancelled", "failed"


class NodeAgent:
    """One worker node: its runtime, heartbeat and cancel listener on an asyncio loop of its own."""

    def __init__(self, settings: Settings, *, capacity: int) -> None:
        self.settings = settings
        self.node = settings.node
        self.capacity = capacity
        self.outcomes: dict[str, int] = {RAN: 0, DUPLICATE: 0, RETURNED: 0, CANCELLED: 0, FAILED: 0}
        """How many jobs ended each way (reported with the heartbeat's load)."""
        self._loop = event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"node {self.node}", daemon=True)
        self._runs: dict[str, set[asyncio.Task[Any]]] = {}
        self._plans: dict[str, tuple[Rollout, RolloutPlan]] = {}
        self._tasks: dict[str, LoadedTask] = {}
        self._background: list[asyncio.Task[None]] = []
        self._host: EpisodeHost | None = None
        self._runtime: Any = None
        self._engine: Any = None
        self._sessionmaker: Any = None
        self._heartbeat: Heartbeat | None = None
        self._bridge: RedisBridge | None = None
        self._channel: NodeServer | None = None
        self.address = ""
        """``host:port`` of this node's session channel (the gateways call it)."""

    # ------------------------------------------------------------------ life cycle (any thread)

    def start(self) -> None:
        """Start the loop thread, the runtime (reaping what a crash left) and the heartbeat."""
        self._thread.start()
        self._call(self._start())

    def stop(self) -> None:
        """Stop the jobs that run (left ``running``: handed on as interrupted), then everything else."""
        if self._thread.is_alive():
            self._call(self._stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    def stop_jobs(self) -> None:
        """Cancel the jobs that run, at shutdown (Celery then acknowledges them; their episodes get new attempts)."""
        if self._thread.is_alive() and self._host is not None:
            self._host.closing = True
            self._loop.call_soon_threadsafe(self._cancel_all)

    def run_job(self, rollout_id: str, episode_id: str) -> str:
        """Run one job (blocking the calling pool thread); return what became of it."""
        return self._call(self._run_job(rollout_id, episode_id))

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ------------------------------------------------------------------ on the loop

    async def _start(self) -> None:
        from gateway.app import build_runtime
        from workers.envs.registry import configure_families

        settings = self.settings
        configure_families(settings.family_options())
        url = settings.database_url
        assert url is not None
        await asyncio.to_thread(check_database, url)  # the gateways migrate; a node only checks
        self._engine = create_engine(url)
        self._sessionmaker = create_sessionmaker(self._engine)
        assert settings.redis_url
        self._bridge = RedisBridge(rollout_events, settings.redis_url)  # episodes finished here wake every gateway
        await self._bridge.start()
        self._runtime = await asyncio.to_thread(build_runtime, settings, default_pool_idle=self.capacity)
        await self._runtime.start(progress=lambda line: logger.info("image: %s", line))
        async with self._sessionmaker() as db:
            await sessions_service.recover_node(db_session=db, runtime=self._runtime, node=self.node)
        async with self._sessionmaker() as db:
            interrupted = await episodes_service.requeue_interrupted(db_session=db, node=self.node)
        if interrupted:
            logger.warning("node %s: %d episode(s) a crash interrupted get new attempts", self.node, interrupted)
        token = secrets.token_urlsafe(32)  # the gateways read it with the address; a restart makes a new one
        self._channel = NodeServer(NodeCalls(self._runtime, self._task).reply, max_bytes=settings.max_body_bytes,
                                   token=token)
        port = await self._channel.start(settings.grpc_host, settings.grpc_port or 0)
        host = socket.gethostname() if settings.grpc_host in ("0.0.0.0", "::") else settings.grpc_host
        self.address = f"{host}:{port}"
        stages = StageLimits.of(setup=settings.stages.setup, agent=self.capacity, verify=settings.stages.verify)
        self._host = EpisodeHost(sessionmaker=self._sessionmaker, runtime=self._runtime, node=self.node, stages=stages)
        self._heartbeat = Heartbeat(
            self._sessionmaker, node=self.node, backend=self._runtime.backend_name, capacity=self.capacity,
            load=self._load, interval_s=settings.nodes.heartbeat_s, address=self.address, channel_token=token,
            sandboxes=self._runtime.list_sandboxes, made_after=self._runtime.sandboxes_made_after,
            demand=self._runtime.pool.set_demand if self._runtime.pool is not None else None,
            commands=self._runtime.run_command,
        )
        await self._heartbeat.start()
        self._background = [asyncio.create_task(self._listen(), name="cancel listener"),
                            asyncio.create_task(self._reconcile(), name="reconcile")]
        logger.info("node %s ready: %s backend, capacity %d, sessions on %s, database %s", self.node,
                    self._runtime.backend_name, self.capacity, self.address, redact_database_url(url))

    def _load(self) -> dict[str, Any]:
        return {**self._runtime.load_report(), "episodes": sum(len(runs) for runs in self._runs.values()),
                "stages": self._host.stages.in_use() if self._host is not None else {}, "jobs": dict(self.outcomes)}

    async def _run_job(self, rollout_id: str, episode_id: str) -> str:
        outcome = await self._run(rollout_id, episode_id)
        self.outcomes[outcome] += 1
        logger.info("job %s of rollout %s: %s", episode_id, rollout_id, outcome)
        return outcome

    async def _run(self, rollout_id: str, episode_id: str) -> str:
        assert self._host is not None and self._sessionmaker is not None
        try:
            async with self._sessionmaker() as db:
                episode = await episodes_service.get_episode(db_session=db, episode_id=episode_id)
        except NotFoundError:
            return DUPLICATE
        if episode.status != EpisodeStatus.QUEUED or self._host.closing:
            return DUPLICATE
        async with self._sessionmaker() as db:
            draining = await nodes_service.is_draining(db_session=db, name=self.node)
            if draining:
                await episodes_service.undispatch(db_session=db, episode_id=episode_id)
                return RETURNED
        try:
            rollout, plan = await self._plan(rollout_id)
            task, env_version = await self._task(episode.task_id)
        except WorkerError as exc:
            logger.warning("rollout %s cannot run: %s", rollout_id, exc)
            async with self._sessionmaker() as db:
                await rollouts_service.fail_rollout(db_session=db, rollout_id=rollout_id, error=str(exc))
            return FAILED
        members = [episode]
        if plan.shares_sandboxes(task) and episode.attempt == 1:
            members = await self._host.queued_group(episode)
        lease = new_id("lease")
        started = await self._host.claim(members, lease=lease)
        if not started:
            return DUPLICATE
        run = self._host.spawn(rollout, plan, started, task, env_version, lease=lease)
        runs = self._runs.setdefault(rollout_id, set())
        runs.add(run)
        try:
            await run
        except asyncio.CancelledError:
            pass
        finally:
            runs.discard(run)
        if run.cancelled():
            await self._host.settle()  # its episodes are failed before the job is acknowledged
            return CANCELLED
        return RAN

    async def _plan(self, rollout_id: str) -> tuple[Rollout, RolloutPlan]:
        assert self._host is not None
        if rollout_id not in self._plans:
            self._plans[rollout_id] = await self._host.load_plan(rollout_id)
        return self._plans[rollout_id]

    async def _task(self, task_id: str) -> LoadedTask:
        assert self._host is not None
        if task_id not in self._tasks:
            self._tasks[task_id] = await self._host.load_task(task_id)
        return self._tasks[task_id]

    def _cancel_rollout(self, rollout_id: str) -> None:
        for run in self._runs.get(rollout_id, ()):
            run.cancel()

    def _cancel_all(self) -> None:
        for rollout_id in list(self._runs):
            self._cancel_rollout(rollout_id)

    async def _listen(self) -> None:
        """Stop a rollout's jobs as soon as a gateway publishes its cancel."""
        from redis.asyncio import Redis

        assert self.settings.redis_url
        while True:
            client = Redis.from_url(self.settings.redis_url)
            try:
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(CANCEL_CHANNEL)
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self._cancel_rollout(message["data"].decode())
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis restarting: the reconcile loop covers the gap
                logger.warning("node %s: the cancel channel dropped; reconnecting", self.node, exc_info=True)
                await asyncio.sleep(1.0)
            finally:
                await client.aclose()

    async def _reconcile(self) -> None:
        """Every heartbeat: stop the jobs of rollouts no longer active; drop the plans of those that ended."""
        assert self._sessionmaker is not None
        while True:
            await asyncio.sleep(self.settings.nodes.heartbeat_s)
            try:
                for rollout_id in list(self._plans):
                    async with self._sessionmaker() as db:
                        rollout = await rollouts_service.get_rollout(db_session=db, rollout_id=rollout_id)
                    if rollout.status in (RolloutStatus.QUEUED, RolloutStatus.RUNNING):
                        continue
                    self._cancel_rollout(rollout_id)
                    if not self._runs.get(rollout_id):
                        _, plan = self._plans.pop(rollout_id)
                        self._runs.pop(rollout_id, None)
                        await plan.aclose()
            except Exception:
                logger.warning("node %s: reconciling the rollouts failed", self.node, exc_info=True)

    async def _stop(self) -> None:
        if self._host is not None:
            self._host.closing = True
        self._cancel_all()
        runs = [run for runs in self._runs.values() for run in runs]
        await asyncio.gather(*runs, return_exceptions=True)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._channel is not None:
            await self._channel.aclose()
        if self._heartbeat is not None:
            await self._heartbeat.aclose()
        for _, plan in self._plans.values():
            await plan.aclose()
        if self._runtime is not None:
            async with self._sessionmaker() as db:
                closed = await sessions_service.close_node_sessions(
                    db_session=db, runtime=self._runtime, node=self.node, reason="its worker node shut down")
            if closed:
                logger.info("node %s: closed %d open session(s) at shutdown", self.node, closed)
            await self._runtime.aclose()
        if self._bridge is not None:
            await self._bridge.aclose()
        if self._engine is not None:
            await self._engine.dispose()


def run_worker(settings: Settings, *, capacity: int, log_level: str = "INFO") -> int:
    """Run a node until SIGTERM/SIGINT: start the agent, then consume the shared queue and the node's own."""
    from celery.signals import worker_ready, worker_shutting_down

    assert settings.redis_url, "the distributed mode needs FORKYARD_REDIS_URL"
    agent = NodeAgent(settings, capacity=capacity)
    app = celery_app(settings.redis_url, visibility_timeout_s=settings.fleet.visibility_timeout_s)

    @app.task(name=RUN_EPISODE, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
    def run_episode(rollout_id: str, episode_id: str) -> str:
        return agent.run_job(rollout_id, episode_id)

    def ready(**_: Any) -> None:
        sys.stdout.write(f"FORKYARD_NODE={agent.node}\n")
        sys.stdout.flush()

    def shutting_down(**_: Any) -> None:
        agent.stop_jobs()

    worker_ready.connect(ready, weak=False)
    worker_shutting_down.connect(shutting_down, weak=False)
    agent.start()
    try:
        app.worker_main([
            "worker", "--pool=threads", f"--concurrency={capacity}", f"--queues={SHARED_QUEUE},{node_queue(agent.node)}",
            f"--hostname={agent.node}@forkyard", "--without-gossip", "--without-mingle", "--without-heartbeat",
            f"--loglevel={log_level}",
        ])
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        agent.stop()
    return 0


class NodeCalls:
    """A worker node's side of the node channel: the calls of :class:`FleetRuntime`, on the node's runtime."""

    CALLS = frozenset({"open_session", "step", "snapshot_session", "fork_session", "delete_snapshot",
                       "close_session", "list_sandboxes", "session_count"})

    def __init__(self, runtime: Any, load_task: Any) -> None:
        self._runtime = runtime
        self._load_task = load_task

    async def reply(self, request: Any) -> Any:
        """Answer one ``NodeRequest`` with its ``NodeReply`` (a worker error travels in it)."""
        try:
            args = json.loads(request.args_json or "{}")
            handler = getattr(self, f"_{request.method}") if request.method in self.CALLS else None
            if handler is None:
                raise NotSupportedError(f"unknown node call {request.method!r}")
            return pb2.NodeReply(id=request.id, result_json=json.dumps(await handler(**args),
                                                                        default=wire_json_default))
        except WorkerError as exc:
            return pb2.NodeReply(id=request.id, error_json=json.dumps(exc.to_wire(), default=str))
        except Exception as exc:
            return pb2.NodeReply(id=request.id, error_json=json.dumps(worker_error(exc).to_wire()))

    async def _open_session(self, session_id: str, task_id: str, labels: dict[str, str]) -> dict[str, Any]:
        task, env_version = await self._load_task(task_id)
        opened = await self._runtime.open_session(session_id, task, labels=labels, env_version=env_version)
        return OpenedWire.of(opened).model_dump()

    async def _step(self, session_id: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        return StepWire.of(await self._runtime.step(session_id, tool, arguments)).model_dump()

    async def _snapshot_session(self, session_id: str, metadata: dict[str, str]) -> dict[str, Any]:
        return dict((await self._runtime.snapshot_session(session_id, metadata=metadata)).to_json())

    async def _fork_session(self, snapshot: dict[str, Any], session_ids: list[str], task_id: str,
                            labels: dict[str, str]) -> list[dict[str, Any]]:
        task, _ = await self._load_task(task_id)
        opened = await self._runtime.fork_session(self._runtime.snapshot_from_json(snapshot), session_ids, task,
                                                  labels=labels)
        return [OpenedWire.of(o).model_dump() for o in opened]

    async def _delete_snapshot(self, snapshot_id: str) -> None:
        await self._runtime.delete_snapshot(snapshot_id)

    async def _close_session(self, session_id: str) -> None:
        await self._runtime.close_session(session_id)

    async def _list_sandboxes(self) -> list[dict[str, Any]]:
        return [SandboxWire.of(s).model_dump() for s in await self._runtime.list_sandboxes()]

    async def _session_count(self) -> int:
        return int(self._runtime.session_count())

