"""``/v1/environments`` routes."""

from __future__ import annotations

from fastapi import APIRouter, Query

from gateway.dependencies import DbSession
from gateway.environments import service
from gateway.environments.schemas import (
    EnvironmentCreate,
    EnvironmentPage,
    EnvironmentRead,
)
from gateway.pagination import DEFAULT_LIMIT, MAX_LIMIT

router = APIRouter(prefix="/environments", tags=["environments"])


@router.post("", status_code=201, response_model=EnvironmentRead)
async def create_environment(spec: EnvironmentCreate, db_session: DbSession):
    """Create an environment."""
    return service.environment_read(await service.create_environment(db_session=db_session, spec=spec))


@router.get("", response_model=EnvironmentPage)
async def list_environments(
    db_session: DbSession,
    limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT),
    cursor: str | None = None,
):
    """List environments, oldest first."""
    rows, next_cursor = await service.list_environments(db_session=db_session, limit=limit, cursor=cursor)
    return EnvironmentPage(items=[service.environment_read(r) for r in rows], next=next_cursor)


@router.get("/{environment_id}", response_model=EnvironmentRead)
async def get_environment(environment_id: str, db_session: DbSession):
    """Return one environment, with the tools its family gives an agent."""
    return service.environment_read(await service.get_environment(db_session=db_session, environment_id=environment_id))
