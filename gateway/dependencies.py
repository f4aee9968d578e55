"""FastAPI dependencies for what the lifespan built: DB sessions, settings and the worker runtime."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db import get_db_session
from gateway.errors import UnavailableError
from gateway.nodes.drain import DrainFlag
from gateway.sessions.gate import StepGate
from gateway.settings import Settings
from workers.protocol import WorkerClient


async def get_settings(request: Request) -> Settings:
    """Return the settings the app was created with.

    Every dependency here is ``async``: FastAPI runs a plain ``def`` one in a worker thread,
    a hop that cost a step through the API more than the database did.
    """
    return request.app.state.settings


async def get_runtime(request: Request) -> WorkerClient:
    """Return the worker runtime; answer 503 if the gateway has none running."""
    runtime = getattr(request.app.state, "runtime", None)
    if runtime is None:
        raise UnavailableError("No worker runtime is running on this gateway.")
    return runtime


async def get_session_node(request: Request, db_session: Annotated[AsyncSession, Depends(get_db_session)]) -> str:
    """Return the node a new session goes to: this one, or (distributed mode) the one the fleet places it on."""
    place = getattr(request.app.state, "place_session", None)
    if place is None:
        return request.app.state.settings.node
    return await place(db_session)


def fork_node_of(app: Any) -> str:
    """Return the node ``app``'s forks start on: this one, or (distributed mode, "") the node holding the snapshot."""
    return "" if getattr(app.state, "place_session", None) is not None else app.state.settings.node


async def get_fork_node(request: Request) -> str:
    """Return the node forks start on (:func:`fork_node_of` the request's app)."""
    return fork_node_of(request.app)


def step_gate_of(app: Any) -> StepGate:
    """Return ``app``'s record of which sessions are stepping or closing (REST and gRPC share it)."""
    gate = getattr(app.state, "step_gate", None)
    if gate is None:
        gate = app.state.step_gate = StepGate()  # the lifespan gives it its writer
    return gate


def drain_flag_of(app: Any) -> DrainFlag | None:
    """Return ``app``'s own node's drain flag as this process knows it; None in the distributed mode."""
    return getattr(app.state, "drain", None)


async def get_drain_flag(request: Request) -> DrainFlag | None:
    """Return the request's app's :func:`drain_flag_of`."""
    return drain_flag_of(request.app)


async def get_step_gate(request: Request) -> StepGate:
    """Return the app's record of which sessions are stepping or closing."""
    return step_gate_of(request.app)


DbSession = Annotated[AsyncSession, Depends(get_db_session)]
"""A database session for one request."""
Runtime = Annotated[WorkerClient, Depends(get_runtime)]
"""The worker runtime the lifespan started."""
CurrentSettings = Annotated[Settings, Depends(get_settings)]
"""The app's settings."""
Gate = Annotated[StepGate, Depends(get_step_gate)]
"""One step at a time per session (:class:`gateway.sessions.service.StepGate`)."""
SessionNode = Annotated[str, Depends(get_session_node)]
"""The node a new session opens on."""
ForkNode = Annotated[str, Depends(get_fork_node)]
"""The node a fork starts on ("": the snapshot's)."""
Drain = Annotated[DrainFlag | None, Depends(get_drain_flag)]
"""This process's node's drain flag (:class:`gateway.nodes.heartbeat.DrainFlag`); None in the distributed mode."""
