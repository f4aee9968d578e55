"""The FastAPI app factory; everything (DB engine, migrations, runtime) is built in the lifespan."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI

from gateway.artifacts.router import router as artifacts_router
from gateway.auth import service as auth_service
from gateway.auth.dependencies import require_api_key
from gateway.console.router import install_console
from gateway.db import (
    RecordWriter,
    check_database,
    create_engine,
    create_sessionmaker,
    redact_database_url,
    upgrade_database,
)
from gateway.dependencies import step_gate_of
from gateway.environments import service as environments_service
from gateway.environments.router import router as environments_router
from gateway.episodes.router import router as episodes_router
from gateway.errors import install_error_handlers
from gateway.metrics import router as metrics_router
from gateway.middleware import BodySizeLimitMiddleware, RequestIdMiddleware
from gateway.nodes.drain import DrainFlag
from gateway.nodes.heartbeat import Heartbeat
from gateway.nodes.router import router as nodes_router
from gateway.openapi import declare_error_responses
from gateway.policies.router import router as policies_router
from gateway.rollouts.dispatch import Dispatcher
from gateway.rollouts.events import RedisBridge, rollout_events
from gateway.rollouts.executor import Executor
from gateway.rollouts.hosting import EpisodeHost
from gateway.rollouts.reporting import PolicyStates
from gateway.rollouts.router import router as rollouts_router
from gateway.sandboxes.router import router as sandboxes_router
from gateway.sessions import service as sessions_service
from gateway.sessions.router import router as sessions_router
from gateway.settings import Settings
from gateway.snapshots.router import router as snapshots_router
from gateway.tasks.router import router as tasks_router
from workers.runner import StageLimits

if TYPE_CHECKING:
    from workers.runtime import WorkerRuntime

logger = logging.getLogger(__name__)

API_VERSION = "0.1.0"


def build_runtime(settings: Settings, *, default_pool_idle: int = 0) -> WorkerRuntime:
    """Build the sandbox backend and the worker runtime the settings ask for (not started).

    ``default_pool_idle`` is the warm pool's size when ``FORKYARD_POOL__MAX_IDLE`` is unset
    (0, off, in the embedded mode; a node's capacity on ``forkyard worker``).
    """
    from sandboxes.backends import create_backend
    from workers.pool import PoolPolicy, WarmPool
    from workers.runtime import WorkerRuntime
    from workers.setup_cache import SetupCache

    backend = create_backend(
        settings.backend, node=settings.node, root_dir=settings.sandboxes_dir, docker_url=settings.docker_url,
        isolation=settings.isolation, runtime=settings.runtime,
        egress_ports=settings.egress.tcp_ports, egress_networks=settings.egress.allow_networks,
    )  # fmt: skip
    cache = None
    if settings.setup_cache.max_bytes > 0:
        assert settings.setup_cache.dir is not None
        cache = SetupCache(backend, settings.setup_cache.dir, max_bytes=settings.setup_cache.max_bytes)
    from workers.trust import read_ca_bundle

    pooling = settings.pool
    max_idle = pooling.max_idle if pooling.max_idle is not None else default_pool_idle
    pool = None
    if max_idle > 0:
        policy = PoolPolicy(max_idle=max_idle, window_s=pooling.window_s, headroom=pooling.headroom,
                            sizes=pooling.sizes, fill_concurrency=pooling.fill_concurrency,
                            breaker_failures=pooling.breaker_failures, breaker_cooldown_s=pooling.breaker_cooldown_s)
        pool = WarmPool(backend, policy, poolable=(lambda snap: cache.holds(snap.id)) if cache else lambda snap: False)
    return WorkerRuntime(backend, image_cache_dir=settings.image_cache_dir, setup_cache=cache,
                         ca_bundle=read_ca_bundle(settings.ca_bundle), stand_ins=settings.images.stand_ins,
                         image_max_bytes=settings.images.max_bytes or None, pool=pool)


def _log_progress(line: str) -> None:
    logger.info("image: %s", line)


def create_app(settings: Settings | None = None, *, runtime: Any = None, distributed: bool = False) -> FastAPI:
    """Create the gateway app.

    Args:
        settings: configuration; default: read from ``FORKYARD_*`` now.
        runtime: a worker runtime to use instead of building one from the settings.
            The app starts it and closes its sessions at shutdown, but only closes
            (``aclose``) a runtime it built itself.
        distributed: the distributed mode's gateway (``forkyard gateway``): no sandboxes of
            its own; episodes are placed on worker nodes over Celery + Redis
            (:class:`~gateway.fleet.scheduler.FleetScheduler`). Needs ``redis_url``.
    """
    settings = settings or Settings()
    if distributed and not settings.redis_url:
        raise ValueError("the distributed mode needs a Redis URL (FORKYARD_REDIS_URL)")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from workers.envs.registry import configure_families

        configure_families(settings.family_options())
        url = settings.database_url
        assert url is not None
        try:
            if settings.auto_migrate:
                await asyncio.to_thread(upgrade_database, url)
            else:
                await asyncio.to_thread(check_database, url)
        except Exception as exc:
            app.state.startup_error = exc
            raise
        engine = create_engine(url)
        sessionmaker = create_sessionmaker(engine)
        writer = RecordWriter(url)
        gate = step_gate_of(app)
        gate.writer = writer  # records are written behind the answers while the app runs
        app.state.settings = settings
        app.state.engine = engine
        app.state.sessionmaker = sessionmaker
        app.state.runtime = None
        app.state.drain = None  # the embedded mode's node's flag, below
        app.state.policy_states = policy_states = PolicyStates(sessionmaker)
        rt = runtime
        executor: Executor | None = None
        heartbeat: Heartbeat | None = None
        bridge: RedisBridge | None = None
        grpc_server: Any = None
        ready = False
        try:
            async with sessionmaker() as db_session:
                await environments_service.ensure_default_environments(db_session=db_session)
                if settings.bootstrap_api_key is not None:
                    await auth_service.create_api_key(
                        db_session=db_session, name="bootstrap", key=settings.bootstrap_api_key.get_secret_value()
                    )
            if settings.redis_url:
                bridge = RedisBridge(rollout_events, settings.redis_url)
                await bridge.start()
            if distributed:
                from gateway.fleet.scheduler import FleetScheduler
                from gateway.fleet.sessions import FleetRuntime

                executor = FleetScheduler(sessionmaker, settings)
                await executor.start()
                app.state.executor = executor
                fleet_runtime = FleetRuntime(sessionmaker)
                app.state.runtime = fleet_runtime
                app.state.place_session = fleet_runtime.place_session
            else:
                if rt is None:
                    rt = await asyncio.to_thread(build_runtime, settings)
                await rt.start(progress=_log_progress)
                async with sessionmaker() as db_session:
                    await sessions_service.recover_node(db_session=db_session, runtime=rt, node=settings.node)
                app.state.runtime = rt
                stages = StageLimits.of(
                    setup=settings.stages.setup, agent=settings.stages.agent, verify=settings.stages.verify
                )
                host = EpisodeHost(sessionmaker=sessionmaker, runtime=rt, node=settings.node, stages=stages,
                                   policies=policy_states)
                dispatcher = Dispatcher(sessionmaker=sessionmaker, host=host, drain_poll_s=settings.nodes.heartbeat_s)
                await dispatcher.start()
                app.state.executor = executor = dispatcher
                app.state.drain = drain = DrainFlag(settings.node)  # set by each beat and by drains through here
                app.state.heartbeat = heartbeat = Heartbeat(
                    sessionmaker, node=settings.node, backend=rt.backend_name, capacity=settings.stages.agent,
                    load=lambda: {**rt.load_report(), "episodes": dispatcher.running_episodes,
                                  "stages": stages.in_use()},
                    interval_s=settings.nodes.heartbeat_s, sandboxes=rt.list_sandboxes,
                    made_after=rt.sandboxes_made_after,
                    demand=pool.set_demand if (pool := getattr(rt, "pool", None)) is not None else None,
                    commands=rt.run_command, drain=drain,
                )
                await heartbeat.start()
            if settings.grpc_port is not None:
                from gateway.grpc.server import start_server

                grpc_server, app.state.grpc_port = await start_server(
                    app, settings.grpc_host, settings.grpc_port, max_message_bytes=settings.max_body_bytes)
            logger.info("gateway ready: %s, database %s",
                        "distributed mode" if distributed else f"node {settings.node}", redact_database_url(url))
            ready = True
            yield
        except Exception as exc:
            if not ready:
                app.state.startup_error = exc  # lets `forkyard up` say why in one line
            raise
        finally:
            remote = app.state.runtime if distributed else None
            app.state.runtime = None
            try:
                if remote is not None:
                    await remote.aclose()
                if grpc_server is not None:
                    await grpc_server.stop(grace=2.0)  # steps under way finish; new streams are refused
                if heartbeat is not None:
                    await heartbeat.aclose()
                if bridge is not None:
                    await bridge.aclose()
                if executor is not None:
                    # Episodes still running stay `running` in the DB and are requeued at the next start.
                    await executor.aclose()
                await gate.settle()  # the records still being written
                gate.writer = None  # from now on, written before the answers (the sessions' closes)
                await asyncio.to_thread(writer.close)
                if rt is not None:
                    try:
                        async with sessionmaker() as db_session:
                            closed = await sessions_service.close_node_sessions(
                                db_session=db_session, runtime=rt, node=settings.node, reason="the gateway shut down"
                            )
                        if closed:
                            logger.info("closed %d open session(s) at shutdown", closed)
                    finally:
                        if runtime is None:
                            await rt.aclose()
            finally:
                if gate.writer is writer:  # a shutdown that failed before letting the writer go
                    gate.writer = None
                    await asyncio.to_thread(writer.close)
                await engine.dispose()

    app = FastAPI(
        title="Forkyard",
        version=API_VERSION,
        description="Rollout-as-a-service gateway for agentic RL: tasks, sessions, sandboxes, rollouts and episodes.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.startup_error = None
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(RequestIdMiddleware)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """Answer ok while the gateway serves requests."""
        return {"status": "ok"}

    app.include_router(metrics_router)  # open like /healthz: scrapers carry no API key
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
    # Starlette tries the routes one by one, in this order: the ones a trainer calls every turn come first.
    for router in (sessions_router, snapshots_router, environments_router, tasks_router, sandboxes_router,
                   rollouts_router, episodes_router, policies_router, nodes_router, artifacts_router):
        v1.include_router(router)
    app.include_router(v1)
    install_console(app)
    declare_error_responses(app)
    return app
